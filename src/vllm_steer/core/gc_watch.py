"""Opt-in diagnostic: log a process's slow garbage collections (``VLLM_STEER_GC_WATCH=<ms>``): the workers' (installed
with their runtime) and the API process's (the endpoint plugin's start-up).

vLLM freezes the startup heap (``gc.freeze``), so a collection scans only the objects made since; one that runs in the
engine core's host work between two steps idles the GPU for its whole length (issue 37's prefill profiles show 5-7 ms
host pauses with no CUDA call at some step boundaries); one in the API process stalls every response it serves (s40's
files arm: one ~0.5 s stall in 22 trials, cause unknown). With the variable set, each collection of at least that many
ms is logged with its generation and the objects it collected; unset (the default), nothing is installed.
"""

from __future__ import annotations

import gc
import logging
import os
import time

logger = logging.getLogger("vllm.steer.gc")

_watching: list = []  # the installed callback (one a process)


def install() -> bool:
    """Watch this process's collections if ``VLLM_STEER_GC_WATCH`` names a threshold in ms; whether it watches."""
    raw = os.environ.get("VLLM_STEER_GC_WATCH", "")
    if not raw or _watching:
        return bool(_watching)
    limit_s = float(raw) / 1e3
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took >= limit_s:
            logger.warning("vllm-steer gc: generation %d took %.2f ms (%d collected, %d uncollectable, %d objects "
                           "tracked)", info["generation"], took * 1e3, info.get("collected", 0),
                           info.get("uncollectable", 0), len(gc.get_objects(info["generation"])))

    gc.callbacks.append(watch)
    _watching.append(watch)
    return True
