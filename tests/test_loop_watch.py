"""An API process's blocked event loop is reported (server.loop_watch): where its thread is, how long
it lasted, counted; a loop that keeps running is not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from vllm_steer.server.loop_watch import STALLS, LoopWatch, watch_running_loop


def _block_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call on the loop's thread


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_blocked_event_loop_is_logged_with_the_blocking_call_and_counted():
    lines = _Lines()
    logging.getLogger("vllm.steer").addHandler(lines)
    before = STALLS._value.get()

    async def serve() -> LoopWatch:
        watch = LoopWatch(asyncio.get_running_loop(), threading.get_ident(), warn_s=1.0, interval_s=0.05)
        watch.start()
        for _ in range(30):  # 1.5 s of a loop that runs (short awaits): never reported
            await asyncio.sleep(0.05)
        assert watch.stalls == 0 and not lines.lines
        _block_the_loop(2.5)
        await asyncio.sleep(0.5)  # the watch sees the loop answer again
        watch.done.set()
        return watch

    try:
        watch = asyncio.run(serve())
    finally:
        logging.getLogger("vllm.steer").removeHandler(lines)
    watch.join(5)
    assert watch.stalls == 1 and STALLS._value.get() == before + 1
    stalled, resumed = lines.lines
    assert "event loop has run nothing for" in stalled and "loop_stall_warn_s 1" in stalled
    assert "in _block_the_loop" in stalled and "time.sleep(seconds)" in stalled, stalled
    assert "the process was not run" not in stalled  # the watch itself woke on time
    after = float(resumed.split("after ")[1].split(" s")[0])
    assert 2.2 <= after < 5.0, resumed


def test_zero_turns_the_watch_off():
    async def start() -> object:
        return watch_running_loop(0)

    assert asyncio.run(start()) is None
