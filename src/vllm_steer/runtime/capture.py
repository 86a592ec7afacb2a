"""Worker-side capture: per-step plans, the device pool, and the dispatch thread to consumers.

Per step (host, only while some request captures): for each capturing request of the batch, the
positions each consumer wants at each (hook, layer) site become pool rows; rows wanted by several
consumers are gathered once and carry a bitmask of them. The plan (token -> pool row, per site)
is planned and updated on the device sparsely by ``runtime.capture_plan``; the capture op fills the
pool inside the forward. After the forward, the used rows are copied into a shared-memory ring read by
the consumers' process (``runtime.capture_lanes``, ``runtime.capture_host``: consumers never take this
process's GIL), where each consumer has its own queue and thread (a "lane": a slow consumer delays only
itself). A raising consumer is counted; nothing stalls or kills the engine; a dead consumers' process
disables capture for them (its requests' driver results are errors).

Consumers that only want one row per site (``device_reduce``: ``activations``) are reduced on the device
instead (``runtime.capture_reduce``): per request and site an accumulator slot held for the request's
life (``steer.capture_reduce_rows``; ``stats["reduced_requests"]``), nothing copied per step, the slots
gathered into the ring at its finish and handed to ``on_reduced``. A request that finds too few free
slots is captured step by step as above (``stats["reduce_fallbacks"]``).

Results of driver consumers go to the process that submitted the request, on a side channel the
engine loop never waits on: when every consumer lane of this worker has handled a request's end,
its driver results are PUSHed to the request's ``capture_reply`` address (``runtime.result_push``;
received by ``capture.inbox``), with how many engine requests the message covers (n > 1 children
share the id callers know). Nothing is kept here once sent; a send that fails is counted
(``stats["result_push_failed"]``). ``publish`` ends requests the runner has not yet heard finished
(``capture.collect`` on an in-process engine, which is not stepped again after its last output).

When the plan is made: before the forward of a step a CUDA graph replays (no Python runs inside it); in the forward
of an eager step (a prefill above the graph sizes, CPU), by its first op at a site a request may capture
(``defer_step``, ``kernels.capture_rows.live``: ``wanted`` holds those sites' plan rows), so the host work runs while
the GPU computes the layers before that site: before the forward's launch, or in its first layers, the GPU idles for
it (the prefill arms' gap, s36-s37). The runners' requests are registered at the step's plan too (``add_later``
queues them), so an eager step's capture work is inside its forward. A step's rows are handed on after the runner's
sampler (their D2H copy queued behind its output copy: ``runtime.manager.with_after_sample``), and on a GPU the
notifier sends them once the next step is launched (``launched``, ``runtime.capture_lanes``).

Each position of a request is planned once: a preempted request recomputes its prompt and
generated tokens from position 0 (or from its cached prefix) when it resumes, and positions below
the request's mark (``planned_upto``) were planned already, so they are skipped (counted in
``stats["recomputed_positions"]``). Only positions the engine computes are captured: prefix-cache
hits are never computed (the front end turns cache reads off for captures that need the prompt).

Parallelism: TP ranks see the same residual, so only TP rank 0 of each pipeline stage captures (its
stage's sites: worker consumers there get each site once), in every data-parallel engine. Every
stage runs every consumer; a driver hears of a request only on the stages holding one of its spec's
sites (the submitting process merges their results: ``capture.inbox``), a worker consumer on every
stage (each stage's instance finishes the request: the filesystem consumer's ``request.json`` covers
them all). Result messages and finish metas carry the stage.

Exhaustion policy: never block the step, drop and count, tell the consumer. A step that wants more
rows than the pool holds (``steer.capture_max_rows``) keeps the first rows in batch order and
drops the rest (``stats["dropped_rows"]``); a rows packet that finds 256 packets still undelivered
in a consumer's lane, or no room in the shared ring (``stats["ring_full"]``), is dropped for that
consumer (``stats["dropped_packets"]``, once per lane; its rows, once per consumer that wanted them:
``stats["lost_rows"]``). Either way the positions are recorded per request, site
and consumer, and the request's finish meta names them (``dropped``, ``dropped_rows``; see
``vllm_steer.capture.consumer``). A finish packet that finds ``MAX_QUEUED_FINISHES`` still undelivered in
a lane (its consumer is stuck: a hung call holds the lane) is not queued: the consumer never hears of
that request, a driver consumer's result is ``{"error": "dropped", ...}`` at once, and
``stats["dropped_finishes"]`` counts it. So a hung consumer holds at most that many requests' state.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_steer.capture.consumer import consumer_class, reduces_on_device
from vllm_steer.capture.spec import CaptureSpec, parse_capture_spec
from vllm_steer.core.config import SteerConfig
from vllm_steer.kernels.capture_rows import live
from vllm_steer.runtime.capture_lanes import RING_STEPS, CaptureHost, Lane
from vllm_steer.runtime.capture_plan import CapturePlanner, ReduceStep, RequestPlan, StepPlan, compile_request
from vllm_steer.runtime.capture_reduce import MODES, ReduceRegion
from vllm_steer.runtime.result_push import ResultPusher
from vllm_steer.runtime.streams import current_stream

logger = logging.getLogger("vllm.steer.capture")
# on a GPU the notifier does a step's Python work once the next step is launched (``capture_lanes``); "0": at once
GATE = os.environ.get("VLLM_STEER_CAPTURE_GATE", "1") != "0"


class CaptureBuffers:
    """Device pool ``[max_rows, D]`` and per-site plans ``[n_sites, max_tokens]`` (int32, -1 = none)."""

    def __init__(self, sites: list[tuple[str, int]], max_rows: int, max_tokens: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, reduce_rows: int = 0) -> None:
        self.site_index = {s: i for i, s in enumerate(sites)}
        # step rows, then the ``last`` accumulators of device-reduced consumers (runtime.capture_reduce)
        self.pool = torch.zeros(max_rows + reduce_rows, hidden, dtype=dtype, device=device)
        width = -(-max_tokens // 4) * 4  # each site's row starts on 16 bytes (see runtime.tables)
        self.plan = torch.full((len(sites), width), -1, dtype=torch.int32, device=device)
        self.max_rows = max_rows

    def plan_view(self, hook: str, layer: int) -> torch.Tensor:
        return self.plan[self.site_index[(hook, layer)]]


@dataclass
class _Request:
    prompt_len: int
    specs: dict[int, CaptureSpec]  # consumer bit -> spec
    meta: dict[str, Any] = field(default_factory=dict)
    planned_upto: int = 0  # positions below it were planned (captured or dropped) once already
    ends_at: int | None = None  # every position it can still want is below it (None: unbounded generated tokens)
    plan: RequestPlan | None = None  # what it captures on this rank, compiled when it is added
    dropped: dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    """(hook, layer) -> [(positions, consumer masks)] of rows that were wanted and not delivered."""

    def drop(self, hook: str, layer: int, positions: np.ndarray, masks: np.ndarray) -> None:
        self.dropped.setdefault((hook, layer), []).append((positions, masks))

    def dropped_for(self, bit: int) -> dict[str, list[int]]:
        """``{"hook.layer": sorted positions}`` a consumer wanted and never got."""
        out = {}
        for (hook, layer), parts in self.dropped.items():
            pos = np.unique(np.concatenate([p[(m & bit) != 0] for p, m in parts]))
            if len(pos):
                out[f"{hook}.{layer}"] = pos.tolist()
        return out


MAX_QUEUED_ROW_PACKETS = 256  # per consumer lane
MAX_TRACKED_COPIES = 8  # pool copies to the host whose rows a later step checks before overwriting them
MAX_QUEUED_FINISHES = 4096  # per consumer lane: past it the consumer is stuck, its finishes are dropped
RECENTLY_FINISHED_MAX = 4096  # engine ids remembered as finished (a late publish or re-add is ignored)
COMPILED_MAX = 64  # distinct capture fields whose compiled specs and plan are kept (``_compile``)
_EARLY = "early"  # a finished id's mark: its capture ended before the engine ended it (a re-add is ignored)


def _ends_at(specs, prompt_len: int, max_tokens: int | None = None) -> int | None:
    """The position every spec's wanted positions are below (None: some spec wants generated tokens of a
    request without ``max_tokens``). Generated tokens are fed back up to position ``prompt_len + max_tokens - 2``:
    the last sampled token is never computed, so a request that runs to ``max_tokens`` has had every position
    planned in the step that samples its last token."""
    end = 0
    for spec in specs:
        mode = spec.positions
        if mode in ("all_prompt", "last_prompt"):
            end = max(end, prompt_len)
        elif isinstance(mode, tuple):
            end = max(end, max(mode, default=-1) + 1)
        elif max_tokens is None:
            return None
        else:
            end = max(end, prompt_len + max(max_tokens, 1) - 1)
    return end


@dataclass(frozen=True)
class _SlotLayout:
    """How a capture field's device-reduced consumers hold accumulator slots (``_compile``): slot i of a request's
    ``red_slots`` is consumer ``bits[rows[i]]``'s at site column ``cols[i]`` (consumer-major, columns ascending)."""

    bits: tuple[int, ...]
    means: tuple[bool, ...]
    mask: int  # the OR of bits
    rows: np.ndarray
    cols: np.ndarray
    spans: tuple[tuple[int, int, int, bool], ...]  # per consumer: (bit, its first slot, end, mean)
    sites: tuple[tuple[str, int], ...]  # per slot: (hook, layer)
    mean: np.ndarray  # per slot: bool


@dataclass
class _Finishing:
    """A finished request whose finish packets are not yet handled by every consumer lane."""

    left: dict[int, int]  # consumer bit -> finish packets not yet handled (n>1: children share a key)
    instances: dict[int, str]  # bit -> instance of driver consumers
    reply: str | None = None  # where the results go (the submitting process's inbox)
    requests: int = 0  # engine requests folded in (the message says so: the inbox counts them)
    results: dict[str, Any] = field(default_factory=dict)


class CaptureRuntime:
    def __init__(self, cfg: SteerConfig, sites: list[tuple[str, int]], num_layers: int, max_tokens: int,
                 hidden: int, dtype: torch.dtype, device: torch.device, tp_rank: int = 0,
                 pp_rank: int = 0, pp_size: int = 1) -> None:
        reducing = tp_rank == 0 and any(  # a device-reducing consumer is hosted on this rank
            reduces_on_device(cls)
            for cls in map(consumer_class, (c.name for c in cfg.capture)))
        reduce_rows = cfg.capture_reduce_rows if reducing else 0
        self.buffers = CaptureBuffers(sites, cfg.capture_max_rows, max_tokens, hidden, dtype, device, reduce_rows)
        self.num_layers = num_layers
        self.hooks = tuple(cfg.hooks)
        self.stage, self.stages = pp_rank, pp_size
        self.consumers: dict[int, tuple[str, type]] = {}  # bit -> (instance, class): instances live in the host
        self.bit_of: dict[str, int] = {}
        self.global_specs: dict[int, CaptureSpec] = {}
        self.stats = {"rows": 0, "dropped_rows": 0, "dropped_packets": 0, "lost_rows": 0, "dropped_finishes": 0,
                      "consumer_errors": 0, "recomputed_positions": 0, "ring_full": 0, "consumer_host_deaths": 0,
                      "results_sent": 0, "result_push_failed": 0, "publish_calls": 0,
                      "reduced_requests": 0, "reduce_fallbacks": 0, "plans_in_forward": 0}
        self._stats_lock = threading.Lock()  # the host's threads count from their threads
        hosted: list[tuple[int, str, type, dict]] = []
        for i, c in enumerate(cfg.capture):
            cls = consumer_class(c.name)
            # TP ranks hold the same residual: TP rank 0 of each stage captures its stage's sites
            if tp_rank != 0:
                continue
            bit = 1 << i
            self.consumers[bit] = (c.instance_name, cls)
            self.bit_of[c.instance_name] = bit
            hosted.append((bit, c.instance_name, cls, dict(c.params)))
        # the consumers run in their own process, fed through a shared-memory ring (runtime.capture_lanes)
        self._host = CaptureHost(self, hosted, RING_STEPS * cfg.capture_max_rows, hidden, dtype, device,
                                 MAX_QUEUED_ROW_PACKETS, MAX_QUEUED_FINISHES, gate=GATE) if hosted else None
        self._lanes: dict[int, Lane] = self._host.lanes if self._host else {}
        # bit -> class of the consumers hosted here that may reduce on the device
        self._reducers = {bit: cls for bit, (_, cls) in self.consumers.items() if bit in self._lanes
                          and reduces_on_device(cls)}
        for bit, raw in (self._host.global_specs if self._host else {}).items():
            spec = parse_capture_spec(self.consumers[bit][0], raw, num_layers, self.hooks) if raw else None
            if spec is not None and self._runs_here(bit, spec):
                self.global_specs[bit] = spec
        self._requests: dict[str, _Request] = {}
        self._adds: list[tuple] = []  # add_request's arguments, registered at the next plan (``_register``)
        self._deferred: tuple | None = None  # an eager step's plan_step arguments, planned in its forward
        self.in_forward = True  # eager steps are planned in their forward (off once one was not: after_forward)
        # the site columns a request registered or queued since the plan was last all -1 may capture at (never
        # shrinks until then: the device plan holds cells only there), and their plan rows for ``live.wanted``
        self._union = np.zeros(len(sites), dtype=bool)
        self._unioned: dict[int, np.ndarray] = {}  # the ``cols`` already in it (by id; held: ids stay unique)
        plan = self.buffers.plan
        self._row_ptr = [plan.data_ptr() + k * plan.stride(0) * plan.element_size() for k in range(len(sites))]
        live.wanted = frozenset()
        self._compiled: dict[str, tuple | None] = {}  # repr of a capture field -> _compile's answer
        max_pairs = 2 * cfg.capture_max_rows + reduce_rows
        self._reduce = (ReduceRegion(reduce_rows, cfg.capture_max_rows, self.buffers.pool, max_pairs)
                        if reduce_rows else None)
        self._red_step: ReduceStep | None = None
        self._planner = CapturePlanner(sites, self.buffers.plan, self.buffers.max_rows, cfg.capture_max_rows,
                                       reduce_rows, max_pairs)
        self._pending: StepPlan | None = None  # this step's groups, handed off after the forward
        self.sample_due = False  # the runner samples after this forward: hand off then (``manager.with_after_sample``)
        self._rows_used = 0
        self._results_lock = threading.Lock()
        self._finishing: dict[str, _Finishing] = {}  # key (external id or engine id) -> lanes still at it
        self._finished: OrderedDict[str, str | None] = OrderedDict()  # recently finished engine ids (bounded)
        self._bounded: set[str] = set()  # requests whose wanted positions end somewhere (ends_at)
        self._complete: list[str] = []  # of those, the ones this step's plan completed
        self._ends_in = 0  # steps (each advancing every request of the batch by one) until one of them completes
        self._pusher = ResultPusher()
        self._copies: list[tuple[int, int, Any]] = []  # (first row, end, event) of pool copies still maybe running
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def close(self) -> None:
        """Stop the consumers' process (it delivers what was sent, closes its consumers, exits)."""
        live.wanted = live.deferred = None
        if self._host is not None:
            self._host.close()

    def _count(self, stat: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[stat] += n

    def status(self) -> dict[str, int]:
        """``stats`` plus the counters consumers keep themselves (an optional ``stats()`` method, e.g.
        the filesystem consumer's ``write_errors``; read in the consumers' process, at most ``STATS_S``
        old), summed by name over consumers."""
        with self._stats_lock:
            out = dict(self.stats)
        for own in (self._host.consumer_stats if self._host is not None else {}).values():
            for k, v in own.items():
                out[k] = out.get(k, 0) + v
        return out

    # ---- control plane -----------------------------------------------------------------
    def add_later(self, request_id: str, capture: dict | None, prompt_len: int, meta: dict | None = None,
                  max_tokens: int | None = None) -> None:
        """``add_request`` at the next step's plan (in an eager step's forward) or when ends or results are asked
        for first (``_register``), whichever comes first: what the runners call. Its capture field is compiled now
        (cached per field), so the sites it may capture at are known before the forward (``live.wanted``)."""
        got = self._compile(capture)
        if got is not None:
            self._want(got[1].cols)
            self._adds.append((request_id, got, prompt_len, meta, max_tokens))

    def _register(self) -> None:
        """Register the queued requests, in order (anything reading ``_requests`` calls this first)."""
        adds, self._adds = self._adds, []
        for args in adds:
            self._add(*args)

    def _want(self, cols: np.ndarray) -> None:
        """Sites a request may capture at: into the union, and their plan rows into ``live.wanted`` (once per compiled
        field: requests sharing one share its ``cols``, kept here so its id stays its own until the reset; at most
        ``COMPILED_MAX`` kept, as ``_compile`` keeps: a server that never idles sees new fields without bound)."""
        if id(cols) in self._unioned:
            return
        if len(self._unioned) >= COMPILED_MAX:
            self._unioned.clear()  # a cache of what the union holds: the union itself stays
        self._unioned[id(cols)] = cols
        if (cols & ~self._union).any():
            self._union |= cols
            self._publish_wanted()

    def _reset_union(self) -> None:
        """The device plan is all -1 again: the union holds only the queued requests' sites."""
        self._union[:] = False
        self._unioned.clear()
        for _, got, *_ in self._adds:
            self._want(got[1].cols)
        self._publish_wanted()

    def _publish_wanted(self) -> None:
        live.wanted = frozenset(self._row_ptr[k] for k in np.flatnonzero(self._union).tolist())

    def add_request(self, request_id: str, capture: dict | None, prompt_len: int, meta: dict | None = None,
                    max_tokens: int | None = None) -> None:
        """Register a request's captures (``max_tokens``: its sampling cap, which bounds the positions it can
        feed: its capture then ends with the step that samples its last token, ``_ends_at``)."""
        got = self._compile(capture)
        if got is not None:
            self._want(got[1].cols)
            self._add(request_id, got, prompt_len, meta, max_tokens)

    def _add(self, request_id: str, got: tuple, prompt_len: int, meta: dict | None, max_tokens: int | None) -> None:
        """Register a request whose capture field ``_compile`` gave ``got``."""
        if self._finished.get(request_id) == _EARLY:  # resumed after its capture ended: nothing more to take
            return
        specs, template, layout = got
        plan = object.__new__(RequestPlan)  # the template's fields (its arrays are never written), its own slots
        plan.__dict__ = dict(template.__dict__)
        new = _Request(prompt_len, specs, meta or {}, plan=plan)
        old = self._requests.get(request_id)
        if old is not None:  # added again (the V2 runner re-adds a resumed request): what was
            new.planned_upto, new.dropped = old.planned_upto, old.dropped  # planned stays planned, and its slots
            for f in ("red_bits", "red_mean", "red_slot", "red_mask", "red_slots", "red_layout"):  # stay its own
                setattr(new.plan, f, getattr(old.plan, f))
        elif layout is not None and self._reduce is not None:
            self._reserve(new, layout)
        self._requests[request_id] = new
        self._finished.pop(request_id, None)
        new.ends_at = _ends_at(specs.values(), prompt_len, max_tokens)
        if new.ends_at is not None:
            self._bounded.add(request_id)
        self._planner.forget_steady()

    def _compile(self, capture: dict | None) -> tuple | None:
        """A capture field's specs (consumer bit -> ``CaptureSpec`` of the consumers here), its ``RequestPlan``
        (a template: each request copies it) and its device-reduced consumers' slot layout (``_reserve``), or None
        when nothing is captured here. Cached per distinct field (by ``repr``, ``COMPILED_MAX`` of them): 16 requests
        with one spec parse and compile it once (~40 us a request before)."""
        key = repr(capture)
        got = self._compiled.get(key, self)
        if got is not self:
            return got
        specs = dict(self.global_specs)
        for instance, raw in (capture or {}).items():
            bit = self.bit_of.get(instance)
            if bit is not None:  # not on TP ranks > 0
                spec = parse_capture_spec(instance, raw, self.num_layers, self.hooks)
                if self._runs_here(bit, spec):
                    specs[bit] = spec
                else:  # its own spec replaces a global one, also where it has no site
                    specs.pop(bit, None)
        got = None
        if specs:
            plan = compile_request(specs, self.buffers.site_index)
            wanted = []
            for bit, cols in plan.bit_cols.items():  # the consumers with a site here
                cls = self._reducers.get(bit)
                mode = cls.device_reduce(specs[bit].params) if cls is not None else None
                if mode in MODES:
                    wanted.append((bit, mode == "mean", cols))
            layout = None
            if wanted:
                lens = [len(c) for _, _, c in wanted]
                ends = np.cumsum(lens).tolist()
                cols = np.concatenate([np.sort(c) for _, _, c in wanted])
                rows = np.repeat(np.arange(len(wanted)), lens)
                means = tuple(w[1] for w in wanted)
                layout = _SlotLayout(tuple(w[0] for w in wanted), means, sum(w[0] for w in wanted), rows, cols,
                                     tuple((w[0], e - n, e, w[1]) for w, n, e in zip(wanted, lens, ends)),
                                     tuple(self._planner.sites[c] for c in cols.tolist()), np.array(means)[rows])
            got = (specs, plan, layout)
        if len(self._compiled) >= COMPILED_MAX:
            del self._compiled[next(iter(self._compiled))]
        self._compiled[key] = got
        return got

    def _runs_here(self, bit: int, spec: CaptureSpec) -> bool:
        """Whether consumer ``bit`` hears of a request with ``spec`` on this stage: a worker consumer
        always, a driver where a site of the spec is (any site on a single stage; the front end counts
        the stages alike: ``frontend.prepare.SteeringFrontend.capture_expectation``)."""
        if self.stages == 1 or self.consumers[bit][1].location != "driver":
            return True
        return any(site in self.buffers.site_index for site in spec.sites)

    def _reserve(self, req: _Request, layout: _SlotLayout) -> None:
        """Hold accumulator slots for the request's device-reduced consumers (one per site on this rank;
        ``layout``: ``_compile``'s); too few free: they get rows step by step instead (``reduce_fallbacks``)."""
        slots = self._reduce.alloc(len(layout.rows))
        if slots is None:
            self._count("reduce_fallbacks")
            return
        table = np.full((len(layout.bits), len(self.buffers.site_index)), -1, np.int64)
        table[layout.rows, layout.cols] = slots
        plan = req.plan
        plan.red_bits, plan.red_mean, plan.red_slot, plan.red_mask = layout.bits, layout.means, table, layout.mask
        plan.red_slots, plan.red_layout = slots, layout
        self._count("reduced_requests")

    def finish_request(self, request_id: str, early: bool = False) -> None:
        self.finish_requests([request_id], early)

    def finish_requests(self, request_ids: list[str], early: bool = False) -> None:
        """The requests' ends (``early``: every position their specs want was planned, before the engine ends
        them): their consumers hear of them, their driver results go to the submitter once they have. The
        device-reduced rows of all of them are gathered in one device op and copied to the consumers' ring in one
        copy (a wave of requests ending together costs a step a few launches, not a few per request)."""
        if self._adds:
            self._register()
        ends, free = [], []
        for request_id in request_ids:
            req = self._requests.pop(request_id, None)
            self._bounded.discard(request_id)
            if req is None:
                continue
            self._planner.forget_steady()
            plan = req.plan
            held = plan.red_slots if plan.red_mask and self._reduce is not None else None
            plan.red_mask = 0  # it holds none after this: they are free again once their gather is enqueued
            if held is not None:
                free.append(held)
            if request_id in self._finished:
                continue
            self._finished[request_id] = _EARLY if early else None
            while len(self._finished) > RECENTLY_FINISHED_MAX:
                self._finished.popitem(last=False)
            ends.append((request_id, req, self._begin_finish(request_id, req), held))
        region = self._reduce
        reduced = [(k, held) for k, (*_, held) in enumerate(ends) if held is not None]
        parts_of: dict[int, dict[int, tuple]] = {}  # end -> bit -> its reduced rows (``CaptureHost.finish``)
        block = event = None
        if reduced:  # the slots counted anything: one gather, one copy for all the ends (``_reduced_parts``)
            slots = np.concatenate([held for _, held in reduced])
            counts, lasts = region.count[slots], region.last[slots]
            used = counts > 0
            n_used = int(used.sum())
            if n_used and self._host is not None and not self._host.dead:
                mean = np.concatenate([ends[k][1].plan.red_layout.mean for k, _ in reduced])
                rows = region.gather(slots[used], mean[used])
                staged = self._host.stage_reduced(rows, self._copy_stream)
                if staged is None:  # the ring is full: these reductions are lost, said in each consumer's meta
                    self._count("ring_full")
                    self._count("lost_rows", n_used)
                else:
                    event, block = staged
            if n_used:
                parts_of = self._reduced_parts(ends, reduced, counts.tolist(), lasts.tolist(), block)
        notices = []
        for k, (request_id, req, (key, meta, bits), _) in enumerate(ends):
            parts = parts_of.get(k, {})
            for b in bits:
                lane = self._lanes[b]
                if lane.finish_slots.acquire(blocking=False):
                    notices.append((lane, request_id, key, meta, req, parts.get(b)))
                    continue
                self._count("dropped_finishes")  # the lane is stuck: this request's end is not queued
                self._finished_by(key, b, lane.instance, {
                    "error": "dropped", "message": f"the consumer is stuck ({MAX_QUEUED_FINISHES} finished requests "
                                                   "undelivered): this request's capture was not delivered to it"})
        if notices:
            self._host.finish(notices, event)
        if block is not None:
            block.release()  # its notices hold it now
        if free:
            region.release(np.concatenate(free))

    @staticmethod
    def _reduced_parts(ends: list, reduced: list, counts: list, lasts: list, block: Any) -> dict[int, dict[int, tuple]]:
        """Per end and consumer bit, its slots that counted rows: ``(block, first gathered row, n, items)`` with per
        row ``(layer, hook, count, last position, mean)`` (the gather took the counted slots in ``reduced`` order), or
        ``("lost", rows)`` when they reached no ring block."""
        out: dict[int, dict[int, tuple]] = {}
        at = base = 0
        for k, held in reduced:
            layout, parts = ends[k][1].plan.red_layout, {}
            for bit, lo, hi, mean in layout.spans:
                items = [(site[1], site[0], c, last, mean) for site, c, last in
                         zip(layout.sites[lo:hi], counts[base + lo : base + hi], lasts[base + lo : base + hi]) if c > 0]
                if items:
                    parts[bit] = (block, at, len(items), items) if block is not None else ("lost", sum(i[2] for i in items))
                    at += len(items)
            base += len(held)
            if parts:
                out[k] = parts
        return out

    def _begin_finish(self, request_id: str, req: _Request) -> tuple[str, dict, list[int]]:
        """Count a finished request's lanes in its key's results (sent now if none is left): (key, finish meta,
        the bits of the lanes that hear of its end)."""
        key = req.meta.get("external_id") or request_id  # results go by the id callers know
        reply = req.meta.get("capture_reply")
        meta = {k: v for k, v in req.meta.items() if k != "capture_reply"}
        meta["prompt_len"] = req.prompt_len
        meta["stage"], meta["stages"] = self.stage, self.stages
        bits = [b for b in req.specs if b in self._lanes]  # only the consumers this request used hear of its end
        with self._results_lock:
            f = self._finishing.get(key)
            if f is None:
                f = self._finishing[key] = _Finishing({}, {}, reply)
            f.requests += 1
            for b in bits:
                f.left[b] = f.left.get(b, 0) + 1
                if self._lanes[b].driver:
                    f.instances[b] = self._lanes[b].instance
            done = None if f.left else self._finishing.pop(key)
        if done is not None:
            self._send(key, done.reply, done.requests, done.results)
        return key, meta, bits

    def _finished_by(self, key: str, bit: int, instance: str, out: Any) -> None:
        """A lane handled a finish packet (dispatch thread): the last one sends the results."""
        with self._results_lock:
            f = self._finishing.get(key)
            if f is None:
                return
            if out is not None and bit in f.instances:
                f.results[instance] = out
            f.left[bit] -= 1
            if f.left[bit] <= 0:
                del f.left[bit]
            final = not f.left
            if final:
                del self._finishing[key]
        if final:
            self._send(key, f.reply, f.requests, f.results)
        elif out is not None and bit in f.instances:  # others still at it: a stuck one cannot hold this
            self._send(key, f.reply, 0, {instance: out})

    def _send(self, key: str, reply: str | None, requests: int, results: dict) -> None:
        """Driver results of ``key`` to the submitter; ``requests``: the engine requests whose every
        lane on this worker is now done (0: a partial result, more to come)."""
        if reply is None:  # submitted without an inbox (a payload built elsewhere): nobody to tell
            return
        sent = self._pusher.push(reply, key, requests, results, self.stage)
        self._count("results_sent" if sent else "result_push_failed")

    @property
    def active(self) -> bool:
        return bool(self._requests) or bool(self._adds) or self._planner.dirty

    def launched(self) -> None:
        """The runner launched a step's forward: the notifier may go on with the earlier steps' packets."""
        if self._host is not None:
            self._host.launched()

    # ---- data plane: plan before the forward (or in an eager one), hand off after it ------
    def defer_step(self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray) -> None:
        """An eager step (no CUDA graph replays its forward): ``plan_step`` is left to the forward's first capturing
        op (``live.ready``), or to ``after_forward`` when no op captures on this rank."""
        if not self.in_forward:
            self.plan_step(req_ids, num_scheduled, num_computed)
            return
        self._deferred = (req_ids, np.array(num_scheduled), np.array(num_computed))
        live.deferred = self._plan_in_forward

    def _plan_in_forward(self) -> None:
        args, self._deferred = self._deferred, None
        if args is not None:
            self._count("plans_in_forward")
            self.plan_step(*args)

    def plan_step(self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray) -> None:
        """This step's pool rows and the device plan (``runtime.capture_plan``), on the stream its forward runs on,
        before the first capturing op: before the forward, or inside it (``defer_step``). A deferred plan still pending
        (its forward raised before any capturing op ran) is dropped: this step's plan replaces it."""
        self._deferred = live.deferred = None
        if self._adds:
            self._register()
        planner = self._planner
        step = planner.plan(self._requests, req_ids, num_scheduled, num_computed)
        if self._bounded:  # ended once the step's forward is handed off (after_forward)
            if planner.advanced and self._ends_in > 1:  # every request one position further: none ends yet
                self._ends_in -= 1
            else:
                reqs, bounded = self._requests, self._bounded
                left = {rid: reqs[rid].ends_at - reqs[rid].planned_upto for rid in req_ids if rid in bounded}
                self._complete = [rid for rid, n in left.items() if n <= 0]
                self._ends_in = min(left.values(), default=0)
        if step.recomputed:
            self.stats["recomputed_positions"] += step.recomputed
        if step.dropped_rows:
            self.stats["dropped_rows"] += step.dropped_rows
        if self._copy_stream is not None:
            self.before_forward(step.base, step.base + step.pool_rows)
        self._pending, self._rows_used = (step if step.request_ids else None), step.rows
        red = step.reduce
        if red is not None:
            self._reduce.account(red.acct_slots, red.acct_counts, red.last_slots, red.last_pos)
            if not len(red.mean_src) and not len(red.copy_src):  # nothing to add or copy after the forward
                red = None
        self._red_step = red
        live.capture_live = step.planned > 0
        if not self._requests and not planner.dirty and self._union.any():  # the plan is all -1 again
            self._reset_union()

    def after_forward(self, after: Any = None) -> None:
        """Hand the rows this step captured to the consumers' process (no device sync here), then end the
        requests whose capture this step completed: a prompt-only capture ends with its prefill, and one that
        wants generated tokens with the step that samples its ``max_tokens``-th token, not one or two engine
        steps after the request's last token (the finished id reaches the runner with a later step: under async
        scheduling two). The response waits for those results; a request that stops earlier (EOS, a stop
        string) is ended by the engine as before. Nothing planned this step (no request captures): nothing to do.
        When that left no request capturing, the device plan is cleared now (after the forward, on its stream), so a
        next step without captures is idle (``active`` False: no ``plan_step``). A deferred plan no op made (no
        capturing op on this rank) is made first. ``after``: an event the copies wait for besides the forward (the
        runner's own output copy: ``runtime.manager.with_after_sample``), only in a step that copies (an idle
        capture server's step calls nothing on the device here); kept as the consumers' reader's sign that the GPU
        still runs the step."""
        if after is not None and self._host is not None:
            self._host.step_event = after  # while it is pending the reader answers at once (``capture_lanes``)
        if self._deferred is not None:
            live.deferred, args, self._deferred = None, self._deferred, None
            self.plan_step(*args)
            if self._union.any() and self.in_forward:  # a wanted site here, yet no op of the forward made the plan
                self.in_forward = False
                logger.warning("capture: no capturing op ran in an eager step's forward (a CUDA graph replayed it?): "
                               "its rows were not captured; capture plans are made before the forward from now on")
        if after is not None and self._copy_stream is not None and (self._pending is not None or self._complete):
            self._copy_stream.wait_event(after)  # the rows' and the finished requests' reduced rows' copies
        if self._pending is not None or self._red_step is not None:
            self._hand_off()
        if self._complete:
            done, self._complete = self._complete, []
            self.finish_requests(done, early=True)
            if not self._requests:
                self._planner.clear()
                self._reset_union()

    def _hand_off(self) -> None:
        """Hand the rows this step captured to the consumers' process (no device sync here).

        The used pool rows are copied into the host's shared ring (on a GPU on a side stream that
        waits for the forward; a later step's compute waits for the copy only if its capture op overwrites
        those rows: ``before_forward``); the host's notifier thread waits for the copy before telling it. Device-reduced
        consumers' rows are added / copied into their slots first (``runtime.capture_reduce``)."""
        red = self._red_step
        if red is not None:
            self._red_step = None
            self._reduce.apply(red.mean_src, red.mean_len, red.mean_slot, red.copy_src, red.copy_dst)
        step = self._pending
        if step is None:
            return
        host = self._host
        if host is None or host.dead:  # capture disabled: the finishes answer consumer_died
            self._pending = None
            return
        wanted = int(np.bitwise_or.reduce(step.run_mask))
        lanes = []
        for bit, lane in self._lanes.items():
            if not wanted & bit:
                continue
            if lane.row_slots.acquire(blocking=False):
                lanes.append(lane)
                continue
            self._count("dropped_packets")  # 256 packets undelivered in this lane: drop its rows
            self._drop_pending(bit)
        if not lanes:
            self._pending = None
            return
        n, base = self._rows_used, step.base
        sent = host.send_rows(self.buffers.pool[base : base + n], step.wire(), lanes, self._copy_stream)
        if sent is None:  # the ring is full (the host is behind): drop for every lane, never wait
            self._count("ring_full")
            for lane in lanes:
                lane.row_slots.release()
                self._count("dropped_packets")
                self._drop_pending(lane.bit)
        else:
            self._count("rows", n)
            if sent is not True:
                self._copies.append((base, base + n, sent))
                if len(self._copies) > MAX_TRACKED_COPIES:  # the two oldest as one: waiting on the newer covers both
                    (a0, a1, _), (b0, b1, ev) = self._copies[:2]
                    self._copies[:2] = [(min(a0, b0), max(a1, b1), ev)]
        self._pending = None

    def _drop_pending(self, bit: int) -> None:
        """This step's rows are not delivered to consumer ``bit``: record them for its finish meta, count them."""
        lost = 0
        for rid, layer, hook, positions, _, masks in self._pending.entries():
            req = self._requests.get(rid)
            mine = (masks & bit) != 0
            lost += int(mine.sum())
            if req is not None and mine.any():
                req.drop(hook, layer, positions[mine], masks[mine] & bit)
        self._count("lost_rows", lost)

    def before_forward(self, lo: int, hi: int) -> None:
        """The forward writes pool rows ``lo .. hi`` (this step's): it waits (on the device) for the newest copy
        to the host that reads any of them, and so for every older copy too (one copy stream runs them in order);
        copies of other rows go on beside it. With the pool a ring (``CapturePlanner._place``) that is the copy of a
        step that many steps back, not the last step's: a prefill step's ~5 ms D2H of 268 MB (8192 tokens x 4
        sites x 8 KB) overlaps the next forward instead of delaying it."""
        copies = self._copies
        hit = next((i for i in range(len(copies) - 1, -1, -1) if copies[i][0] < hi and lo < copies[i][1]), None)
        if hit is not None and lo < hi:
            current_stream(self.buffers.pool.device).wait_event(copies[hit][2])
            del copies[: hit + 1]

    # ---- results ----------------------------------------------------------------------
    def publish(self, request_ids: list[str]) -> int:
        """End the given requests (engine or external ids) the runner has not yet heard finished
        (their results are then sent as usual); how many there were. The caller knows they are done."""
        self._count("publish_calls")
        if self._adds:
            self._register()
        wanted = set(request_ids)
        ended = [rid for rid, req in list(self._requests.items())
                 if rid in wanted or req.meta.get("external_id") in wanted]
        self.finish_requests(ended)
        return len(ended)
