"""What steering an ``LLM`` (or ``AsyncLLM``) request got, on its outputs: every ``RequestOutput`` of a steered
request carries ``steering``, the same dict as the HTTP response field (``frontend.applied.steering_field``:
the two config keys, the module, site count, SAEs, ...); unsteered requests' outputs read ``steering`` None.

How it gets there, with no per-step work for unsteered requests: ``process_inputs`` (``frontend.prepare``) notes
the dict on the request's own ``SamplingParams`` (``mark``; a plain attribute of its ``__dict__``, never sent to
the engine core: msgspec encodes fields only). ``OutputProcessor.add_request`` (patched) looks for it when it
makes the request's state (for ``n`` > 1 on the parent's params: the children's are copies without it) and, only
for a steered request, notes it on that state; ``RequestState._new_request_output`` (patched once) sets it on each
output a noting state builds. ``RequestOutput.steering`` and ``RequestState``'s note are class attributes (None) so
every output and state reads them. (Wrapping each steered state's method instead made a reference cycle a request:
its objects waited for the API process's cyclic collector, s41.)
"""

from __future__ import annotations

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


def _carrying(build: Any) -> Any:
    """``RequestState._new_request_output`` that sets ``steering`` on each output of a state noting one."""

    def new_request_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = build(self, *args, **kwargs)
        if self.vllm_steer_applied is not None:
            out.steering = self.vllm_steer_applied
        return out

    return new_request_output


def patch_output_processor_applied() -> None:
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    original = OutputProcessor.add_request
    if getattr(original, "_vllm_steer", False):
        return
    RequestOutput.steering = None  # unsteered requests' outputs (and every output of another process's requests)
    RequestState.vllm_steer_applied = None
    RequestState._new_request_output = _carrying(RequestState._new_request_output)

    def add_request(self, request, prompt, parent_req=None, *args, **kwargs):
        known = request.request_id in self.request_states  # a streaming-input update: its state exists
        original(self, request, prompt, parent_req, *args, **kwargs)
        applied = None if known else applied_of(request, parent_req)
        if applied is not None:
            self.request_states[request.request_id].vllm_steer_applied = applied

    add_request._vllm_steer = True  # type: ignore[attr-defined]
    OutputProcessor.add_request = add_request
