"""Warns when an API process's event loop stops running (``steer.loop_stall_warn_s``).

Every request of an API process is served by its one asyncio loop: a call that blocks the loop (or a
process the OS does not run) delays every stream, refusal and /metrics scrape of the process at once,
and a client sees only silence. A daemon thread asks the loop to run a no-op once a second; when the
answer is later than the bound it logs where the loop's thread is (its stack: what blocks it), counts
the stall (``vllm_steer_api_loop_stalls_total``), and logs how long it lasted once the loop answers.
A wake-up of the thread itself far past its own timeout means the whole process was not run (or one
call held the GIL): said so in the same line. Costs one loop wake-up per second; 0 turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from prometheus_client import Counter

logger = logging.getLogger("vllm.steer")

STALLS = Counter("vllm_steer_api_loop_stalls", "Times an API process's event loop ran nothing for "
                 "steer.loop_stall_warn_s or longer (every request of the process waited)")
INTERVAL_S = 1.0


class LoopWatch(threading.Thread):
    def __init__(self, loop: asyncio.AbstractEventLoop, loop_thread: int, warn_s: float,
                 interval_s: float = INTERVAL_S) -> None:
        super().__init__(daemon=True, name="vllm-steer-loop-watch")
        self.loop, self.loop_thread, self.warn_s, self.interval_s = loop, loop_thread, warn_s, interval_s
        self.stalls = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            answered = threading.Event()
            asked = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop closed: the server is gone
                return
            if answered.wait(self.warn_s):
                continue
            self._report(asked, answered)

    def _report(self, asked: float, answered: threading.Event) -> None:
        late = time.monotonic() - asked
        frame = sys._current_frames().get(self.loop_thread)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(its thread is gone)\n"
        frozen = (f"; this watch itself woke {late - self.warn_s:.1f} s past its timeout: the process was not run "
                  "or one call held the GIL" if late > self.warn_s + 5 else "")
        self.stalls += 1
        STALLS.inc()
        logger.warning("vllm-steer: this API process's event loop has run nothing for %.1f s (steer.loop_stall_warn_s "
                       "%g: every request of the process waits)%s; its thread is at:\n%s", late, self.warn_s,
                       frozen, where.rstrip())
        while not answered.wait(self.interval_s):
            if self.done.is_set() or self.loop.is_closed():
                return
        logger.warning("vllm-steer: the event loop runs again, after %.1f s", time.monotonic() - asked)


def watch_running_loop(warn_s: float) -> LoopWatch | None:
    """Start watching the running loop (call on it); None when ``warn_s`` is 0."""
    if warn_s <= 0:
        return None
    watch = LoopWatch(asyncio.get_running_loop(), threading.get_ident(), warn_s)
    watch.start()
    return watch
