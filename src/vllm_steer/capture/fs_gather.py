"""The filesystem consumer's step gatherer: a step's rows arrive as one packet (``RowPacket``: every
(request, site) group of the step in column form) and are copied into an arena as they came (one
sequential copy out of the shared ring). At a flush they are regrouped per file by a stable sort of the
rows' file numbers: each file's block names its rows, which its writer thread writes with one ``os.writev``
of views of the arena (``Block.chunks``: one per run of consecutive rows, no gather copy; so the writers work in
parallel). The consumer's Python per step is O(1) (plus O(groups) when the
batch's requests or sites change), and a file's writer gets one block per flush instead of one row per
step. A flush of a single packet needs no regrouping: its groups are its files.

Arenas come from a small pool and are reused once no block of an earlier flush views them (their
reference count says so), so steady capture allocates nothing and takes no page faults.
Files are numbered with small ints (``FileIds``); a request's numbers are forgotten at its end."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

POOLED = 3  # buffers kept for reuse (more in use at once are allocated and dropped)
MIN_RUN_BYTES = 2048  # a block whose runs of consecutive rows average less is gathered into one buffer instead


@dataclass(frozen=True)
class Block:
    """One file's rows of a flush, in arrival order: ``rows`` itself, or with ``index`` the rows of ``rows``
    it names. ``chunks`` gives its bytes for one ``os.writev`` without copying them (on the writer's thread, so
    writers work in parallel); ``materialize`` gathers them into one array."""

    request_id: str
    layer: int
    hook: str
    positions: np.ndarray
    rows: np.ndarray
    index: np.ndarray | None = None

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
        """The block's bytes in order as flat byte views of the arena: one per run of consecutive rows (a
        decode step's rows are one per file: a view per row, written by ``os.writev`` straight from the arena,
        no gather copy); a block of short runs (small rows) is gathered into one buffer instead."""
        rows = self.rows
        if self.index is None:
            return [memoryview(rows if rows.flags.c_contiguous else np.ascontiguousarray(rows)).cast("B")]
        idx, row_bytes = self.index, rows[0].nbytes
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        if len(idx) * row_bytes < (len(breaks) + 1) * MIN_RUN_BYTES or not rows.flags.c_contiguous:
            return [memoryview(self.materialize()).cast("B")]
        flat = memoryview(rows).cast("B")
        if not len(breaks):
            return [flat[int(idx[0]) * row_bytes : (int(idx[-1]) + 1) * row_bytes]]
        starts = (idx[np.concatenate(([0], breaks))] * row_bytes).tolist()
        ends = ((idx[np.concatenate((breaks - 1, [len(idx) - 1]))] + 1) * row_bytes).tolist()
        return [flat[a:b] for a, b in zip(starts, ends)]


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

    def forget(self, request_id: str) -> None:
        """The request ended: its files' numbers go (after the flush that wrote its last rows)."""
        for fid in self._of_request.pop(request_id, ()):
            del self._ids[self.keys.pop(fid)]
        self._last = None


class BufferPool:
    """Row buffers reused once nothing else references them (no view of a flushed block is alive); only
    buffers of at most ``max_bytes`` are kept (a huge prefill packet's is freed once written)."""

    def __init__(self, max_bytes: int) -> None:
        self._bufs: list[np.ndarray] = []
        self.max_bytes = max_bytes

    def get(self, rows: int, hidden: int, dtype: np.dtype, at_least: int = 0) -> np.ndarray:
        for b in self._bufs:
            # 3 references when free: the list, the loop variable, getrefcount's argument
            if b.shape[0] >= rows and b.shape[1] == hidden and b.dtype == dtype and sys.getrefcount(b) <= 3:
                return b
        b = np.empty((max(rows, at_least), hidden), dtype=dtype)
        if b.nbytes > self.max_bytes:
            return b
        if len(self._bufs) < POOLED:
            self._bufs.append(b)
        else:  # keep the largest ones
            small = min(range(POOLED), key=lambda i: self._bufs[i].nbytes)
            if self._bufs[small].nbytes < b.nbytes and sys.getrefcount(self._bufs[small]) <= 2:
                self._bufs[small] = b
        return b


class StepGather:
    """Packets not yet flushed: their rows (in the arena), each row's file number and position."""

    def __init__(self, max_pooled_bytes: int) -> None:
        self.files = FileIds()
        self.pool = BufferPool(max_pooled_bytes)
        self._arena: np.ndarray | None = None
        self._fill = 0
        self._fids: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self._first: tuple[list, list, np.ndarray, np.ndarray] | None = None  # its groups: a lone packet's files
        self.nbytes = 0

    def fits(self, rows: int) -> bool:
        return self._arena is None or self._fill + rows <= len(self._arena)

    def add(self, request_ids: list[str], sites: list[tuple[str, int]], starts: np.ndarray, ends: np.ndarray,
            positions: np.ndarray, data: np.ndarray, arena_rows: int) -> None:
        """Copy a packet's rows in (``data`` may be ring memory: it is not kept). The caller flushes first
        when it does not ``fit``; a new arena holds at least ``arena_rows`` rows."""
        n = len(data)
        if self._arena is None:
            self._arena = self.pool.get(n, data.shape[1], data.dtype, at_least=arena_rows)
        np.copyto(self._arena[self._fill : self._fill + n], data)
        self._fill += n
        starts, ends = np.asarray(starts), np.asarray(ends)
        group_fids = self.files.of_groups(request_ids, sites)
        self._fids.append(np.repeat(group_fids, ends - starts))
        self._positions.append(np.asarray(positions))
        if self._first is None:
            self._first = (request_ids, sites, starts, ends)
        self.nbytes += data.nbytes

    def active_files(self) -> int:
        return len(self.files.keys)

    def flush(self) -> list[Block]:
        """Every pending row, one block per file (rows in arrival order within a file)."""
        if self._arena is None or not self._fill:
            return []
        n, arena = self._fill, self._arena
        keys = self.files.keys
        if len(self._fids) == 1:  # one packet: its groups are its files, already contiguous
            request_ids, sites, starts, ends = self._first
            rows, positions = arena[:n], self._positions[0]
            rows.flags.writeable = False
            out = [Block(rid, layer, hook, positions[a:b], rows[a:b]) for rid, (hook, layer), a, b in
                   zip(request_ids, sites, starts.tolist(), ends.tolist())]
        else:  # each file's rows picked out of the arena by its writer (Block.materialize)
            fids, positions = np.concatenate(self._fids), np.concatenate(self._positions)
            order = np.argsort(fids, kind="stable")
            rows = arena[:n]
            rows.flags.writeable = False
            sorted_fids, positions = fids[order], positions[order]
            cuts = np.flatnonzero(sorted_fids[1:] != sorted_fids[:-1]) + 1
            bounds = np.concatenate(([0], cuts, [n])).tolist()
            out = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                rid, layer, hook = keys[int(sorted_fids[a])]
                out.append(Block(rid, layer, hook, positions[a:b], rows, order[a:b]))
        self._arena = None  # the blocks view it: a later flush's arena comes from the pool once they are written
        self._fill, self._fids, self._positions, self._first, self.nbytes = 0, [], [], None, 0
        return out
