"""Off the event loop: the OpenAI server prepares inline steering vectors in a thread pool.

vLLM 0.26 calls ``InputProcessor.process_inputs`` synchronously inside the async
``AsyncLLM.add_request``, so a request carrying vectors (decode base64, validate, hash, pack: a few
ms at 8B) would block the API server's event loop: every other stream's chunks and arrivals wait.
The patch of ``add_request`` runs ``SteeringFrontend.engine_extra_args`` in a small pool first
(base64, numpy and hashlib release the GIL for large buffers) and hands the result to
``process_inputs`` through a context variable, matched by the identity of the request's
``extra_args``. Module-only references are cached by the front end and stay inline.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

from vllm_steer.spec import TIER_FIELDS

_POOL: ThreadPoolExecutor | None = None
_PREPARED: ContextVar[tuple[int, Any] | None] = ContextVar("vllm_steer_prepared", default=None)


def prepared_for(extra_args: dict) -> Any | None:
    """The result prepared off the loop for exactly this ``extra_args`` dict, if any."""
    got = _PREPARED.get()
    return got[1] if got is not None and got[0] == id(extra_args) else None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="vllm-steer-prepare")
    return _POOL


def patch_async_add_request(frontend_of) -> None:
    """Patch: ``vllm.v1.engine.async_llm.AsyncLLM.add_request`` (0.26). Why: the only async
    point before ``process_inputs``. ``frontend_of(input_processor)`` gives the request front end.
    Remove if vLLM moves input processing off the event loop."""
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.add_request, "_vllm_steer", False):
        return
    original = AsyncLLM.add_request

    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        extra = getattr(params, "extra_args", None)
        if not (isinstance(params, SamplingParams) and extra and any(extra.get(k) for k in TIER_FIELDS)):
            return await original(self, request_id, prompt, params, *args, **kwargs)
        frontend = frontend_of(self.input_processor)
        result = await asyncio.get_running_loop().run_in_executor(
            _pool(), frontend.engine_extra_args, extra, request_id)
        token = _PREPARED.set((id(extra), result))
        try:
            return await original(self, request_id, prompt, params, *args, **kwargs)
        finally:
            _PREPARED.reset(token)

    add_request._vllm_steer = True  # type: ignore[attr-defined]
    AsyncLLM.add_request = add_request
