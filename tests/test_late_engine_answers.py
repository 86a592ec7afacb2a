"""The API process never waits on the engine for good: /metrics asks again when a question goes
unanswered. (Capture results do not ask the engine: ``tests/test_capture_inbox.py``.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from vllm_steer.server import engine_metrics
from vllm_steer.server.metrics import ENGINE_GAUGES


class _Engine:
    """A stand-in engine client: ``collective_rpc`` answers after ``delay`` s (None: never)."""

    def __init__(self, delay: float | None, answer) -> None:
        self.delay, self.answer, self.calls = delay, answer, []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        if self.delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay)
        return self.answer(args)


def test_metrics_ask_again_when_a_question_goes_unanswered(monkeypatch):
    monkeypatch.setattr(engine_metrics, "WAIT_S", 0.05)
    monkeypatch.setattr(engine_metrics, "STALE_S", 1.0)  # far above a loaded CI box's scheduling hiccups
    stuck = _Engine(None, None)
    live = _Engine(0.0, lambda args: [{"gauges": {"rows_in_use": 3}, "increments": {}}])

    async def main():
        fetcher = engine_metrics._Fetcher()
        await fetcher.refresh(stuck)  # never answered: the scrape is served the last values
        await fetcher.refresh(stuck)
        assert len(stuck.calls) == 1  # one question at a time ...
        await asyncio.sleep(1.05)
        await fetcher.refresh(live)  # ... until it is STALE_S old: asked again
        await asyncio.wait_for(asyncio.shield(fetcher.task), 10)  # its answer lands (past WAIT_S on a loaded box)
        return fetcher

    fetcher = asyncio.run(main())
    assert len(stuck.calls) == 1 and len(live.calls) == 1
    assert ENGINE_GAUGES["rows_in_use"]._value.get() == 3
    assert not fetcher.failing
