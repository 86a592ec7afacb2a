"""Capture reduced on the device: the accumulator region of consumers that only want a per-site reduction.

A consumer whose class says so (``device_reduce(params)`` -> ``"last"`` | ``"mean"``, e.g. ``activations``)
gets, per request, one accumulator slot per site it captures on this rank, held for the request's
life (``steer.capture_reduce_rows`` slots in all). Slot ``j`` is:

- ``last``: pool row ``base + j`` (the pool's tail, model dtype). The plan maps the request's last
  selected token of a step at that site straight to it, so the norm's store overwrites it: no launch,
  no copy. (A token another consumer also wants keeps its step row and is copied there after the forward.)
- ``mean``: ``acc[j]`` (float32). Selected tokens take step rows as before; after the forward one launch adds
  each slot's rows of the step to it (``kernels/capture_reduce``: a segmented sum, the pairs sorted by slot on the
  host only when a slot's pairs are not one run already; one ``index_copy_`` does the ``last`` copies). No per-step
  copy to the host.

Per step the planner (``runtime.capture_plan``) says which (step row -> slot) pairs to add or copy;
their indices reach the device with one pinned-ring copy when they changed (none in steady decode).
The host keeps each slot's count and last position (numpy, vectorized): nothing is read back.
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
        self.count = np.zeros(rows, np.int64)  # rows reduced into each slot
        self.last = np.full(rows, -1, np.int64)  # the highest position reduced into each slot
        # this step's pairs as _idx holds them: mean sources sorted by slot, each slot's segment (slot, offsets),
        # copy sources, copy targets (<= 3 * pairs + 1 + 2 * pairs)
        self._ring = PinnedRing((max(5 * max_pairs + 1, 2 * rows),), torch.int64, device) if rows else None
        self._idx = torch.empty(5 * max_pairs + 1, dtype=torch.int64, device=device)
        self._gidx = torch.empty(2 * rows, dtype=torch.int64, device=device)  # a finish's gather
        self._pairs = np.zeros(0, np.int64)  # the pairs _idx was staged from (mean src, mean slot, copy src, dst)
        self._n_seg = 0
        self.index_uploads = 0

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` slots (their counts reset), or None when fewer are free."""
        if n > len(self._free):
            return None
        slots = np.array([self._free.pop() for _ in range(n)], np.int64)
        self.count[slots] = 0
        self.last[slots] = -1
        return slots

    def account(self, slots: np.ndarray, counts: np.ndarray, last_slots: np.ndarray, last_pos: np.ndarray) -> None:
        """A step reduced ``counts`` rows into ``slots``; ``last_pos``: the position now held by ``last_slots``."""
        if len(slots):
            self.count[slots] += counts  # a step names each slot once (np.add.at not needed)
        if len(last_slots):
            self.last[last_slots] = last_pos

    def apply(self, mean_src: np.ndarray, mean_slot: np.ndarray, copy_src: np.ndarray, copy_dst: np.ndarray) -> None:
        """After the forward: ``acc[mean_slot] += pool[mean_src]``, ``pool[copy_dst] = pool[copy_src]``
        (outside any graph; the indices go up only when they changed)."""
        n_mean, n_copy = len(mean_src), len(copy_src)
        if not n_mean and not n_copy:
            return
        pairs = np.concatenate((mean_src, mean_slot, copy_src, copy_dst))
        if not np.array_equal(pairs, self._pairs):
            starts = np.flatnonzero(np.r_[True, mean_slot[1:] != mean_slot[:-1]]) if n_mean else mean_slot
            src, by_slot = mean_src, mean_slot
            if len(np.unique(mean_slot[starts])) < len(starts):  # a slot in several runs: sort the pairs by slot
                order = np.argsort(mean_slot, kind="stable")
                src, by_slot = mean_src[order], mean_slot[order]
                starts = np.flatnonzero(np.r_[True, by_slot[1:] != by_slot[:-1]])
            staged = np.concatenate((src, by_slot[starts], starts, [n_mean], copy_src, copy_dst))
            host, land = self._ring.stage()
            host[: len(staged)] = staged
            land(self._idx[: len(staged)])
            self._pairs, self._n_seg = pairs, len(starts)
            self.index_uploads += 1
        idx, n_seg = self._idx, self._n_seg
        if n_mean:
            segment_add(self.acc, self.pool, idx, idx[n_mean:], idx[n_mean + n_seg:], n_seg)
        if n_copy:
            at = n_mean + 2 * n_seg + 1
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
        self._free.extend(int(s) for s in slots[::-1])
