"""Capture reduced on the device: the accumulator region of consumers that only want a per-site reduction.

A consumer whose class says so (``device_reduce(params)`` -> ``"last"`` | ``"mean"``, e.g. ``activations``)
gets, per request, one accumulator slot per site it captures on this rank, held for the request's
life (``steer.capture_reduce_rows`` slots in all). Slot ``j`` is:

- ``last``: pool row ``base + j`` (the pool's tail, model dtype). The plan maps the request's last
  selected token of a step at that site straight to it, so the norm's store overwrites it: no launch,
  no copy. (A token another consumer also wants keeps its step row and is copied there after the forward.)
- ``mean``: ``acc[j]`` (float32). Selected tokens take step rows as before; after the forward one launch adds
  each slot's rows of the step to it (``kernels/capture_reduce``: a segmented sum). The planner gives the rows as
  runs of consecutive rows per slot (a prefill chunk's site: one to three runs), sorted by slot on the host only
  when a slot's runs are apart; the device expands them into row indices (``repeat_interleave``); one
  ``index_copy_`` does the ``last`` copies. No per-step copy to the host.

Per step the planner (``runtime.capture_plan``) says which (step rows -> slot) runs to add or copy;
they reach the device with one pinned-ring copy when they changed (none in steady decode).
The host keeps each slot's count and last position (numpy, vectorized; steady decode's repeats are added in
when read): nothing is read back.
At the request's finish its slots are gathered (one ``index_select``, float32) and copied to the
consumers' ring; the slots are free again at once (the gathered copy is the consumers').

Exhaustion: a request that finds fewer free slots than it needs is not reduced here: its rows go step
by step as for any consumer (correct, slower), counted by the runtime (``reduce_fallbacks``). A step
with more pairs than ``max_pairs`` drops the rest (recorded on the request like any dropped row).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.kernels.capture_reduce import segment_add
from vllm_steer.runtime.pinned_ring import PinnedRing

MODES = ("last", "mean")


class ReduceRegion:
    """The slots, their host-side counts, and the device ops that fill them."""

    def __init__(self, rows: int, base: int, pool: torch.Tensor, max_pairs: int) -> None:
        self.rows, self.base, self.pool, self.max_pairs = rows, base, pool, max_pairs
        device = pool.device
        self.acc = torch.zeros(rows + 1, pool.shape[1], dtype=torch.float32, device=device)  # + a scratch row
        self._free = list(range(rows - 1, -1, -1))
        self._count = np.zeros(rows, np.int64)  # rows reduced into each slot (``count``)
        self._last = np.full(rows, -1, np.int64)  # the highest position reduced into each slot (``last``)
        # steps accounted but not yet added in: ``account``'s last arrays (the same objects each steady decode step)
        # and how many times they repeat, with the newest last positions
        self._held_acct: tuple | None = None
        self._reps = 0
        # this step's pairs as _idx holds them: runs of mean sources by slot (first row - first cell, rows), each
        # slot's segment (slot, first cell), the cells, copy sources, copy targets (<= 4 * pairs + 1 + 2 * pairs)
        self._ring = PinnedRing((max(6 * max_pairs + 1, 2 * rows),), torch.int64, device) if rows else None
        self._idx = torch.empty(6 * max_pairs + 1, dtype=torch.int64, device=device)
        self._src = torch.empty(max_pairs, dtype=torch.int64, device=device)  # the runs' rows, expanded on the device
        self._iota = torch.arange(max_pairs, dtype=torch.int64, device=device)
        self._gidx = torch.empty(2 * rows, dtype=torch.int64, device=device)  # a finish's gather
        self._pairs = np.zeros(0, np.int64)  # what _idx was staged from (counts, mean runs, copies)
        self._n_runs = self._n_seg = 0
        self.index_uploads = 0
        if rows:  # launch the kernel now on the buffers ``apply`` uses (one empty segment: + 0), so a GPU compiles it
            self._idx[:3].zero_()  # at start-up, not at the first mean (see ``CapturePlanner``)
            segment_add(self.acc, self.pool, self._src, self._idx, self._idx[1:], 1)

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` slots (a free slot's count is 0, its last position -1), or None when fewer are free."""
        if n > len(self._free):
            return None
        slots = np.array(self._free[: -n - 1 : -1] if n else (), np.int64)  # the last n, last first (as pop)
        del self._free[len(self._free) - n :]
        return slots

    @property
    def count(self) -> np.ndarray:
        """Rows reduced into each slot (read-only: ``account`` and ``release`` change it)."""
        self._flush()
        return self._count

    @property
    def last(self) -> np.ndarray:
        """The highest position reduced into each slot (-1: none)."""
        self._flush()
        return self._last

    def account(self, slots: np.ndarray, counts: np.ndarray, last_slots: np.ndarray, last_pos: np.ndarray) -> None:
        """A step reduced ``counts`` rows into ``slots``; ``last_pos``: the position now held by ``last_slots``.
        A step that names the very arrays of the last one (steady decode) is only counted: added in once read."""
        held = self._held_acct
        if held is not None and held[0] is slots and held[1] is counts and held[2] is last_slots:
            self._reps += 1
            self._held_acct = (slots, counts, last_slots, last_pos)
            return
        self._flush()
        self._held_acct, self._reps = (slots, counts, last_slots, last_pos), 1

    def _flush(self) -> None:
        held = self._held_acct
        if held is None:
            return
        slots, counts, last_slots, last_pos = held
        self._held_acct = None
        if len(slots):
            self._count[slots] += counts * self._reps  # a step names each slot once (np.add.at not needed)
        if len(last_slots):
            self._last[last_slots] = last_pos

    def apply(self, mean_src: np.ndarray, mean_len: np.ndarray, mean_slot: np.ndarray, copy_src: np.ndarray,
              copy_dst: np.ndarray) -> None:
        """After the forward: ``acc[mean_slot[i]] += pool[mean_src[i] + j]`` for j < ``mean_len[i]`` (runs of
        consecutive rows), ``pool[copy_dst] = pool[copy_src]`` (outside any graph; the runs go up only when they
        changed, and the device expands them into the rows' indices)."""
        n_runs, n_copy = len(mean_src), len(copy_src)
        n_mean = int(mean_len.sum()) if n_runs else 0
        if not n_mean and not n_copy:
            return
        pairs = np.concatenate(([n_runs, n_copy], mean_src, mean_len, mean_slot, copy_src, copy_dst))
        if not np.array_equal(pairs, self._pairs):
            src, lens, slots = mean_src, mean_len, mean_slot
            heads = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]]) if n_runs else slots
            if len(np.unique(slots[heads])) < len(heads):  # a slot in runs apart: sort the runs by slot
                order = np.argsort(slots, kind="stable")
                src, lens, slots = src[order], lens[order], slots[order]
                heads = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
            cell = np.cumsum(lens) - lens
            staged = np.concatenate((src - cell, lens, slots[heads], cell[heads], [n_mean], copy_src, copy_dst))
            host, land = self._ring.stage()
            host[: len(staged)] = staged
            land(self._idx[: len(staged)])
            if n_mean:  # each run's rows: its first row + 0, 1, ...
                idx = self._idx
                torch.add(torch.repeat_interleave(idx[:n_runs], idx[n_runs : 2 * n_runs], output_size=n_mean),
                          self._iota[:n_mean], out=self._src[:n_mean])
            self._pairs, self._n_runs, self._n_seg = pairs, n_runs, len(heads)
            self.index_uploads += 1
        idx, at, n_seg = self._idx, 2 * self._n_runs, self._n_seg
        if n_mean:
            segment_add(self.acc, self.pool, self._src, idx[at:], idx[at + n_seg :], n_seg)
        if n_copy:
            at += 2 * n_seg + 1
            self.pool.index_copy_(0, idx[at + n_copy : at + 2 * n_copy],
                                  self.pool.index_select(0, idx[at : at + n_copy]))

    def gather(self, slots: np.ndarray, mean: np.ndarray) -> torch.Tensor:
        """The slots' values as float32 ``[n, D]``, in ``slots`` order (a new device tensor: the slots may
        be reused at once): a ``last`` slot's row, a ``mean`` slot's sum (``mean`` marks them; the
        consumers' process divides by the count); the sums are reset for the slots' next owners."""
        n = len(slots)
        host, land = self._ring.stage()
        host[:n] = np.where(mean, 0, slots + self.base)  # last: its pool row (mean: any row, not read)
        host[n : 2 * n] = np.where(mean, slots, self.rows)  # mean: its acc row (last: acc's scratch row)
        index = self._gidx[: 2 * n]
        land(index)
        out = self.pool.index_select(0, index[:n]).float()
        if mean.any():
            sums = self.acc.index_select(0, index[n:])
            out = sums if mean.all() else torch.where((index[n:] != self.rows)[:, None], sums, out)
            self.acc.index_fill_(0, index[n:], 0.0)  # the scratch row is zeroed too (never read)
        return out

    def release(self, slots: np.ndarray) -> None:
        """The slots are free again (their counts reset here: one op for all of a step's ends)."""
        self._flush()
        self._count[slots] = 0
        self._last[slots] = -1
        self._free.extend(slots[::-1].tolist())
