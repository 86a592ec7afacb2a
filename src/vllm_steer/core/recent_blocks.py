"""A bounded memory of blocks lately seen twice: ``server.base64_lift``'s decoded texts, ``core.layout``'s checked rows.

Clients often send the same vectors with every request. ``Recent`` maps a block's fingerprint (its length and ends,
plus what else the caller's result depends on) to what the caller made of it. The first time a fingerprint comes only
the fingerprint is kept: a request with new vectors keeps nothing alive and copies nothing. The second time the
caller's entry is kept; from then on the caller verifies each hit against the block's own bytes (a fingerprint only
finds the candidate). Least recently used entries go past ``max_bytes`` or ``max_entries``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

PROBE = 32  # bytes at each end of a block that, with its length, make its fingerprint
_SEEN = object()  # a fingerprint that came once: no entry yet


class Recent:
    def __init__(self, max_bytes: int, max_entries: int = 4096) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()  # key -> (entry or _SEEN, bytes held)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Any | None:
        """The entry kept for ``key`` (None: none, or the key came only once)."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
        return None if hit[0] is _SEEN else hit[0]

    def put(self, key: tuple, make: Callable[[], tuple[Any, int]]) -> None:
        """After a miss of ``get`` (or a hit that failed its check): the first time ``key`` comes, note it; from the
        second time on keep the entry ``make()`` returns, with the bytes it holds."""
        with self._lock:
            known = key in self._entries
        value, size = make() if known else (_SEEN, 0)
        with self._lock:
            old = self._entries.pop(key, None)
            self._bytes += size - (old[1] if old is not None else 0)
            self._entries[key] = (value, size)
            while self._entries and (self._bytes > self.max_bytes or len(self._entries) > self.max_entries):
                self._bytes -= self._entries.popitem(last=False)[1][1]

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
