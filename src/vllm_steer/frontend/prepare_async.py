"""Off the event loop for ``AsyncLLM`` users: steering vectors are prepared in a thread pool.

vLLM calls ``InputProcessor.process_inputs`` synchronously inside the async ``AsyncLLM.add_request``,
so a request carrying vectors (decode, validate, hash, pack: about a millisecond at 8B) would block
the event loop: every other stream's chunks and arrivals wait. The patch of ``add_request`` runs
``SteeringFrontend.engine_extra_args`` in the preparation pool first and hands the result to
``process_inputs`` by token (frontend.prepared). Requests through the OpenAI server arrive already
prepared by the request middleware (server.request_body) and pass straight through. The output
collector of a request that may be steered reports an engine refusal to the HTTP middleware
(``frontend.applied.watch_refusal``).
"""

from __future__ import annotations

import asyncio
import copy

from vllm_steer.core.vectors import TIER_FIELDS
from vllm_steer.frontend.applied import watch_refusal
from vllm_steer.frontend.prepared import PREPARED, TOKEN_FIELD, pool


def patch_async_add_request() -> None:
    """Patch: ``vllm.v1.engine.async_llm.AsyncLLM.add_request`` (see vllm_steer.patches)."""
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_steer.frontend.prepare import frontend_of

    if getattr(AsyncLLM.add_request, "_vllm_steer", False):
        return
    original = AsyncLLM.add_request

    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        extra = getattr(params, "extra_args", None)
        if not (isinstance(params, SamplingParams) and extra and TOKEN_FIELD not in extra
                and any(extra.get(k) for k in TIER_FIELDS)):
            collector = await original(self, request_id, prompt, params, *args, **kwargs)
            if extra and isinstance(params, SamplingParams):  # maybe steered: its refusal is reported
                watch_refusal(collector)
            return collector
        frontend = frontend_of(self.input_processor)
        prepared = await asyncio.get_running_loop().run_in_executor(pool(), frontend.engine_extra_args, extra)
        token = PREPARED.put(prepared)
        params = copy.copy(params)  # the caller's params keep their fields
        params.extra_args = {TOKEN_FIELD: token}
        try:
            collector = await original(self, request_id, prompt, params, *args, **kwargs)
        finally:
            PREPARED.drop(token)
        watch_refusal(collector)
        return collector

    add_request._vllm_steer = True  # type: ignore[attr-defined]
    AsyncLLM.add_request = add_request
