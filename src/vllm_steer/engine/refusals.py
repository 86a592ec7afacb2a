"""Engine side of ``core.refusals``: finish a request the scheduler accepted but will not run, and
send its reason to the client in the next step's outputs.

``refuse`` finishes the requests with vLLM's ``FINISHED_ERROR`` (their rows and blocks are freed by
the scheduler as for any finished request) and keeps them in the scheduler's outbox;
``flush`` appends one finished ``EngineCoreOutput`` per request, carrying the encoded reason in
``stop_reason``, to the outputs ``Scheduler.update_from_output`` returns. A finished request keeps
the engine stepping until its output went out (vLLM's ``has_requests`` counts finished ids).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_steer.core.refusals import Refusal

logger = logging.getLogger("vllm.steer")


def refuse(scheduler: Any, request_ids: list[str], refusal: Refusal) -> None:
    from vllm.v1.request import RequestStatus

    for request in scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR):
        logger.warning("vllm-steer: request %s refused (%d): %s", request.request_id, refusal.status, refusal.message)
        scheduler.steer_outbox.append((request, refusal))


def flush(scheduler: Any, outputs: dict) -> None:
    """Append the refused requests' final outputs to ``update_from_output``'s result (by client)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    for request, refusal in scheduler.steer_outbox:
        eco = outputs.get(request.client_index)
        if eco is None:
            eco = outputs[request.client_index] = EngineCoreOutputs()
        take_events = getattr(request, "take_events", None)
        eco.outputs.append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
            stop_reason=refusal.encode(), events=take_events() if take_events else None,
            trace_headers=getattr(request, "trace_headers", None)))
    scheduler.steer_outbox.clear()
