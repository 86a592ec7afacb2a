"""The API / ``LLM`` process's side of ``steering_condition.stop_when`` (``core.stops``): a request
the probe stopped reaches the client with ``finish_reason`` ``"stop_when"`` and the gate that stopped
it as ``stop_reason``, not as vLLM's plain ``"stop"``. Wraps ``RequestState._new_completion_output``
(vLLM's output processor, in the process that serves the client), so OpenAI responses (streaming or
not, completions and chat) and ``LLM`` results read the same."""

from __future__ import annotations

from vllm_steer.core.stops import FINISH_REASON, decode


def patch_output_processor() -> None:
    from vllm.v1.engine.output_processor import RequestState

    original = RequestState._new_completion_output
    if getattr(original, "_vllm_steer", False):
        return

    def _new_completion_output(self, token_ids, finish_reason, stop_reason, *args, **kwargs):
        output = original(self, token_ids, finish_reason, stop_reason, *args, **kwargs)
        score = decode(stop_reason) if finish_reason is not None else None
        if score is not None:
            output.finish_reason, output.stop_reason = FINISH_REASON, score
        return output

    _new_completion_output._vllm_steer = True  # type: ignore[attr-defined]
    RequestState._new_completion_output = _new_completion_output
