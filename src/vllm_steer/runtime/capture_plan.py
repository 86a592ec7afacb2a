"""Capture planning: which batch tokens go to which pool rows this step, and the plan's upload.

Per request, once when it is added (``compile_request``): for the three position classes a
request's token can be in (before the last prompt token, the last prompt token, generated), the
consumer bitmask each of this rank's sites wants (``[3, n_sites]``; the position modes
``all``/``all_prompt``/``last_prompt``/``all_generated`` depend on nothing else), plus the few
specs with explicit positions. Sites other ranks hook are left out there.

Per step (``CapturePlanner.plan``), numpy over the capturing requests of the batch only: their tokens
(positions already planned once are skipped: the preemption rule, ``planned_upto``), each token's
class, the masks gathered from the requests' tables, and the captured (request, site, token) cells
in request (batch) order, then site, then token. They take pool rows in that order; past
``max_rows`` the rest is dropped and recorded on the request (``req.drop``). Python runs once per
capturing request and once per (request, site) group, never per token or per site of the table. A
step with last step's shape (the same requests in the same order, token counts, position classes and
batch slots, no explicit positions, nothing dropped) reuses its cells: only the positions move.

The device plan ``plan[site, token]`` (pool row, -1 none) changes sparsely: a step sends only its
cells (flat index, row) and the resets of last step's cells it does not set again, in one copy from
a persistent pinned ring into a persistent device staging buffer, then one ``index_copy_`` into the
plan (both on the current stream, before the forward, outside any graph): two device ops (the copy
and the ``index_copy_``) a step whose plan changed, none when it is the same as last step's (steady
decode of a stable batch) or idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_steer.runtime.pinned_ring import PinnedRing

# position classes of a token: before the last prompt token, the last prompt token, generated
_MODE_CLASSES = {"all": (0, 1, 2), "all_prompt": (0, 1), "last_prompt": (1,), "all_generated": (2,)}


@dataclass
class RequestPlan:
    """What a request captures on this rank, in site columns of the plan (fixed while it lives)."""

    table: np.ndarray  # [3, n_sites] int64: consumer bits per position class and site
    explicit: list[tuple[int, np.ndarray, np.ndarray]]  # (bit, sorted positions, site columns)
    cols: np.ndarray  # [n_sites] bool: sites any of its specs captures here
    captures: bool  # any site here at all


def compile_request(specs: dict[int, Any], site_index: dict[tuple[str, int], int]) -> RequestPlan:
    """A request's plan from its specs (consumer bit -> ``CaptureSpec``); sites not in ``site_index``
    (hooked by another rank) are skipped."""
    n = len(site_index)
    table = np.zeros((3, n), dtype=np.int64)
    explicit = []
    for bit, spec in specs.items():
        cols = np.array([site_index[s] for s in spec.sites if s in site_index], dtype=np.int64)
        if not len(cols):
            continue
        classes = _MODE_CLASSES.get(spec.positions) if isinstance(spec.positions, str) else None
        if classes is None:
            explicit.append((bit, np.unique(np.asarray(spec.positions, dtype=np.int64)), cols))
            continue
        for c in classes:
            table[c, cols] |= bit
    cols = table.any(axis=0)
    for _, _, c in explicit:
        cols[c] = True
    return RequestPlan(table, explicit, cols, bool(cols.any()))


@dataclass
class StepPlan:
    """This step's kept cells grouped by (request, site): group g is request ``request_ids[g]`` at
    ``sites[g]`` (hook, layer), cells ``starts[g]:ends[g]`` of ``positions``/``masks``; cell i is
    pool row i."""

    request_ids: list[str]
    sites: list[tuple[str, int]]
    starts: list[int]
    ends: list[int]
    positions: np.ndarray
    masks: np.ndarray
    rows: int
    dropped_rows: int
    recomputed: int


@dataclass
class _Same:
    """The last step's batch shape and its cells, for a step with the same shape (steady decode)."""

    reqs: list[int]  # id() of each request, in order (alive: ``held`` keeps them)
    held: list
    count: np.ndarray
    klass: np.ndarray
    tok: np.ndarray
    t: np.ndarray
    flat: np.ndarray
    request_ids: list[str]
    sites: list[tuple[str, int]]
    starts: list[int]
    ends: list[int]
    masks: np.ndarray


_EMPTY = StepPlan([], [], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0, 0)


class CapturePlanner:
    """Plans steps and keeps the device plan ``[n_sites, width]`` in step with them."""

    def __init__(self, sites: list[tuple[str, int]], plan: torch.Tensor, max_rows: int) -> None:
        self.sites = sites
        self.device_plan = plan
        self.width = plan.shape[1]
        self.max_rows = max_rows
        # one upload: int64 flat indices (sets, then resets), then their int32 values packed in pairs
        cap = 2 * max_rows
        words = cap + (cap + 1) // 2
        self._ring = PinnedRing((words,), torch.int64, plan.device)
        self._staging = torch.empty(words, dtype=torch.int64, device=plan.device)
        self._last = np.zeros(0, np.int64)  # flat plan cells set by the last upload
        self._same: _Same | None = None
        self.reused = 0  # steps planned as the same cells as the last one
        self.uploads = 0  # steps whose plan changed (each: one H2D copy + one index_copy_)
        self.upload_bytes = 0

    @property
    def dirty(self) -> bool:
        """Whether the device plan holds cells of an earlier step (a later step must clear them)."""
        return bool(len(self._last))

    def plan(self, requests: dict[str, Any], req_ids: list[str], num_scheduled: np.ndarray,
             num_computed: np.ndarray) -> StepPlan:
        """Plan a step (``requests``: id -> request with ``plan``, ``prompt_len``, ``planned_upto``,
        ``drop``) and upload what changed in the device plan."""
        got = list(map(requests.get, req_ids))
        hits = [i for i, r in enumerate(got) if r is not None]
        if not hits:
            self._same = None
            self._upload(np.zeros(0, np.int64))
            return _EMPTY
        num_scheduled = np.asarray(num_scheduled[: len(req_ids)], dtype=np.int64)
        offsets = np.cumsum(num_scheduled) - num_scheduled
        idx = np.asarray(hits, dtype=np.int64)
        n = num_scheduled[idx]
        first = np.asarray(num_computed, dtype=np.int64)[idx]
        reqs = [got[i] for i in hits]
        upto = np.fromiter((r.planned_upto for r in reqs), np.int64, len(reqs))
        skip = np.minimum(np.maximum(upto - first, 0), n)  # recomputed after a preemption: planned once already
        for r, u in zip(reqs, np.where(n > 0, np.maximum(upto, first + n), upto).tolist()):
            r.planned_upto = u
        recomputed = int(skip.sum())
        # only requests with something to plan here: tokens left and a site on this rank
        lv = np.flatnonzero((n > skip) & np.fromiter((r.plan.captures for r in reqs), bool, len(reqs)))
        if not len(lv):
            self._same = None
            self._upload(np.zeros(0, np.int64))
            return StepPlan([], [], [], [], _EMPTY.positions, _EMPTY.masks, 0, 0, recomputed)
        reqs = [reqs[k] for k in lv.tolist()]
        count, skip, first = n[lv] - skip[lv], skip[lv], first[lv]
        starts = np.cumsum(count) - count
        total = int(starts[-1] + count[-1])
        prompt = np.fromiter((r.prompt_len for r in reqs), np.int64, len(reqs))
        if total == len(reqs):  # one token each (decode)
            owner = np.arange(total)
            pos, tok = first + skip, offsets[idx[lv]] + skip
        else:
            owner = np.repeat(np.arange(len(reqs)), count)
            local = np.arange(total) - starts[owner] + skip[owner]
            pos, tok, prompt = first[owner] + local, offsets[idx[lv]][owner] + local, prompt[owner]
        klass = (pos >= prompt - 1).astype(np.int64) + (pos >= prompt)
        same = self._same
        if (same is not None and same.reqs == list(map(id, reqs)) and np.array_equal(same.count, count)
                and np.array_equal(same.klass, klass) and np.array_equal(same.tok, tok)):
            # the cells of last step (steady decode of a stable batch): only the positions moved
            self._upload(same.flat)
            self.reused += 1
            return StepPlan(same.request_ids, same.sites, same.starts, same.ends, pos[same.t], same.masks,
                            len(same.t), 0, recomputed)
        self._same = None
        plans = [r.plan for r in reqs]
        union = np.flatnonzero(np.logical_or.reduce([p.cols for p in plans]))
        tables = np.stack([p.table for p in plans])[:, :, union]  # [R, 3, S']
        masks = tables[owner, klass]  # [tokens, S']
        for k, p in enumerate(plans):
            for bit, wanted, cols in p.explicit:
                a, b = int(starts[k]), int(starts[k] + count[k])
                sel = np.flatnonzero(np.isin(pos[a:b], wanted)) + a
                if len(sel):
                    masks[np.ix_(sel, np.searchsorted(union, cols))] |= bit
        t, c = np.nonzero(masks)
        if not len(t):
            self._upload(np.zeros(0, np.int64))
            return StepPlan([], [], [], [], _EMPTY.positions, _EMPTY.masks, 0, 0, recomputed)
        key = owner[t] * len(union) + c
        order = np.argsort(key, kind="stable")  # request, then site, then token (nonzero is token-major)
        t, c, key = t[order], c[order], key[order]
        cell_masks = masks[t, c]
        cell_pos = pos[t]
        kept = min(len(t), self.max_rows)
        bounds = np.flatnonzero(key[1:] != key[:-1]) + 1
        heads, ends = np.concatenate(([0], bounds)), np.append(bounds, len(t))
        owner_of, col_of = np.divmod(key[heads], len(union))
        col_of = union[col_of]
        if kept < len(t):  # the pool is full: drop (never wait), count, and tell the consumer
            for g in np.flatnonzero(ends > kept).tolist():
                cut = max(int(heads[g]), kept)
                hook, layer = self.sites[int(col_of[g])]
                reqs[int(owner_of[g])].drop(hook, layer, cell_pos[cut : ends[g]], cell_masks[cut : ends[g]])
            whole = heads < kept
            heads, ends, owner_of, col_of = heads[whole], np.minimum(ends[whole], kept), owner_of[whole], col_of[whole]
        sites = self.sites
        batch_of = idx[lv][owner_of].tolist()
        flat = union[c[:kept]] * self.width + tok[t[:kept]]
        self._upload(flat)
        step = StepPlan([req_ids[i] for i in batch_of], [sites[i] for i in col_of.tolist()], heads.tolist(),
                        ends.tolist(), cell_pos[:kept], cell_masks[:kept], kept, len(t) - kept, recomputed)
        if kept == len(t) and not any(p.explicit for p in plans):  # the next step may be the same cells
            cell_masks.flags.writeable = False  # shared by the steps that reuse it
            self._same = _Same(list(map(id, reqs)), reqs, count, klass, tok, t, flat, step.request_ids, step.sites, step.starts,
                               step.ends, cell_masks)
        return step

    def _upload(self, flat: np.ndarray) -> None:
        """Make the device plan hold row i at cell ``flat[i]`` and -1 at last step's other cells."""
        if np.array_equal(flat, self._last):
            return  # the same cells take the same rows: nothing changes on the device
        resets = np.setdiff1d(self._last, flat, assume_unique=True)
        m = len(flat) + len(resets)
        host, land = self._ring.stage()
        host[: len(flat)] = flat
        host[len(flat) : m] = resets
        values = host[m : m + (m + 1) // 2].view(np.int32)
        values[: len(flat)] = np.arange(len(flat), dtype=np.int32)
        values[len(flat) : m] = -1
        words = m + (m + 1) // 2
        staged = self._staging[:words]
        land(staged)
        self.device_plan.view(-1).index_copy_(0, staged[:m], staged[m:].view(torch.int32)[:m])
        self._last = flat
        self.uploads += 1
        self.upload_bytes += 8 * words
