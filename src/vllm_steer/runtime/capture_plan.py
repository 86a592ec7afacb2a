"""Capture planning: which batch tokens go to which pool rows this step, and the plan's upload.

Per distinct capture field, once (``compile_request``; the runtime copies the result for each request
with that field): for the three position classes a request's token can be in (before the last prompt token,
the last prompt token, generated), the consumer bitmask each of this rank's sites wants (``[3, n_sites]``;
the position modes ``all``/``all_prompt``/``last_prompt``/``all_generated`` depend on nothing else), plus the
few specs with explicit positions. Sites other ranks hook are left out there.

Per step (``CapturePlanner.plan``), over the capturing requests of the batch that have tokens in a position
class they want (a prefill capturing generated tokens only plans nothing; positions already planned once are
skipped: the preemption rule, ``planned_upto``), the captured (request, site, token) cells
in request (batch) order, then site, then token. They take pool rows in that order; past ``max_rows`` the
rest is dropped and recorded on the request (``req.drop``). The pool's step rows are a ring: a step's rows
start where the last planned step's ended, or at row 0 when they do not fit before ``max_rows``
(``_place``), so the next step's forward does not overwrite rows still being copied to the host.

Most steps are planned from ranges (``_plan_ranges``: no explicit positions, at most one device-reduced
consumer a request, s31): a request's tokens fall in its position classes as three consecutive ranges and
every position mode selects consecutive classes, so each (request, site) group is one range of tokens and
pool rows, made of at most three runs of one consumer mask. Numpy runs over requests and (request, site)
groups only; nothing is built per cell on the main thread: the step's cells go to the device plan, the
reduce and the consumers' process as runs, each expanded where it is used. Other steps take the general path
(per-token masks from the requests' tables, their explicit positions, ``nonzero`` and a sort), as before. A
step with last step's shape (the same requests in the same order, token counts, position classes and batch
slots, no explicit positions, nothing dropped) reuses its runs: only the positions move. Steady decode (the
batch of last step, one generated token each, each request one position further, none added or ended since:
``forget_steady``) is found from the batch's ids and token counts alone and advanced (``_advance``): a few small
array ops a step, whatever the requests. A decode step whose batch changed (an end, an arrival's first token, a new
order) is each request's piece (``_piece``: its cells at a generated position, built once, kept on its plan)
concatenated and shifted to its batch token (``_plan_decode``): no per-site or per-class work.

Consumers reduced on the device (``runtime.capture_reduce``; a request's slots are on its plan:
``red_bits``, ``red_slot``) leave the cells first: a ``last`` consumer keeps only its last selected token per
site, planned straight to its slot's pool row (or, when that token already has a row, a copy from it after
the forward); a ``mean`` consumer's tokens share the other consumers' rows or take new step rows after them,
and become (rows -> slot) adds after the forward, as runs of consecutive rows. Neither reaches the entries:
nothing of theirs goes to the host per step. In steady decode they repeat with the cells.

The device plan ``plan[site, token]`` (pool row, -1 none) changes sparsely: a step whose plan changed
resets last upload's runs (kept on the device) to -1, then sends its runs (first cell, first row, cells: 3 words
each) in one copy from a persistent pinned ring into a persistent device staging buffer and writes their cells
(``kernels/plan_runs``: a program a run; on the current stream, before the forward, outside any graph): a copy, an
event and two launches a step whose plan changed (each torch op ~20-90 us of host time on a GPU host, s36), none
when it is the same as last step's (steady decode of a stable batch) or idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_steer.capture.spec import POSITION_CLASSES
from vllm_steer.kernels.plan_runs import write_runs
from vllm_steer.runtime.capture_host import cells_of_runs
from vllm_steer.runtime.pinned_ring import PinnedRing



@dataclass
class RequestPlan:
    """What a request captures on this rank, in site columns of the plan (fixed while it lives)."""

    table: np.ndarray  # [3, n_sites] int64: consumer bits per position class and site
    explicit: list[tuple[int, np.ndarray, np.ndarray]]  # (bit, sorted positions, site columns)
    cols: np.ndarray  # [n_sites] bool: sites any of its specs captures here
    captures: bool  # any site here at all
    bit_cols: dict[int, np.ndarray]  # consumer bit -> the site columns its spec captures here (unique)
    classes: int = 7  # bit c: a site here wants position class c (explicit positions: every class)
    # consumers reduced on the device (``runtime.capture_reduce``), set once their slots are held:
    red_bits: tuple[int, ...] = ()
    red_mean: tuple[bool, ...] = ()
    red_slot: np.ndarray | None = None  # [len(red_bits), n_sites] int64: slot per site, -1 none
    red_mask: int = 0  # the OR of red_bits
    red_slots: np.ndarray | None = None  # the slots held, in ``red_layout`` order (``runtime.capture._SlotLayout``)
    red_layout: Any = None
    decode: tuple | None = None  # ``CapturePlanner._piece``: its cells at a generated position (set on first use)


def compile_request(specs: dict[int, Any], site_index: dict[tuple[str, int], int]) -> RequestPlan:
    """A request's plan from its specs (consumer bit -> ``CaptureSpec``); sites not in ``site_index``
    (hooked by another rank) are skipped."""
    n = len(site_index)
    table = np.zeros((3, n), dtype=np.int64)
    explicit, bit_cols = [], {}
    for bit, spec in specs.items():
        cols = np.array([site_index[s] for s in spec.sites if s in site_index], dtype=np.int64)  # sites are unique
        if not len(cols):
            continue
        bit_cols[bit] = cols
        classes = POSITION_CLASSES.get(spec.positions) if isinstance(spec.positions, str) else None
        if classes is None:
            explicit.append((bit, np.unique(np.asarray(spec.positions, dtype=np.int64)), cols))
            continue
        for c in classes:
            table[c, cols] |= bit
    cols = table.any(axis=0)
    for _, _, c in explicit:
        cols[c] = True
    classes = 7 if explicit else int(np.dot(table.any(axis=1), (1, 2, 4)))
    return RequestPlan(table, explicit, cols, bool(cols.any()), bit_cols, classes if cols.any() else 0)


@dataclass
class StepPlan:
    """This step's kept cells grouped by (request, site): group g is request ``request_ids[g]`` at
    ``sites[g]`` (hook, layer), cells ``starts[g]:ends[g]``; cell i is pool row ``base + i``. The cells'
    positions and consumer masks are runs (run i: ``run_len[i]`` cells at positions ``run_pos[i]``, +1, ...,
    all with mask ``run_mask[i]``), expanded where they are read (``cells``: the consumers' process, a drop)."""

    request_ids: list[str]
    sites: list[tuple[str, int]]
    starts: list[int]
    ends: list[int]
    run_len: np.ndarray
    run_pos: np.ndarray
    run_mask: np.ndarray
    rows: int
    dropped_rows: int
    recomputed: int
    planned: int = 0  # plan cells set this step (rows for consumers plus tokens reduced straight into a slot)
    reduce: ReduceStep | None = None
    pool_rows: int = 0  # step rows of the pool in use: the consumers' cells plus mean-reduced tokens' own rows
    base: int = 0  # pool row of cell 0: the step's rows are ``base .. base + pool_rows`` (the pool is a ring)

    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """Each cell's position and consumer mask (expanded once)."""
        got = self.__dict__.get("_cells")
        if got is None:
            got = self.__dict__["_cells"] = cells_of_runs(self.run_len, self.run_pos, self.run_mask)
        return got

    def wire(self) -> tuple:
        """The groups as the consumers' process receives them: a few lists and the runs' three arrays, whatever
        the count of (request, site) groups or cells (``runtime.capture_host`` expands the runs there)."""
        return self.request_ids, self.sites, self.starts, self.ends, self.run_len, self.run_pos, self.run_mask

    def entries(self):
        """(request id, layer, hook, positions, first row, masks) per group, in pool-row order."""
        pos, masks = self.cells()
        for rid, (hook, layer), a, b in zip(self.request_ids, self.sites, self.starts, self.ends):
            yield rid, layer, hook, pos[a:b], a, masks[a:b]


@dataclass
class ReduceStep:
    """This step's work for device-reduced consumers (``runtime.capture_reduce.ReduceRegion``): after the
    forward ``acc[mean_slot[i]] += pool[mean_src[i] + j]`` for j < ``mean_len[i]`` (runs of rows) and
    ``pool[copy_dst] = pool[copy_src]``; on the host each ``acct_slots`` slot counts ``acct_counts`` more rows and
    each ``last_slots`` slot now holds ``last_pos``."""

    mean_src: np.ndarray
    mean_len: np.ndarray
    mean_slot: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    acct_slots: np.ndarray
    acct_counts: np.ndarray
    last_slots: np.ndarray
    last_pos: np.ndarray


@dataclass
class _Steady:
    """A decode step whose successor may be planned by ``CapturePlanner._advance``: the batch (``ids``), the
    ``num_computed`` the next step must have (each request one token further), the requests whose mark moves."""

    ids: list[str]
    next: np.ndarray
    reqs: list
    same: _Same


def _with(obj: Any, **fields: Any) -> Any:
    """A copy of a plan dataclass with ``fields`` changed (``dataclasses.replace`` without its per-field
    ``__init__``: ~1 us instead of ~7); ``StepPlan``'s cached ``_cells`` is not carried over."""
    new = object.__new__(type(obj))
    d = dict(obj.__dict__)
    d.pop("_cells", None)
    d.update(fields)
    new.__dict__ = d
    return new


@dataclass
class _Same:
    """The last step's batch shape and its cells, for a step with the same shape (steady decode)."""

    reqs: list[int]  # id() of each request, in order (alive: ``held`` keeps them)
    held: list
    count: np.ndarray  # per request: tokens planned, the first one's batch token, its class ranges' ends
    tok0: np.ndarray
    e0: np.ndarray
    e1: np.ndarray
    pos0: np.ndarray  # and the first one's position (a step of the same shape moves each request's positions)
    step: StepPlan  # its runs' positions and reduce's last positions as they were
    run_req: np.ndarray  # each run's request
    last_req: np.ndarray  # each last slot's request
    flat: np.ndarray  # the device plan's runs: first cell, first row, cells (None: one each)
    rows: np.ndarray
    lens: np.ndarray | None


_NONE = np.zeros(0, np.int64)


_EMPTY = StepPlan([], [], [], [], _NONE, _NONE, _NONE, 0, 0, 0)


class CapturePlanner:
    """Plans steps and keeps the device plan ``[n_sites, width]`` in step with them."""

    def __init__(self, sites: list[tuple[str, int]], plan: torch.Tensor, max_rows: int, reduce_base: int = 0,
                 reduce_rows: int = 0, max_pairs: int = 0) -> None:
        self.sites = sites
        self.device_plan = plan
        self.width = plan.shape[1]
        self.max_rows = max_rows
        self.reduce_base = reduce_base  # pool row of reduce slot 0 (``runtime.capture_reduce``)
        self.max_pairs = max_pairs  # reduce pairs (adds + copies) one step may hold
        # one upload: the step's runs (first cell, first row, cells: int64, 3 words a run) in one copy into
        # ``_staging``, where they stay until the next upload resets them (``kernels/plan_runs``)
        cap = max_rows + reduce_rows  # a step's cells: consumer and fresh mean rows, then cells straight to slots
        self._ring = PinnedRing((3 * cap,), torch.int64, plan.device)
        self._staging = torch.empty(3 * cap, dtype=torch.int64, device=plan.device)
        # a persistent flat view (a view op costs ~20 us of host time on a GPU host: s36's op times)
        self._plan_flat = plan.view(-1)
        # launch both kernels now, on the buffers every upload uses (one run of no cells: nothing written), so a GPU
        # compiles them at start-up, not at the first capturing step (a JIT during inference: an engine error under
        # vLLM's ``--jit-monitor-mode error``)
        self._staging[:3].zero_()
        for reset in (False, True):
            write_runs(self._plan_flat, self._staging, 1, reset=reset)
        self._last = self._last_rows = self._last_lens = _NONE  # the runs of the last upload
        self._last_runs = 0  # its runs with cells (in ``_staging``, reset by the next upload)
        self._same: _Same | None = None
        self._steady: _Steady | None = None  # set after a decode step whose successor may be _advance'd
        self._hits: list = []  # the last planned step's requests (of the batch, captured or not)
        self.advanced = False  # the last step was planned by _advance
        self._next_base = 0  # where the next step's rows start unless they do not fit before the pool's end
        self.ranges = True  # plan steps without explicit positions from ranges (``_plan_ranges``; tests turn it off)
        self.pieces = True  # plan decode steps from per-request pieces (``_plan_decode``; tests turn it off)
        self.decoded = 0  # steps planned so
        self.advance = True  # plan steady decode steps by _advance (tests turn it off)
        self.advanced_steps = 0  # steps planned so
        self.ranged = 0  # steps planned so
        self.reused = 0  # steps planned as the same cells as the last one
        self.uploads = 0  # steps whose plan changed (each: one H2D copy + one index_copy_)
        self.upload_bytes = 0

    @property
    def dirty(self) -> bool:
        """Whether the device plan holds cells of an earlier step (a later step must clear them)."""
        return bool(self._last_runs)

    def clear(self) -> None:
        """Every cell of the device plan back to -1 (no request captures any more)."""
        self._same = self._steady = None
        self._upload(_NONE)

    def forget_steady(self) -> None:
        """The capturing requests changed (added, ended): the next step is planned in full."""
        self._steady = None

    def plan(self, requests: dict[str, Any], req_ids: list[str], num_scheduled: np.ndarray,
             num_computed: np.ndarray) -> StepPlan:
        """Plan a step (``requests``: id -> request with ``plan``, ``prompt_len``, ``planned_upto``,
        ``drop``) and upload what changed in the device plan.

        Steady decode (the same batch as last step, each request one token further, every capturing one at a
        generated position, last step's plan reusable, no request added or ended since: ``forget_steady``) is
        ``_advance``: its cells are last step's, each position one further, found without looking at the requests."""
        n = len(req_ids)
        num_scheduled, num_computed = np.asarray(num_scheduled), np.asarray(num_computed)
        st = self._steady
        if st is not None and self.advance and st.same is self._same and req_ids == st.ids:
            if (num_scheduled[:n] == 1).all() and (num_computed[:n] == st.next).all():
                return self._advance(st)
        self._steady = None
        self.advanced = False
        step = self._plan(requests, req_ids, num_scheduled, num_computed)
        same = self._same
        if (same is not None and not step.recomputed and not same.e1.any() and n
                and (num_scheduled[:n] == 1).all()):  # one generated token each: the next step may advance
            self._steady = _Steady(list(req_ids), np.asarray(num_computed[:n], np.int64) + 1, self._hits, same)
        return step

    def _advance(self, st: _Steady) -> StepPlan:
        """Last step's plan, every position one further (what ``_plan``'s reuse of ``_Same`` gives such a step:
        the device plan is unchanged, nothing is uploaded)."""
        self.advanced = True
        for r in st.reqs:
            r.planned_upto += 1
        st.next += 1  # its own arrays: moved in place (the step's arrays are new: a hand-off may still hold the old)
        same = st.same
        same.pos0 += 1
        last = same.step
        red = last.reduce
        if red is not None:
            red = _with(red, last_pos=red.last_pos + 1)
        same.step = _with(last, run_pos=last.run_pos + 1 if len(last.run_pos) else last.run_pos, recomputed=0,
                          reduce=red)
        self.reused += 1
        self.advanced_steps += 1
        return same.step

    def _plan(self, requests: dict[str, Any], req_ids: list[str], num_scheduled: np.ndarray,
              num_computed: np.ndarray) -> StepPlan:
        got = list(map(requests.get, req_ids))
        hits = [i for i, r in enumerate(got) if r is not None]
        self._hits = [got[i] for i in hits]
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
        count, pos0 = n - skip, first + skip  # each request's tokens to plan, the first one's position
        prompt = np.fromiter((r.prompt_len for r in reqs), np.int64, len(reqs))
        # their position classes as ranges: [0, e0) before the last prompt token, [e0, e1) it, [e1, count) generated
        e0, e1 = np.clip(prompt - 1 - pos0, 0, count), np.clip(prompt - pos0, 0, count)
        # only requests with something to plan here: tokens in a class some site of this rank wants (explicit
        # positions: any class); e.g. none in the prefill of requests capturing generated tokens only
        has = (e0 > 0) + 2 * (e1 > e0) + 4 * (count > e1)  # bit c: tokens in class c
        lv = np.flatnonzero(has & np.fromiter((r.plan.classes for r in reqs), np.int64, len(reqs)))
        if not len(lv):
            self._same = None
            self._upload(np.zeros(0, np.int64))
            return StepPlan([], [], [], [], _NONE, _NONE, _NONE, 0, 0, recomputed)
        tok0 = offsets[idx] + skip  # each request's first token to plan
        if len(lv) < len(reqs):
            reqs = [reqs[k] for k in lv.tolist()]
            count, pos0, tok0, prompt, e0, e1 = count[lv], pos0[lv], tok0[lv], prompt[lv], e0[lv], e1[lv]
        starts = np.cumsum(count) - count
        same = self._same
        if (same is not None and same.reqs == list(map(id, reqs)) and np.array_equal(same.count, count)
                and np.array_equal(same.tok0, tok0) and np.array_equal(same.e0, e0) and np.array_equal(same.e1, e1)):
            # the cells of last step (steady decode of a stable batch): only the positions moved, by as much as
            # their request's first one
            self._upload(same.flat, same.rows, same.lens)
            self.reused += 1
            moved, last = pos0 - same.pos0, same.step
            red = last.reduce
            if red is not None:
                red = _with(red, last_pos=red.last_pos + moved[same.last_req])
            same.pos0 = pos0
            same.step = _with(last, run_pos=last.run_pos + moved[same.run_req], recomputed=recomputed, reduce=red)
            return same.step
        self._same = None
        plans = [r.plan for r in reqs]
        shape = (count, tok0, e0, e1)
        if self.ranges and not any(p.explicit for p in plans) and all(len(p.red_bits) <= 1 for p in plans):
            if self.pieces and int(count.sum()) == len(count) and not e1.any():  # one generated token each
                step = self._plan_decode(reqs, plans, req_ids, idx[lv], pos0, tok0, recomputed, shape)
                if step is not None:
                    self.decoded += 1
                    return step
            step = self._plan_ranges(reqs, plans, req_ids, idx[lv], starts, pos0, tok0, e0, e1, recomputed, shape)
            if step is not None:
                self.ranged += 1
                return step
        total = int(starts[-1] + count[-1])
        if total == len(reqs):  # one token each (decode)
            owner = np.arange(total)
            pos, tok = pos0, tok0
        else:
            owner = np.repeat(np.arange(len(reqs)), count)
            local = np.arange(total) - starts[owner]
            pos, tok, prompt = pos0[owner] + local, tok0[owner] + local, prompt[owner]
        klass = (pos >= prompt - 1).astype(np.int64) + (pos >= prompt)
        union = np.flatnonzero(np.logical_or.reduce([p.cols for p in plans]))
        tables = np.stack([p.table for p in plans])[:, :, union]  # [R, 3, S']
        masks = tables[owner, klass]  # [tokens, S']
        for k, p in enumerate(plans):
            for bit, wanted, cols in p.explicit:
                a, b = int(starts[k]), int(starts[k] + count[k])
                sel = np.flatnonzero(np.isin(pos[a:b], wanted)) + a
                if len(sel):
                    masks[np.ix_(sel, np.searchsorted(union, cols))] |= bit
        red = self._take_reduced(plans, starts, count, masks, union) if any(p.red_mask for p in plans) else None
        t, c = np.nonzero(masks)
        if not len(t) and red is None:
            self._upload(np.zeros(0, np.int64))
            return StepPlan([], [], [], [], _NONE, _NONE, _NONE, 0, 0, recomputed)
        key = owner[t] * len(union) + c
        order = np.argsort(key, kind="stable")  # request, then site, then token (nonzero is token-major)
        t, c, key = t[order], c[order], key[order]
        cell_masks = masks[t, c]
        cell_pos = pos[t]
        kept = min(len(t), self.max_rows)
        bounds = np.flatnonzero(key[1:] != key[:-1]) + 1
        heads, ends = (np.concatenate(([0], bounds)), np.append(bounds, len(t))) if len(t) else (_NONE, _NONE)
        owner_of, col_of = np.divmod(key[heads], len(union))
        col_of = union[col_of]
        if kept < len(t):  # the pool is full: drop (never wait), count, and tell the consumer
            heads, ends, owner_of, col_of = self._drop_tail(reqs, kept, heads, ends, owner_of, col_of, cell_pos,
                                                            cell_masks)
        sites = self.sites
        batch_of = idx[lv][owner_of].tolist()
        flat = union[c[:kept]] * self.width + tok[t[:kept]]
        rows = np.arange(kept, dtype=np.int64)
        red_step, last_req = None, _NONE
        red_dropped = fresh = 0
        if red is not None:
            flat, rows, red_step, last_tok, red_dropped, fresh = self._place_reduced(red, flat, rows, kept, union, tok,
                                                                                     pos, reqs)
            last_req = owner[last_tok]
        base = self._place(kept + fresh)
        if base:
            rows = self._shift(rows, base)
            if red_step is not None:
                red_step.mean_src = self._shift(red_step.mean_src, base)
                red_step.copy_src = self._shift(red_step.copy_src, base)
        self._upload(flat, rows)
        step = StepPlan([req_ids[i] for i in batch_of], [sites[i] for i in col_of.tolist()], heads.tolist(),
                        ends.tolist(), np.ones(kept, np.int64), cell_pos[:kept], cell_masks[:kept], kept,
                        len(t) - kept + red_dropped, recomputed, len(flat), red_step, kept + fresh, base)
        step.__dict__["_cells"] = (step.run_pos, step.run_mask)  # a cell a run
        if kept == len(t) and not red_dropped and not any(p.explicit for p in plans):  # the next step may be the same
            self._same = _Same(list(map(id, reqs)), reqs, *shape, pos0, step, owner[t], last_req, flat, rows, None)
        return step

    def _drop_tail(self, reqs: list, kept: int, heads: np.ndarray, ends: np.ndarray, owner_of: np.ndarray,
                   col_of: np.ndarray, cell_pos: np.ndarray, cell_masks: np.ndarray) -> tuple:
        """Cells past ``kept`` are dropped (recorded on their requests); the groups cut to the kept cells."""
        for g in np.flatnonzero(ends > kept).tolist():
            cut = max(int(heads[g]), kept)
            hook, layer = self.sites[int(col_of[g])]
            reqs[int(owner_of[g])].drop(hook, layer, cell_pos[cut : ends[g]], cell_masks[cut : ends[g]])
        whole = heads < kept
        return heads[whole], np.minimum(ends[whole], kept), owner_of[whole], col_of[whole]

    def _plan_ranges(self, reqs: list, plans: list[RequestPlan], req_ids: list[str], batch: np.ndarray,
                     starts: np.ndarray, pos0: np.ndarray, tok0: np.ndarray, e0: np.ndarray, e1: np.ndarray,
                     recomputed: int, shape: tuple) -> StepPlan | None:
        """``plan``'s cells from per-request ranges, for a step without explicit positions and with at most one
        device-reduced consumer per request (None when that step may overflow the pool with one: ``plan`` then).

        A position mode selects a run of the position classes (all, all_prompt, last_prompt, all_generated), and a
        request's classes are consecutive token ranges, so a (request, site) group's cells are one token range made
        of at most three runs of one mask each: Python and the small arrays go per request and per (request, site),
        the per-cell arrays are built by a few ``repeat`` / ``arange`` (no sort, no search, no per-token mask table).
        The cells, rows, masks and reduce pairs are ``plan``'s general path's (its order within a step's fresh rows
        aside: any one row per cell)."""
        n_req = len(plans)
        count = shape[0]
        union = np.flatnonzero(np.logical_or.reduce([p.cols for p in plans]))
        n_col = len(union)
        tables = np.stack([p.table for p in plans])[:, :, union]  # [R, 3, S']
        red_mask = np.fromiter((p.red_mask for p in plans), np.int64, n_req)
        kept_bits = tables & ~red_mask[:, None, None]  # the bits whose cells take consumer rows
        seg_a = np.stack((np.zeros(n_req, np.int64), e0, e1), axis=1)  # [R, 3]: each class's first local token
        seg_n = np.stack((e0, e1 - e0, count - e1), axis=1)  # [R, 3]: its tokens
        for m in (kept_bits, tables & red_mask[:, None, None]):  # a mode with a gap between its classes: no ranges
            if ((m[:, 0] != 0) & (m[:, 1] == 0) & (m[:, 2] != 0) & (seg_n[:, 1:2] > 0)).any():
                return None
        run_n = np.where(kept_bits.transpose(0, 2, 1) != 0, seg_n[:, None, :], 0)  # [R, S', 3] cells per class
        group_n = run_n.sum(axis=2).ravel()  # [R * S']
        groups = np.flatnonzero(group_n)  # (request, site) order: the cells' order
        g_len = group_n[groups]
        heads = np.cumsum(g_len) - g_len
        total = int(heads[-1] + g_len[-1]) if len(groups) else 0
        owner_of, g_col = np.divmod(groups, n_col)
        runs = np.flatnonzero(run_n.ravel())  # (request, site, class) order
        r_len = run_n.ravel()[runs]
        r_req, r_rest = np.divmod(runs, 3 * n_col)
        r_col, r_cls = np.divmod(r_rest, 3)
        r_pos = pos0[r_req] + seg_a[r_req, r_cls]
        r_mask = kept_bits[r_req, r_cls, r_col]
        # each group's first local token (its first class with cells) and its first plan cell: a group is one run
        g_a = seg_a[owner_of, np.argmax(run_n.reshape(-1, 3)[groups] > 0, axis=1)]
        g_flat = union[g_col] * self.width + tok0[owner_of] + g_a
        red = None
        if red_mask.any():
            red = self._reduce_ranges(plans, red_mask, tables, seg_a, seg_n, union, heads, g_len, g_a, groups,
                                      total, n_col, starts, pos0, tok0)
            if red is None:
                return None
            if not len(red[5]) and not len(red[12]):  # nothing of theirs this step
                red = None
        kept = min(total, self.max_rows)
        dropped = total - kept
        ends = heads + g_len
        col_of = union[g_col]
        if kept < total:
            heads, ends, owner_of, col_of = self._drop_tail(reqs, kept, heads, ends, owner_of, col_of,
                                                            *cells_of_runs(r_len, r_pos, r_mask))
            r_cell = np.cumsum(r_len) - r_len
            whole = r_cell < kept
            r_req, r_pos, r_mask = r_req[whole], r_pos[whole], r_mask[whole]
            r_len = np.minimum(r_len[whole], kept - r_cell[whole])
        fresh = int(red[2].sum()) if red is not None else 0
        if not kept and not fresh and red is None:
            self._upload(_NONE)
            return StepPlan([], [], [], [], _NONE, _NONE, _NONE, 0, dropped, recomputed)
        base = self._place(kept + fresh)
        flat, rows, lens = g_flat[: len(heads)], heads + base, ends - heads  # the plan's runs: the groups' cells
        red_step, last_req = None, _NONE
        if red is not None:
            (f_flat, f_rows, f_len, d_flat, d_rows, mean_src, mean_len, mean_slot, copy_src, copy_dst, acct_s, acct_n,
             l_slot, last_req, l_pos) = red
            flat = np.concatenate((flat, f_flat, d_flat))
            rows = np.concatenate((rows, f_rows + base, d_rows))
            lens = np.concatenate((lens, f_len, np.ones(len(d_flat), np.int64)))
            mean_src, copy_src = mean_src + base, copy_src + base
            red_step = ReduceStep(mean_src, mean_len, mean_slot, copy_src, copy_dst, acct_s, acct_n, l_slot, l_pos)
        self._upload(flat, rows, lens)
        sites = self.sites
        step = StepPlan([req_ids[i] for i in batch[owner_of].tolist()], [sites[i] for i in col_of.tolist()],
                        heads.tolist(), ends.tolist(), r_len, r_pos, r_mask, kept, dropped, recomputed,
                        int(lens.sum()), red_step, kept + fresh, base)
        if not dropped:  # the next step may be the same
            self._same = _Same(list(map(id, reqs)), reqs, *shape, pos0, step, r_req, last_req, flat, rows, lens)
        return step

    def _piece(self, plan: RequestPlan) -> tuple:
        """A request's cells at a generated position, relative to its batch token (``_plan_decode``): its consumer
        cells' site columns (ascending) and masks ``[2, n]``, their sites, and its device-reduced consumer's sites
        ``[m, 4]``: column, slot, index of the consumer cell at that column (-1 none), mean (1) or last (0).
        Fixed while the request lives (its slots are held before it is first planned); kept on its plan."""
        want = plan.table[2]
        cells = np.flatnonzero(want & ~plan.red_mask)
        own = np.stack((cells, want[cells] & ~plan.red_mask))
        red = np.zeros((0, 4), np.int64)
        if plan.red_mask:
            rc = np.flatnonzero(want & plan.red_mask)
            at = np.full(len(rc), -1, np.int64)
            if len(cells):
                i = np.minimum(np.searchsorted(cells, rc), len(cells) - 1)
                at = np.where(cells[i] == rc, i, -1)
            red = np.stack((rc, plan.red_slot[0][rc], at, np.full(len(rc), int(plan.red_mean[0]))), axis=1)
        sites = self.sites
        plan.decode = got = (own, [sites[c] for c in cells.tolist()], red)
        return got

    def _plan_decode(self, reqs: list, plans: list[RequestPlan], req_ids: list[str], batch: np.ndarray,
                     pos0: np.ndarray, tok0: np.ndarray, recomputed: int, shape: tuple) -> StepPlan | None:
        """``_plan_ranges``' step when every request has one token, at a generated position (a decode batch that
        changed: a request ended, arrived, moved or came back): the requests' pieces (``_piece``, built once each)
        concatenated, shifted to their batch tokens and positions; no per-site or per-class work. The same cells,
        rows, masks, reduce pairs and order as ``_plan_ranges``. None when the pool or the pairs could overflow
        (the ranged or general path then drops what does not fit)."""
        pieces = [p.decode or self._piece(p) for p in plans]
        n_k = np.fromiter((x[0].shape[1] for x in pieces), np.int64, len(pieces))
        own = np.concatenate([x[0] for x in pieces], axis=1)
        total = own.shape[1]
        red = np.concatenate([x[2] for x in pieces]) if any(len(x[2]) for x in pieces) else None
        n_mean = int(red[:, 3].sum()) if red is not None else 0
        if total + n_mean > self.max_rows or n_mean > self.max_pairs:
            return None
        r_req = np.repeat(np.arange(len(pieces)), n_k)
        heads = np.arange(total, dtype=np.int64)
        if red is None and not total:
            self._upload(_NONE)
            self._same = None
            return StepPlan([], [], [], [], _NONE, _NONE, _NONE, 0, 0, recomputed)
        width = self.width
        flat, rows, lens = own[0] * width + tok0[r_req], heads, np.ones(total, np.int64)
        red_step, last_req, fresh = None, _NONE, 0
        if red is not None:
            k = np.repeat(np.arange(len(pieces)), np.fromiter((len(x[2]) for x in pieces), np.int64, len(pieces)))
            first = np.cumsum(n_k) - n_k  # each request's first consumer cell
            col, slot, at, mean = red.T
            inside = at >= 0
            src = first[k] + at  # the consumer cell's row where there is one
            cell = col * width + tok0[k]
            is_mean = mean != 0
            m_in, m_slot, m_src, m_cell = inside[is_mean], slot[is_mean], src[is_mean], cell[is_mean]
            fresh = int((~m_in).sum())
            mean_src = m_src.copy()
            mean_src[~m_in] = total + np.arange(fresh)  # fresh rows follow the consumer cells, in order
            f_flat, f_rows = m_cell[~m_in], mean_src[~m_in]
            last = ~is_mean
            l_in, l_slot, l_src, l_cell, last_req = inside[last], slot[last], src[last], cell[last], k[last]
            target = self.reduce_base + l_slot
            d_flat, d_rows = l_cell[~l_in], target[~l_in]
            flat = np.concatenate((flat, f_flat, d_flat))
            rows = np.concatenate((rows, f_rows, d_rows))
            lens = np.ones(len(flat), np.int64)
        base = self._place(total + fresh)
        if red is not None:
            rows[: total + fresh] += base  # step rows; last slots' rows stay
            red_step = ReduceStep(mean_src + base, np.ones(len(m_slot), np.int64), m_slot, l_src[l_in] + base, target[l_in],
                                  np.concatenate((m_slot, l_slot)), np.ones(len(m_slot) + len(l_slot), np.int64),
                                  l_slot, pos0[last_req])
        elif base:
            rows = rows + base
        self._upload(flat, rows, lens)
        rids = [req_ids[i] for i in batch.tolist()]
        step = StepPlan([rid for rid, n in zip(rids, n_k.tolist()) for _ in range(n)],
                        [s for x in pieces for s in x[1]], heads.tolist(), list(range(1, total + 1)),
                        np.ones(total, np.int64), pos0[r_req], own[1], total, 0, recomputed, len(flat), red_step,
                        total + fresh, base)
        self._same = _Same(list(map(id, reqs)), reqs, *shape, pos0, step, r_req, last_req, flat, rows, lens)
        return step

    def _reduce_ranges(self, plans: list[RequestPlan], red_mask: np.ndarray, tables: np.ndarray, seg_a: np.ndarray,
                       seg_n: np.ndarray, union: np.ndarray, heads: np.ndarray, g_len: np.ndarray, g_a: np.ndarray,
                       groups: np.ndarray, total: int, n_col: int, starts: np.ndarray, pos0: np.ndarray,
                       tok0: np.ndarray) -> tuple | None:
        """``_plan_ranges``' device-reduced consumers (one per request): per (request, site) the token range its
        bit selects. Mean: the part inside the site's consumer cells adds their rows, the rest (at most a run
        before and one after) takes fresh step rows after them. Last: its range's last token, a copy from its
        consumer row or planned straight to the slot. Step rows (relative to the step's base): fresh cells'
        flat indices and rows, last cells planned straight to slots, the pairs, the accounting, the last slots and
        their tokens (among the step's planned tokens). None when the step's rows or pairs could overflow."""
        width, group_of = self.width, np.full(len(plans) * n_col, -1, np.int64)
        group_of[groups] = np.arange(len(groups))
        heads, g_len, g_a = np.append(heads, 0), np.append(g_len, 0), np.append(g_a, 0)  # group -1: no cells
        rk = np.flatnonzero(red_mask)  # the requests reduced here, each by one consumer (its bit is red_mask)
        slot = np.stack([plans[k].red_slot[0] for k in rk.tolist()])[:, union]  # [Rr, S']
        hit_n = np.where((tables[rk] & red_mask[rk, None, None]) != 0, seg_n[rk][:, :, None], 0)  # [Rr, 3, S']
        n_hit = hit_n.sum(axis=1)
        first_cls = np.argmax(hit_n > 0, axis=1)  # [Rr, S']
        rr, cs = np.nonzero(n_hit)  # (request, site) order
        k = rk[rr]
        a = seg_a[k, first_cls[rr, cs]]  # the local tokens [a, b) its bit selects at the site
        b = a + n_hit[rr, cs]
        sl = slot[rr, cs]
        is_mean = np.fromiter((plans[i].red_mean[0] for i in rk.tolist()), bool, len(rk))[rr]
        n_mean = int((b - a)[is_mean].sum())
        if total + n_mean > self.max_rows or n_mean > self.max_pairs:
            return None  # may not all fit: the general path drops what does not
        f_flat = f_rows = f_len = mean_src = mean_len = mean_slot = acct_s = acct_n = _NONE
        if is_mean.any():
            mk, mc, ma, mb, ms = k[is_mean], cs[is_mean], a[is_mean], b[is_mean], sl[is_mean]
            g = group_of[mk * n_col + mc]
            ga = g_a[g]
            oa, ob = np.clip(ga, ma, mb), np.clip(ga + g_len[g], ma, mb)  # the part inside the consumer cells
            ob = np.maximum(oa, ob)
            none = np.full(len(mk), -1)
            # each site's runs before, inside and after its consumer cells (-1: fresh rows): its rows in token order
            pieces = ((mk, mc, ma, oa, none, ms), (mk, mc, oa, ob, heads[g] + oa - ga, ms), (mk, mc, ob, mb, none, ms))
            pc = np.stack([np.stack(x, axis=1) for x in pieces], axis=1).reshape(-1, 6)
            pc = pc[pc[:, 3] > pc[:, 2]]
            pk, pcol, pa, pb, src, mean_slot = pc.T
            mean_len = pb - pa
            fresh = src < 0
            f_n = np.where(fresh, mean_len, 0)
            mean_src = np.where(fresh, total + np.cumsum(f_n) - f_n, src)  # fresh runs' rows follow the consumer cells
            f_rows, f_len = mean_src[fresh], mean_len[fresh]
            f_flat = union[pcol[fresh]] * width + tok0[pk[fresh]] + pa[fresh]
            acct_s, acct_n = ms, mb - ma
        d_flat = d_rows = copy_src = copy_dst = l_slot = lk = l_pos = gs = gn = _NONE
        if not is_mean.all():
            last = ~is_mean
            lk, lc, la, lb, l_slot = k[last], cs[last], a[last], b[last], sl[last]
            lt = lb - 1
            g = group_of[lk * n_col + lc]
            ga = g_a[g]
            inside = (lt >= ga) & (lt < ga + g_len[g])
            target = self.reduce_base + l_slot
            copy_src, copy_dst = (heads[g] + lt - ga)[inside], target[inside]
            d_flat = (union[lc] * width + tok0[lk] + lt)[~inside]
            d_rows = target[~inside]
            l_pos = pos0[lk] + lt
            gs, gn = l_slot, lb - la
        return (f_flat, f_rows, f_len, d_flat, d_rows, mean_src, mean_len, mean_slot, copy_src, copy_dst,
                np.concatenate((acct_s, gs)), np.concatenate((acct_n, gn)), l_slot, lk, l_pos)

    def _place(self, n: int) -> int:
        """Where a newly planned step's ``n`` rows start: right after the last placed step's, or at 0 when they do
        not fit before ``max_rows``. Consecutive steps thus use different rows while the pool holds several, so a
        step's forward need not wait for the copy of the last step's rows to the host (``CaptureRuntime``
        waits only for the copies of the rows it overwrites)."""
        base = self._next_base if self._next_base + n <= self.max_rows else 0
        self._next_base = base + n
        return base

    def _shift(self, rows: np.ndarray, base: int) -> np.ndarray:
        """Step rows (below ``max_rows``) moved to start at ``base``; reduce slots' rows stay."""
        return np.where(rows < self.max_rows, rows + base, rows)

    def _take_reduced(self, plans: list[RequestPlan], starts: np.ndarray, count: np.ndarray, masks: np.ndarray,
                      union: np.ndarray) -> dict[str, np.ndarray] | None:
        """Take the device-reduced consumers' bits out of ``masks`` (in place): their cells, as token and
        union-column indices with the slot each goes to (mean: every selected token; last: the last one
        per site), plus the rows each slot counts."""
        parts: dict[str, list] = {k: [] for k in ("mt", "mc", "ms", "mk", "mb", "lt", "lc", "ls", "gs", "gn")}
        for k, p in enumerate(plans):
            if not p.red_mask:
                continue
            a, b = int(starts[k]), int(starts[k] + count[k])
            sub = masks[a:b]
            for bit, mean, slot_row in zip(p.red_bits, p.red_mean, p.red_slot):
                hit = (sub & bit) != 0
                n_hit = hit.sum(axis=0)
                cs = np.flatnonzero(n_hit)
                if not len(cs):
                    continue
                slot_u = slot_row[union]
                if mean:
                    tt, cc = np.nonzero(hit)
                    parts["mt"].append(tt + a)
                    parts["mc"].append(cc)
                    parts["ms"].append(slot_u[cc])
                    parts["mk"].append(np.full(len(tt), k, np.int64))
                    parts["mb"].append(np.full(len(tt), bit, np.int64))
                else:
                    parts["lt"].append((b - a - 1) - np.argmax(hit[::-1][:, cs], axis=0) + a)
                    parts["lc"].append(cs)
                    parts["ls"].append(slot_u[cs])
                    parts["gs"].append(slot_u[cs])
                    parts["gn"].append(n_hit[cs])
            np.bitwise_and(sub, ~p.red_mask, out=sub)
        if not any(parts.values()):
            return None
        return {k: np.concatenate(v).astype(np.int64) if v else _NONE for k, v in parts.items()}

    def _place_reduced(self, red: dict[str, np.ndarray], flat: np.ndarray, rows: np.ndarray, kept: int,
                       union: np.ndarray, tok: np.ndarray, pos: np.ndarray, reqs: list) -> tuple:
        """Rows for the reduced cells: a mean cell adds the row of its token (a consumer's row, or a new step
        row after them: past ``max_rows`` it is dropped, recorded on its request); a last cell is planned
        straight to its slot's pool row, or, when the token already has a row, copied from it after the forward."""
        width, base = self.width, self.reduce_base
        order = np.argsort(flat, kind="stable")
        sorted_flat = flat[order]

        def home(cells: np.ndarray, known: np.ndarray, known_rows: np.ndarray) -> np.ndarray:
            if not len(known):
                return np.full(len(cells), -1, np.int64)
            at = np.minimum(np.searchsorted(known, cells), len(known) - 1)
            return np.where(known[at] == cells, known_rows[at], -1)

        mean_src, mean_slot, dropped, room = red["mt"][:0], red["ms"][:0], 0, 0
        if len(red["mt"]):
            fm = union[red["mc"]] * width + tok[red["mt"]]
            src = home(fm, sorted_flat, rows[order])
            new = src < 0
            fresh, inv = np.unique(fm[new], return_inverse=True)
            room = max(min(self.max_rows - kept, len(fresh)), 0)
            new_rows = np.where(np.arange(len(fresh)) < room, kept + np.arange(len(fresh)), -1)
            src[new] = new_rows[inv]
            flat, rows = np.concatenate((flat, fresh[:room])), np.concatenate((rows, new_rows[:room]))
            ok = src >= 0
            ok &= np.cumsum(ok) <= self.max_pairs  # the step's pairs are bounded too
            if not ok.all():  # no row for them: dropped like any row the pool cannot hold
                for i in np.flatnonzero(~ok).tolist():
                    hook, layer = self.sites[int(union[red["mc"][i]])]
                    reqs[int(red["mk"][i])].drop(hook, layer, pos[red["mt"][i : i + 1]], red["mb"][i : i + 1])
                dropped = int((~ok).sum())
            mean_src, mean_slot = src[ok], red["ms"][ok]
            acct = np.bincount(red["ms"][ok], minlength=0)
            m_slots = np.flatnonzero(acct)
            m_counts = acct[m_slots]
        else:
            m_slots = m_counts = _NONE
        copy_src, copy_dst = _NONE, _NONE
        if len(red["lt"]):
            fl = union[red["lc"]] * width + tok[red["lt"]]
            order = np.argsort(flat, kind="stable")
            src = home(fl, flat[order], rows[order])
            target = base + red["ls"]
            direct = np.flatnonzero(src < 0)
            if len(direct):  # the first last-slot of a cell takes the plan cell; others copy from it
                cells, first = np.unique(fl[direct], return_index=True)
                head = direct[first]
                flat, rows = np.concatenate((flat, cells)), np.concatenate((rows, target[head]))
                src[direct] = target[head][np.searchsorted(cells, fl[direct])]
            copy = src != target
            copy_src, copy_dst = src[copy], target[copy]
        last_slots, last_tok = red["ls"], red["lt"]
        step = ReduceStep(mean_src, np.ones(len(mean_src), np.int64), mean_slot, copy_src, copy_dst,
                          np.concatenate((m_slots, red["gs"])), np.concatenate((m_counts, red["gn"])), last_slots,
                          pos[last_tok])
        return flat, rows, step, last_tok, dropped, room

    def _upload(self, flat: np.ndarray, rows: np.ndarray | None = None, lens: np.ndarray | None = None) -> None:
        """Make the device plan hold ``rows[i] + j`` at cell ``flat[i] + j`` for j < ``lens[i]`` (runs; default one
        cell each, ``rows`` default i) and -1 at last upload's other cells: last upload's runs (kept on the device)
        reset, this one's 3 words a run staged in a pinned ring buffer, copied up once and written
        (``kernels/plan_runs``): a copy, an event and two launches a step whose plan changed, none when it is the same
        as last step's. (s36: per-cell uploads took 5-9 device ops and ~0.2 ms of numpy at 32768 cells.)"""
        if rows is None:
            rows = np.arange(len(flat), dtype=np.int64)
        if lens is None:
            lens = np.ones(len(flat), np.int64)
        if (np.array_equal(flat, self._last) and np.array_equal(rows, self._last_rows)
                and np.array_equal(lens, self._last_lens)):
            return  # the same cells take the same rows: nothing changes on the device
        plan = self._plan_flat
        if self._last_runs:  # last upload's cells back to -1 first (ordered before the copy below: one stream)
            write_runs(plan, self._staging, self._last_runs, reset=True)
        n = len(flat)
        m = int(lens.sum()) if n else 0
        if m:
            host, land = self._ring.stage()
            host[:n], host[n : 2 * n], host[2 * n : 3 * n] = flat, rows, lens
            land(self._staging[: 3 * n])
            write_runs(plan, self._staging, n)
            self.upload_bytes += 24 * n
        self._last, self._last_rows, self._last_lens = flat, rows, lens
        self._last_runs = n if m else 0
        self.uploads += 1
