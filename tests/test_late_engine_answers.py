"""The API process never waits on the engine for good: capture results keep their deadline when the
engine's answer is late or lost, and /metrics asks again when a question goes unanswered."""

from __future__ import annotations

import asyncio
import time

import pytest

from vllm_steer.server import capture_results, engine_metrics
from vllm_steer.capture.collect import timeout_error
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


def test_capture_results_keep_their_deadline_when_the_engine_never_answers():
    async def main():
        poller = capture_results.CaptureResultPoller(_Engine(None, None))
        t0 = time.monotonic()
        got = await poller.results(["r1"], 0.3, {"r1": ["slow"]})
        return got, time.monotonic() - t0, poller

    got, waited, poller = asyncio.run(main())
    assert got == {"r1": {"slow": timeout_error(0.3)}}
    assert 0.3 <= waited < 1.0, waited
    assert len(poller.engine.calls) == 1  # one question in flight, not one per tick


def test_a_late_answer_still_resolves_the_responses_whose_deadline_has_not_passed():
    def answer(args):
        (ids,) = args
        return [{"done": {rid: {"slow": {"n": 1}} for rid in ids}}]

    async def main():
        poller = capture_results.CaptureResultPoller(_Engine(0.4, answer))
        early = asyncio.ensure_future(poller.results(["a"], 0.1, {"a": ["slow"]}))
        late = asyncio.ensure_future(poller.results(["a2"], 5.0, {"a2": ["slow"]}))
        return await early, await late, poller

    early, late, poller = asyncio.run(main())
    assert early["a"]["slow"]["error"] == "timeout"
    # "a2" was not in the first question (it began waiting during it): asked next, answered in time
    assert late == {"a2": {"slow": {"n": 1}}}


def test_metrics_ask_again_when_a_question_goes_unanswered(monkeypatch):
    monkeypatch.setattr(engine_metrics, "WAIT_S", 0.05)
    monkeypatch.setattr(engine_metrics, "STALE_S", 0.2)
    stuck = _Engine(None, None)
    live = _Engine(0.0, lambda args: [{"gauges": {"rows_in_use": 3}, "increments": {}}])

    async def main():
        fetcher = engine_metrics._Fetcher()
        await fetcher.refresh(stuck)  # never answered: the scrape is served the last values
        await fetcher.refresh(stuck)
        assert len(stuck.calls) == 1  # one question at a time ...
        await asyncio.sleep(0.25)
        await fetcher.refresh(live)  # ... until it is STALE_S old: asked again
        return fetcher

    fetcher = asyncio.run(main())
    assert len(stuck.calls) == 1 and len(live.calls) == 1
    assert ENGINE_GAUGES["rows_in_use"]._value.get() == 3
    assert not fetcher.failing


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_results_in_time_are_handed_over(delay):
    def answer(args):
        (ids,) = args
        return [{"done": {rid: {"probe": {"rows": 2}} for rid in ids}}]

    async def main():
        poller = capture_results.CaptureResultPoller(_Engine(delay, answer))
        return await poller.results(["x", "y"], 2.0)

    assert asyncio.run(main()) == {"x": {"probe": {"rows": 2}}, "y": {"probe": {"rows": 2}}}
