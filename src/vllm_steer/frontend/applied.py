"""What steering a request got, reported back: the log line, the HTTP response field (``steering_field``: its value,
also what ``frontend.applied_output`` puts on an ``LLM``'s ``RequestOutput.steering``).

The OpenAI middleware (server/response_field.py) opens a holder for each HTTP request in a
context variable; the front end fills it when the request is prepared (same task, or a task
created from it, so the same holder object is visible). A request the engine refused after
accepting it (``core.refusals``) leaves its refusal there too (``watch_refusal``), for the
middleware to answer with its status instead of vLLM's 500.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from vllm_steer.core.refusals import decode

logger = logging.getLogger("vllm.steer")

_HOLDER: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vllm_steer_applied", default=None)


def open_holder() -> tuple[dict, contextvars.Token]:
    holder: dict = {}
    return holder, _HOLDER.set(holder)


def close_holder(token: contextvars.Token) -> None:
    _HOLDER.reset(token)


def steering_field(prefill_key: str | None, decode_key: str | None, report: dict | None) -> dict:
    """The ``steering`` object a steered request's response carries: the two config keys, then the report."""
    return {"prefill": prefill_key, "decode": decode_key, **(report or {})}


def record_applied(request_id: str, prefill_key: str | None, decode_key: str | None,
                   report: dict | None = None) -> None:
    """``report``: what else the response says (``frontend.applied_report``: module, sites, SAEs, ...)."""
    logger.info("vllm-steer: request %s steered: prefill=%s decode=%s %s", request_id, prefill_key, decode_key,
                report or "")
    holder = _HOLDER.get()
    if holder is not None:
        holder["prefill"] = prefill_key
        holder["decode"] = decode_key
        holder["report"] = report or {}


def record_capture(request_id: str, driver_instances: list[str] | None = None) -> None:
    """The request captures: the response middleware collects driver results for it
    (``driver_instances``: the driver consumer instances it uses, which return results)."""
    holder = _HOLDER.get()
    if holder is not None:
        holder.setdefault("capture_ids", []).append(request_id)
        holder.setdefault("capture_instances", {})[request_id] = list(driver_instances or ())


def watch_refusal(collector: Any) -> None:
    """Note in the open holder (if any) the refusal a request's final output carries: wraps the
    ``put`` of vLLM's per-request output collector (``AsyncLLM.add_request`` returns it)."""
    holder = _HOLDER.get()
    put = getattr(collector, "put", None)
    if holder is None or put is None:
        return

    def put_watching(output: Any) -> None:
        if getattr(output, "finished", False):
            for choice in getattr(output, "outputs", None) or ():
                refusal = decode(choice.stop_reason) if choice.finish_reason == "error" else None
                if refusal is not None:
                    holder["refused"] = refusal
            # the wrapper and the collector hold each other (the bound ``put``): unwrapped at the last output,
            # the request's objects are freed when it ends, not by the API process's next cyclic collection
            # (s41: ~20 objects a capturing request, generation-2 pauses of 22-34 ms under load)
            del collector.put
        put(output)

    collector.put = put_watching
