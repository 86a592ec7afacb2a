"""``collect(llm, outputs)``: for ``vllm.LLM`` users, attach driver consumers' per-request results
to the outputs as ``output.capture``.

(The OpenAI server does this itself: results appear as ``"capture"`` in the response.) Results come
to this process's inbox (``capture.inbox``) on their own; ``collect`` makes ONE call,
``vllm_steer_capture_publish``, because vLLM tells workers a request finished only at the next
engine step and an in-process engine is not stepped after its last output. It then waits at most
``steer.capture_result_timeout_s``, after which each driver instance without a result gets
``timeout_error(...)`` (``engine_dead`` at once when the engine is gone).
"""

from __future__ import annotations

from typing import Any

from vllm_steer.capture.inbox import engine_dead_error, inbox, timeout_error
from vllm_steer.core.config import steer_config_of
from vllm_steer.core.rpc import CapturePublish, call_args

__all__ = ["collect", "timeout_error", "engine_dead_error", "DEFAULT_TIMEOUT_S", "PUBLISH"]

PUBLISH = "vllm_steer_capture_publish"  # core.rpc.METHODS
DEFAULT_TIMEOUT_S = 30.0


def _timeout_of(llm: Any) -> float:
    try:
        cfg = steer_config_of(llm.llm_engine.vllm_config)
    except Exception:
        cfg = None
    return cfg.capture_result_timeout_s if cfg is not None else DEFAULT_TIMEOUT_S


def _engine_dead(llm: Any) -> bool:
    """Whether the engine core process is gone (a local flag of vLLM's client, not a call)."""
    resources = getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def collect(llm: Any, outputs: list[Any], timeout: float | None = None) -> list[Any]:
    """Set ``o.capture`` (driver instance -> result) on each output, waiting at most ``timeout``
    seconds (default ``steer.capture_result_timeout_s``) for slow consumers."""
    if timeout is None:
        timeout = _timeout_of(llm)
    ids = [o.request_id for o in outputs]
    if not _engine_dead(llm):
        llm.collective_rpc(PUBLISH, args=call_args(CapturePublish(ids)))
    results = inbox().wait_blocking(ids, timeout, dead=lambda: _engine_dead(llm))
    for o in outputs:
        o.capture = results.get(o.request_id, {})
    return outputs
