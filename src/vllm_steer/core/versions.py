"""Registration versions that no API process of a server hands out twice: microseconds since the epoch,
strictly increasing within the process. The engine core's registries (modules, runtime SAEs) refuse a
version not newer than the name's current one, so versions from different processes must be unique."""

from __future__ import annotations

import threading
import time


class VersionClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def next(self) -> int:
        with self._lock:
            v = max(self._next, time.time_ns() // 1000)
            self._next = v + 1
            return v
