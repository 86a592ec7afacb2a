"""What steering a request got, reported back: the log line, and the HTTP response field.

The OpenAI middleware (server/response_field.py) opens a holder for each HTTP request in a
context variable; the front end fills it when the request is prepared (same task, or a task
created from it, so the same holder object is visible).
"""

from __future__ import annotations

import contextvars
import logging

logger = logging.getLogger("vllm.steer")

_HOLDER: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vllm_steer_applied", default=None)


def open_holder() -> tuple[dict, contextvars.Token]:
    holder: dict = {}
    return holder, _HOLDER.set(holder)


def close_holder(token: contextvars.Token) -> None:
    _HOLDER.reset(token)


def record_applied(request_id: str, prefill_key: str | None, decode_key: str | None) -> None:
    logger.info("vllm-steer: request %s steered: prefill=%s decode=%s", request_id, prefill_key, decode_key)
    holder = _HOLDER.get()
    if holder is not None:
        holder["prefill"] = prefill_key
        holder["decode"] = decode_key


def record_capture(request_id: str, driver_instances: list[str] | None = None) -> None:
    """The request captures: the response middleware collects driver results for it
    (``driver_instances``: the driver consumer instances it uses, which return results)."""
    holder = _HOLDER.get()
    if holder is not None:
        holder.setdefault("capture_ids", []).append(request_id)
        holder.setdefault("capture_instances", {})[request_id] = list(driver_instances or ())
