"""What steering an ``LLM`` (or ``AsyncLLM``) request got, on its outputs: every ``RequestOutput`` of a steered
request carries ``steering``, the same dict as the HTTP response field (``frontend.applied.steering_field``:
the two config keys, the module, site count, SAEs, ...); unsteered requests' outputs read ``steering`` None.

How it gets there, with no per-step work for unsteered requests: ``process_inputs`` (``frontend.prepare``) notes
the dict on the request's own ``SamplingParams`` (``mark``; a plain attribute of its ``__dict__``, never sent to
the engine core: msgspec encodes fields only). ``OutputProcessor.add_request`` (patched) looks for it when it
makes the request's state (for ``n`` > 1 on the parent's params: the children's are copies without it) and, only
for a steered request, wraps that one state's ``_new_request_output`` to set the attribute on each output it
builds. ``RequestOutput.steering`` is a class attribute (None) so every output reads it. The wrapper holds its state
weakly: a strong reference (the bound method) made a cycle a steered request, left to the API process's cyclic
collector (s41).
"""

from __future__ import annotations

import weakref
from typing import Any

ATTR = "_vllm_steer_applied"


def mark(params: Any, field: dict) -> None:
    """Note a steered request's ``steering`` dict on its (cloned) sampling params."""
    setattr(params, ATTR, field)


def applied_of(request: Any, parent_req: Any) -> dict | None:
    """The dict ``mark`` noted for this engine request (or its parent's params when fanned out)."""
    found = getattr(request.sampling_params, ATTR, None)
    if found is None and parent_req is not None:
        found = getattr(parent_req.sampling_params, ATTR, None)
    return found


def _carrying(state: Any, applied: dict) -> None:
    """``state`` (one request's ``RequestState``) sets ``steering`` on every ``RequestOutput`` it builds."""
    build, owner = type(state)._new_request_output, weakref.ref(state)

    def new_request_output(*args: Any, **kwargs: Any) -> Any:
        out = build(owner(), *args, **kwargs)
        out.steering = applied
        return out

    state._new_request_output = new_request_output


def patch_output_processor_applied() -> None:
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.output_processor import OutputProcessor

    original = OutputProcessor.add_request
    if getattr(original, "_vllm_steer", False):
        return
    RequestOutput.steering = None  # unsteered requests' outputs (and every output of another process's requests)

    def add_request(self, request, prompt, parent_req=None, *args, **kwargs):
        known = request.request_id in self.request_states  # a streaming-input update: its state exists
        original(self, request, prompt, parent_req, *args, **kwargs)
        applied = None if known else applied_of(request, parent_req)
        if applied is not None:
            _carrying(self.request_states[request.request_id], applied)

    add_request._vllm_steer = True  # type: ignore[attr-defined]
    OutputProcessor.add_request = add_request
