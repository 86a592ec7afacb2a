"""The filesystem consumer's step gatherer: a step's rows arrive as one packet (``RowPacket``: every
(request, site) group of the step in column form) and are copied into an arena as they came (one
sequential copy out of the shared ring). At a flush they are regrouped per file by a stable sort of the
rows' file numbers: each file's block names its rows as byte spans of the arena (one per run of consecutive
rows, computed for the whole flush at once), which its writer thread writes with one ``os.writev`` of views
(``Block.chunks``: no gather copy; so the writers work in parallel). The consumer's Python per step is O(1)
(plus O(groups) when the batch's requests or sites change), and a file's writer gets one block per flush
instead of one row per step. A flush of a single packet needs no regrouping: its groups are its files.
A request's end flushes only its own rows (``flush(request_id)``); the others stay gathered.

The arena is filled on across flushes (a flush hands out views of the rows gathered since the last one) and
replaced only when full, so a flush costs no fresh memory. Arenas come from a pool and are reused once no
block of an earlier flush views them (their reference count says so): steady capture allocates nothing and
takes no page faults (a fresh arena's first touch cost more than the copy into it). The pool keeps what the
writers' backlog needs (at most ``keep_bytes``: the consumer's queue bound) and gives back a buffer unused for
``IDLE_S``.
Files are numbered with small ints (``FileIds``); a request's numbers are forgotten at its end."""

from __future__ import annotations

import sys
import time

import numpy as np

IDLE_S = 30.0  # a pooled buffer unused this long is given back
MIN_RUN_BYTES = 2048  # a flush whose runs of consecutive rows average less is gathered per block instead


class Block:
    """One file's rows of a flush, in arrival order: ``rows`` itself; or, with ``index``, the rows of ``rows``
    it names (``spans``: their byte ranges in ``rows``, one per run of consecutive rows). ``chunks`` gives its
    bytes for one ``os.writev`` without copying them where it has spans (on the writer's thread, so writers
    work in parallel); ``materialize`` gathers them into one array."""

    __slots__ = ("request_id", "layer", "hook", "positions", "rows", "index", "spans")

    def __init__(self, request_id: str, layer: int, hook: str, positions: np.ndarray, rows: np.ndarray,
                 index: np.ndarray | None = None, spans: tuple[list[int], list[int]] | None = None) -> None:
        self.request_id, self.layer, self.hook, self.positions, self.rows = request_id, layer, hook, positions, rows
        self.index, self.spans = index, spans

    @property
    def nbytes(self) -> int:
        if self.index is None:
            return self.rows.nbytes
        return len(self.index) * self.rows[0].nbytes

    def materialize(self) -> np.ndarray:
        if self.index is None:
            return self.rows
        return self.rows.take(self.index, axis=0, mode="clip")  # "raise" would buffer the copy

    def chunks(self) -> list[memoryview]:
        """The block's bytes in order as flat byte views of the arena: one per span (a decode step's rows are
        one per file: a view per row, written by ``os.writev`` straight from the arena, no gather copy); a
        block without spans (small rows: short runs) is gathered into one buffer instead."""
        if self.spans is not None:
            flat = memoryview(self.rows).cast("B")
            return [flat[a:b] for a, b in zip(*self.spans)]
        rows = self.materialize()
        return [memoryview(rows if rows.flags.c_contiguous else np.ascontiguousarray(rows)).cast("B")]


class FileIds:
    """(request, layer, hook) -> a small int, and each step's groups -> theirs (cached while the batch's
    composition stays the same: steady decoding reuses the last step's array)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int, str], int] = {}
        self.keys: dict[int, tuple[str, int, str]] = {}
        self._of_request: dict[str, list[int]] = {}
        self._next = 0
        self._last: tuple[list, list, np.ndarray] | None = None

    def of_groups(self, request_ids: list[str], sites: list[tuple[str, int]]) -> np.ndarray:
        last = self._last
        if last is not None and last[0] == request_ids and last[1] == sites:
            return last[2]
        out = np.empty(len(request_ids), dtype=np.int64)
        for g, (rid, (hook, layer)) in enumerate(zip(request_ids, sites)):
            key = (rid, layer, hook)
            fid = self._ids.get(key)
            if fid is None:
                fid = self._ids[key] = self._next
                self._next += 1
                self.keys[fid] = key
                self._of_request.setdefault(rid, []).append(fid)
            out[g] = fid
        self._last = (request_ids, sites, out)
        return out

    def of_request(self, request_id: str) -> list[int]:
        return self._of_request.get(request_id, [])

    def forget(self, request_id: str) -> None:
        """The request ended: its files' numbers go (after the flush that wrote its last rows)."""
        for fid in self._of_request.pop(request_id, ()):
            del self._ids[self.keys.pop(fid)]
        self._last = None


class BufferPool:
    """Row buffers reused once nothing else references them (no view of a flushed block is alive). Buffers of
    at most ``max_bytes`` are kept, ``keep_bytes`` in all (the writers' backlog is bounded by as much, so a
    steady capture stops allocating); a free one not used for ``IDLE_S`` is given back at the next ``get``."""

    def __init__(self, max_bytes: int, keep_bytes: int | None = None) -> None:
        self._bufs: list[np.ndarray] = []
        self._used: list[float] = []  # when each was last handed out
        self.max_bytes = max_bytes
        self.keep_bytes = 3 * max_bytes if keep_bytes is None else keep_bytes
        self.allocated = 0  # buffers allocated (a steady capture stops allocating)

    def get(self, rows: int, hidden: int, dtype: np.dtype, at_least: int = 0) -> np.ndarray:
        """A buffer of at least ``rows`` rows, and of half ``at_least``: the largest free pooled one, or a new one
        of ``max(rows, at_least)`` rounded up to a power of two where that stays poolable (so the buffers of a
        load come in one or two sizes and are reused as the load's files come and go)."""
        now = time.monotonic()
        at_least = min(_pow2(max(rows, at_least)), max(rows, self.max_bytes // (hidden * np.dtype(dtype).itemsize)))
        need = max(rows, at_least // 2)
        # 3 references when free: the list, the comprehension's variable, getrefcount's argument
        free = [k for k, f in enumerate([sys.getrefcount(b) <= 3 for b in self._bufs]) if f]
        fits = [k for k in free if self._bufs[k].shape[0] >= need and self._bufs[k].shape[1] == hidden
                and self._bufs[k].dtype == dtype]
        take = max(fits, key=lambda k: self._bufs[k].shape[0]) if fits else None
        idle = {k for k in free if k != take and now - self._used[k] > IDLE_S}
        if idle:
            take = None if take is None else take - sum(k < take for k in idle)
            self._bufs = [b for k, b in enumerate(self._bufs) if k not in idle]
            self._used = [u for k, u in enumerate(self._used) if k not in idle]
        if take is not None:
            self._used[take] = now
            return self._bufs[take]
        b = np.empty((at_least, hidden), dtype=dtype)
        self.allocated += 1
        if b.nbytes <= self.max_bytes and sum(x.nbytes for x in self._bufs) + b.nbytes <= self.keep_bytes:
            self._bufs.append(b)
            self._used.append(now)
        return b


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class StepGather:
    """Packets not yet flushed: their rows (in the arena), each row's arena row, file number and position."""

    def __init__(self, max_pooled_bytes: int, keep_bytes: int | None = None) -> None:
        self.files = FileIds()
        self.pool = BufferPool(max_pooled_bytes, keep_bytes)
        self._arena: np.ndarray | None = None
        self._fill = 0  # arena rows in use (flushed or pending)
        self._rows: list[np.ndarray] = []  # the pending rows' arena rows, file numbers and positions
        self._fids: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self._first: tuple | None = None  # a lone pending packet's groups and first arena row: its files
        self.nbytes = 0  # pending bytes

    def fits(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` go into the arena after the pending ones (else: flush, then a new arena)."""
        a = self._arena
        return a is None or (self._fill + len(rows) <= len(a) and a.shape[1:] == rows.shape[1:]
                             and a.dtype == rows.dtype)

    def add(self, request_ids: list[str], sites: list[tuple[str, int]], starts: np.ndarray, ends: np.ndarray,
            positions: np.ndarray, data: np.ndarray, arena_rows: int) -> None:
        """Copy a packet's rows in (``data`` may be ring memory: it is not kept). The caller flushes first
        when it does not ``fit``; a new arena holds at least ``arena_rows`` rows."""
        n = len(data)
        if not self.fits(data) or self._arena is None:
            assert not self._rows, "flush before the arena changes"
            self._arena = None  # a pooled buffer is free once the writers are done with it
            self._arena = self.pool.get(n, data.shape[1], data.dtype, at_least=arena_rows)
            self._fill = 0
        r0 = self._fill
        np.copyto(self._arena[r0 : r0 + n], data)
        self._fill += n
        starts, ends = np.asarray(starts), np.asarray(ends)
        group_fids = self.files.of_groups(request_ids, sites)
        self._first = (request_ids, sites, starts, ends, r0) if not self._rows else None
        self._rows.append(np.arange(r0, r0 + n))
        self._fids.append(np.repeat(group_fids, ends - starts))
        self._positions.append(np.asarray(positions))
        self.nbytes += data.nbytes

    def active_files(self) -> int:
        return len(self.files.keys)

    def flush(self, request_id: str | None = None) -> list[Block]:
        """Pending rows, one block per file (rows in arrival order within a file): all of them, or with
        ``request_id`` only that request's (the others stay pending)."""
        if not self._rows:
            return []
        arena = self._arena[: self._fill]
        arena.flags.writeable = False  # a read-only view: the lane goes on filling the arena past it
        row_bytes = arena[0].nbytes
        first = self._first
        if request_id is None and first is not None:  # one packet: its groups are its files, already contiguous
            request_ids, sites, starts, ends, r0 = first
            positions = self._positions[0]
            self._clear()
            return [Block(rid, layer, hook, positions[a:b], arena[r0 + a : r0 + b]) for rid, (hook, layer), a, b in
                    zip(request_ids, sites, starts.tolist(), ends.tolist())]
        rows, fids, positions = (np.concatenate(x) for x in (self._rows, self._fids, self._positions))
        if request_id is None:
            self._clear()
        else:
            mine = np.isin(fids, self.files.of_request(request_id))
            if not mine.any():
                return []
            rest = ~mine
            if rest.any():
                self._rows, self._fids, self._positions = [rows[rest]], [fids[rest]], [positions[rest]]
                self._first = None
                self.nbytes -= int(mine.sum()) * row_bytes
            else:
                self._clear()
            rows, fids, positions = rows[mine], fids[mine], positions[mine]
        order = np.argsort(fids, kind="stable")
        rows, fids, positions = rows[order], fids[order], positions[order]
        n = len(rows)
        new_file = fids[1:] != fids[:-1]
        bounds = np.concatenate(([0], np.flatnonzero(new_file) + 1, [n]))
        # runs of consecutive arena rows within a file: one view each
        heads = np.concatenate(([0], np.flatnonzero(new_file | (np.diff(rows) != 1)) + 1))
        files = [self.files.keys[f] for f in fids[bounds[:-1]].tolist()]
        lo, hi = bounds[:-1].tolist(), bounds[1:].tolist()
        if n * row_bytes < len(heads) * MIN_RUN_BYTES:  # short runs (small rows): each block gathered by its writer
            return [Block(rid, layer, hook, positions[a:b], arena, rows[a:b])
                    for (rid, layer, hook), a, b in zip(files, lo, hi)]
        tails = np.append(heads[1:], n) - 1
        span_a, span_b = (rows[heads] * row_bytes).tolist(), ((rows[tails] + 1) * row_bytes).tolist()
        cuts = np.searchsorted(heads, bounds).tolist()  # each file's first run
        return [Block(rid, layer, hook, positions[a:b], arena, rows[a:b], (span_a[c:d], span_b[c:d]))
                for (rid, layer, hook), a, b, c, d in zip(files, lo, hi, cuts[:-1], cuts[1:])]

    def _clear(self) -> None:
        self._rows, self._fids, self._positions, self._first, self.nbytes = [], [], [], None, 0
