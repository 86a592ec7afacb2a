"""Driver consumers' results for the responses of one API server process, without waiting in the engine.

The response middleware (``server.response_field``) hands each finished capturing response's request
ids to this process's poller and awaits a future. While any response waits, the poller issues ONE
``vllm_steer_capture_collect`` call per tick (every ``TICK_S``) for all of their ids, to every engine
(``core.compat.rpc_every_engine``: under DP each engine knows its own requests); workers answer at
once with what is ready (``runtime.capture.CaptureRuntime.collect_results``). A response is resolved
when every worker reports all of its ids done, or at its deadline (``steer.capture_result_timeout_s``
after it finished), when each driver instance still running gets ``capture.collect.timeout_error``;
deadlines hold even when the engine is slow to answer (one question in flight; an answer is awaited
no longer than the soonest deadline).
Idle, the poller does nothing (its task ends when nothing waits). A slow consumer therefore delays
only the ``capture`` field of its own requests: the engine core is never held by a consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm_steer.capture.collect import METHOD, PendingResults
from vllm_steer.core.rpc import CaptureCollect, call_args
from vllm_steer.core.compat import rpc_every_engine

logger = logging.getLogger("vllm.steer")

TICK_S = 0.01


@dataclass
class _Wait:
    pending: PendingResults
    deadline: float
    timeout: float
    expected: dict[str, list[str]]
    future: asyncio.Future


class CaptureResultPoller:
    def __init__(self, engine_client: Any) -> None:
        self.engine = engine_client
        self._waits: list[_Wait] = []
        self._task: asyncio.Task | None = None
        self._stray: set[asyncio.Task] = set()  # questions whose every response timed out, until they land

    async def results(self, ids: list[str], timeout: float, expected: dict[str, list[str]] | None = None) -> dict:
        """Driver results by request id (instance -> result, or a timeout error object)."""
        loop = asyncio.get_running_loop()
        wait = _Wait(PendingResults(ids), time.monotonic() + timeout, timeout, expected or {}, loop.create_future())
        self._waits.append(wait)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        return await wait.future

    async def _run(self) -> None:
        try:
            await self._loop()
        except BaseException:  # never leave a response waiting on a dead poller
            logger.exception("vllm-steer: the capture result poller stopped")
            waits, self._waits = self._waits, []
            for w in waits:
                if not w.future.done():
                    w.future.set_result(w.pending.finish(w.timeout, w.expected))
            raise

    async def _loop(self) -> None:
        call: asyncio.Task | None = None  # at most one question in flight
        asked: list[str] = []
        while self._waits:
            if call is None:
                asked = sorted(set().union(*(w.pending.open for w in self._waits)))
                if asked:
                    call = asyncio.ensure_future(rpc_every_engine(self.engine, METHOD, call_args(CaptureCollect(asked))))
            answers = None
            if call is not None:  # wait for the answer, never past the soonest deadline
                soonest = min(w.deadline for w in self._waits)
                await asyncio.wait({call}, timeout=max(soonest - time.monotonic(), 0.0))
                if call.done():
                    try:
                        answers = call.result()
                    except Exception:  # engine busy or gone: ask again next tick, deadlines still hold
                        logger.exception("vllm-steer: collecting capture results failed")
                    call = None
            now = time.monotonic()
            keep = []
            for w in self._waits:
                if w.future.done():  # the client went away
                    continue
                if answers is not None:
                    w.pending.update(answers, asked)
                if not w.pending.open or now >= w.deadline:
                    w.future.set_result(w.pending.finish(w.timeout, w.expected))
                else:
                    keep.append(w)
            # a response that began waiting during the call is kept: none of its ids were asked yet
            self._waits = keep
            if self._waits and call is None:
                await asyncio.sleep(TICK_S)
        if call is not None:  # unanswered past every deadline: let it land (its results are evicted)
            self._stray.add(call)
            call.add_done_callback(self._stray.discard)


_POLLERS: dict[int, CaptureResultPoller] = {}


def poller_of(engine_client: Any) -> CaptureResultPoller:
    """The poller of this process's engine client (one per client, made on first use)."""
    poller = _POLLERS.get(id(engine_client))
    if poller is None or poller.engine is not engine_client:
        poller = _POLLERS[id(engine_client)] = CaptureResultPoller(engine_client)
    return poller
