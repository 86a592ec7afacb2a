"""Row allocation for the steering tables: config key -> row, refcounted, row 0 reserved.

Identical configs share a row. A released row keeps its contents (and its key) until it is
reused for another key, so a config that comes back soon is not copied again: released rows are a
least-recently-used cache, evicted (counted in ``evictions``) when a new key needs a row. A named
module's rows are materialized into that cache at registration (``materialize``), never held. The
scheduler gate guarantees a free row exists whenever a request is added; running out here is a bug.
"""

from __future__ import annotations

from collections import OrderedDict


class RowsExhaustedError(RuntimeError):
    pass


class RowAllocator:
    def __init__(self, num_rows: int) -> None:
        if num_rows < 2:
            raise ValueError("a steering table needs at least 2 rows (row 0 is the no-op)")
        self.num_rows = num_rows
        self._row_of: dict[str, int] = {}
        self._refs: dict[str, int] = {}
        # Rows never used, then released rows in LRU order (key still resident).
        self._never_used = list(range(num_rows - 1, 0, -1))
        self._released: OrderedDict[str, int] = OrderedDict()
        self.evictions = 0  # resident configs whose row was taken for another key

    def _free_row(self) -> int | None:
        """A row for a new key: a never used one, else the least recently released (evicted)."""
        if self._never_used:
            return self._never_used.pop()
        if self._released:
            old_key, row = self._released.popitem(last=False)
            del self._row_of[old_key]
            self.evictions += 1
            return row
        return None

    def materialize(self, key: str) -> int | None:
        """A row to write ``key`` into ahead of its first request, left in the cache (not held);
        None when it is resident already or every row is held by running requests."""
        if key in self._row_of:
            return None
        row = self._free_row()
        if row is not None:
            self._row_of[key] = row
            self._released[key] = row
        return row

    def acquire(self, key: str) -> tuple[int, bool, bool]:
        """(row of ``key``, whether its contents must be written, whether it just became live)."""
        if key in self._refs:
            self._refs[key] += 1
            return self._row_of[key], False, False
        if key in self._released:
            row = self._released.pop(key)
            self._refs[key] = 1
            return row, False, True
        row = self._free_row()
        if row is None:
            raise RowsExhaustedError(
                f"no free steering row ({self.num_rows - 1} in use); the scheduler gate should "
                "have held this request back"
            )
        self._row_of[key] = row
        self._refs[key] = 1
        return row, True, True

    def release(self, key: str) -> bool:
        """Drop one reference; True when the key has no user left."""
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
            return False
        del self._refs[key]
        self._released[key] = self._row_of[key]
        return True

    def live_keys(self) -> list[str]:
        return list(self._refs)

    def row_of(self, key: str) -> int:
        return self._row_of[key]
