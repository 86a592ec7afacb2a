"""Worker-side capture: per-step plans, the device pool, and the dispatch thread to consumers.

Per step (host, only while some request captures): for each capturing request of the batch, the
positions each consumer wants at each (hook, layer) site become pool rows; rows wanted by several
consumers are gathered once and carry a bitmask of them. The plan (token -> pool row, per site)
goes to the device in one non-blocking copy; the capture op fills the pool inside the forward.
After the forward, the used rows are copied to host (non-blocking, then an event) and handed to
the dispatch threads, one per consumer (a "lane": its own queue and thread, so a slow consumer
delays only itself), which wait on the event and call their consumer. A step's host buffer is
shared by the lanes it went to and goes back to the pinned pool when the last one is done with
it. A raising consumer is counted; nothing stalls or kills the engine.

Results of driver consumers (``collect_results``, reached by ``vllm_steer_capture_collect``) never
wait: a call publishes the given requests (if the runner has not yet) and answers at once with the
ids every consumer of the request has finished (``done``, with the driver results) and the others
(``pending``, with the driver instances still running). The API server and ``capture.collect``
poll it. Finished results nobody collects are evicted: at most ``RESULTS_MAX`` are kept, none
longer than ``results_ttl(cfg)`` (twice ``steer.capture_result_timeout_s``, at least 60 s).

Each position of a request is planned once: a preempted request recomputes its prompt and
generated tokens from position 0 (or from its cached prefix) when it resumes, and positions below
the request's mark (``planned_upto``) were planned already, so they are skipped (counted in
``stats["recomputed_positions"]``). Only positions the engine computes are captured: prefix-cache
hits are never computed (the front end turns cache reads off for captures that need the prompt).

Parallelism: TP ranks see the same residual, so only TP rank 0 of each pipeline stage captures (its
stage's sites: worker consumers there get each site once); driver consumers run on the first stage
only, in every data-parallel engine.

Exhaustion policy: never block the step, drop and count, tell the consumer. A step that wants more
rows than the pool holds (``steer.capture_max_rows``) keeps the first rows in batch order and
drops the rest (``stats["dropped_rows"]``); a rows packet that finds 256 packets still undelivered
in a consumer's lane is dropped for that consumer (``stats["dropped_packets"]``, once per lane). Either way the positions are recorded per request, site
and consumer, and the request's finish meta names them (``dropped``, ``dropped_rows``; see
``vllm_steer.capture.consumer``). A finish packet that finds ``MAX_QUEUED_FINISHES`` still undelivered in
a lane (its consumer is stuck: a hung call holds the lane) is not queued: the consumer never hears of
that request, a driver consumer's result is ``{"error": "dropped", ...}`` at once, and
``stats["dropped_finishes"]`` counts it. So a hung consumer holds at most that many requests' state.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_steer.capture.consumer import consumer_class
from vllm_steer.capture.spec import CaptureSpec, parse_capture_spec
from vllm_steer.core.config import SteerConfig
from vllm_steer.kernels.capture_rows import live

logger = logging.getLogger("vllm.steer.capture")


class CaptureBuffers:
    """Device pool ``[max_rows, D]`` and per-site plans ``[n_sites, max_tokens]`` (int32, -1 = none)."""

    def __init__(self, sites: list[tuple[str, int]], max_rows: int, max_tokens: int, hidden: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.site_index = {s: i for i, s in enumerate(sites)}
        self.pool = torch.zeros(max_rows, hidden, dtype=dtype, device=device)
        width = -(-max_tokens // 4) * 4  # each site's row starts on 16 bytes (see runtime.tables)
        self.plan = torch.full((len(sites), width), -1, dtype=torch.int32, device=device)
        self.plan_host = np.full((len(sites), width), -1, dtype=np.int32)
        self.max_rows = max_rows

    def plan_view(self, hook: str, layer: int) -> torch.Tensor:
        return self.plan[self.site_index[(hook, layer)]]


@dataclass
class _Request:
    prompt_len: int
    specs: dict[int, CaptureSpec]  # consumer bit -> spec
    meta: dict[str, Any] = field(default_factory=dict)
    planned_upto: int = 0  # positions below it were planned (captured or dropped) once already
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
MAX_QUEUED_FINISHES = 4096  # per consumer lane: past it the consumer is stuck, its finishes are dropped
RESULTS_MAX = 4096  # finished requests' results (and recently finished ids) kept for collection


def results_ttl(cfg: SteerConfig) -> float:
    """How long a finished request's results wait to be collected before they are evicted."""
    return max(60.0, 2 * cfg.capture_result_timeout_s)


@dataclass
class _Entry:
    request_id: str
    layer: int
    hook: str
    positions: np.ndarray
    row0: int
    masks: np.ndarray  # consumer bitmask per row


class _Packet:
    """One step's captured rows, shared by the lanes of the consumers that want some of them."""

    def __init__(self, event: Any, host: torch.Tensor, entries: list[_Entry], refs: int) -> None:
        self.event, self.host, self.entries, self.refs = event, host, entries, refs
        self._lock = threading.Lock()
        self._data: np.ndarray | None = None

    def data(self) -> np.ndarray:
        with self._lock:
            if self._data is None:
                if self.event is not None:
                    self.event.synchronize()
                host = self.host
                self._data = (host.float() if host.dtype == torch.bfloat16 else host).numpy()
            return self._data

    def release(self) -> bool:
        """One lane is done with it; True for the last one (the host buffer can go back)."""
        with self._lock:
            self.refs -= 1
            return self.refs == 0


@dataclass
class _Finishing:
    """A finished request whose finish packets are not yet handled by every consumer lane."""

    left: dict[int, int]  # consumer bit -> finish packets not yet handled (n>1: children share a key)
    instances: dict[int, str]  # bit -> instance of driver consumers
    results: dict[str, Any] = field(default_factory=dict)


class _Lane:
    """One consumer's queue and dispatch thread."""

    def __init__(self, rt: "CaptureRuntime", bit: int, instance: str, consumer: Any) -> None:
        self.rt, self.bit, self.instance, self.consumer = rt, bit, instance, consumer
        self.driver = getattr(consumer, "location", None) == "driver"
        # Every packet takes a slot of its kind first (never blocking: no slot, the packet is dropped).
        self.queue: queue.Queue = queue.Queue()
        self.row_slots = threading.Semaphore(MAX_QUEUED_ROW_PACKETS)
        self.finish_slots = threading.Semaphore(MAX_QUEUED_FINISHES)
        self.thread = threading.Thread(target=self._loop, name=f"vllm-steer-capture-{instance}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        rt = self.rt
        while True:
            packet = self.queue.get()
            try:
                if packet[0] == "rows":
                    self._rows(packet[1])
                else:
                    self._finish(*packet[1:])
            except Exception:  # never let a consumer take the engine down
                rt._count("consumer_errors")
                logger.exception("vllm-steer: capture dispatch to %s failed", self.instance)
            finally:
                if packet[0] == "rows":
                    self.row_slots.release()
                    if packet[1].release():
                        rt._give_back(packet[1].host)  # consumers got copies (boolean-mask indexing)
                else:
                    self.finish_slots.release()
                self.queue.task_done()

    def _rows(self, packet: _Packet) -> None:
        data = None
        for e in packet.entries:
            take = (e.masks & self.bit) != 0
            if not take.any():
                continue
            if data is None:
                data = packet.data()
            block = data[e.row0 : e.row0 + len(e.positions)]
            try:
                self.consumer.on_rows(e.request_id, e.layer, e.hook, e.positions[take], block[take], {})
            except Exception:
                self.rt._count("consumer_errors")
                logger.exception("vllm-steer: capture consumer %s raised in on_rows", self.instance)

    def _finish(self, request_id: str, key: str, meta: dict, req: _Request) -> None:
        out = None
        try:
            dropped = req.dropped_for(self.bit) if req.dropped else {}
            spec = req.specs.get(self.bit)
            out = self.consumer.on_request_finished(
                request_id, {**meta, "params": dict(spec.params) if spec is not None else {},
                             "dropped": dropped, "dropped_rows": sum(map(len, dropped.values()))})
        except Exception:
            self.rt._count("consumer_errors")
            logger.exception("vllm-steer: capture consumer %s raised in on_request_finished", self.instance)
        finally:
            self.rt._finished_by(key, self.bit, self.instance, out)


class CaptureRuntime:
    def __init__(self, cfg: SteerConfig, sites: list[tuple[str, int]], num_layers: int, max_tokens: int,
                 hidden: int, dtype: torch.dtype, device: torch.device, tp_rank: int = 0,
                 pp_rank: int = 0) -> None:
        self.buffers = CaptureBuffers(sites, cfg.capture_max_rows, max_tokens, hidden, dtype, device)
        self.num_layers = num_layers
        self.hooks = tuple(cfg.hooks)
        self.consumers: dict[int, tuple[str, Any]] = {}  # bit -> (instance, consumer)
        self.bit_of: dict[str, int] = {}
        self.global_specs: dict[int, CaptureSpec] = {}
        self._lanes: dict[int, _Lane] = {}
        self.stats = {"rows": 0, "dropped_rows": 0, "dropped_packets": 0, "dropped_finishes": 0,
                      "consumer_errors": 0, "recomputed_positions": 0}
        self._stats_lock = threading.Lock()  # lanes count errors from their threads
        for i, c in enumerate(cfg.capture):
            cls = consumer_class(c.name)
            # TP ranks hold the same residual: TP rank 0 of each stage captures its stage's sites;
            # the one driver instance lives on the first stage (the front end keeps specs to its sites)
            if tp_rank != 0 or (cls.location == "driver" and pp_rank != 0):
                continue
            consumer = cls(c.instance_name, **c.params)
            bit = 1 << i
            self.consumers[bit] = (c.instance_name, consumer)
            self.bit_of[c.instance_name] = bit
            if getattr(consumer, "global_spec", None):
                self.global_specs[bit] = parse_capture_spec(c.instance_name, consumer.global_spec, num_layers, self.hooks)
            self._lanes[bit] = _Lane(self, bit, c.instance_name, consumer)
        self._requests: dict[str, _Request] = {}
        self._plan_dirty: list[int] = []  # site rows of plan_host set last step
        self._pending: list[_Entry] = []
        self._rows_used = 0
        self.results_ttl = results_ttl(cfg)
        self._results_lock = threading.Lock()
        self._finishing: dict[str, _Finishing] = {}  # key (external id or engine id) -> lanes still at it
        self._done: OrderedDict[str, tuple[float, dict]] = OrderedDict()  # key -> (finished at, results)
        self._finished: OrderedDict[str, None] = OrderedDict()  # recently finished engine ids (bounded)
        self._pinned_free: dict[int, list[torch.Tensor]] = {}
        self._pinned_lock = threading.Lock()
        self._copy_done: Any = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _count(self, stat: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[stat] += n

    # ---- control plane -----------------------------------------------------------------
    def add_request(self, request_id: str, capture: dict | None, prompt_len: int, meta: dict | None = None) -> None:
        specs = dict(self.global_specs)
        for instance, raw in (capture or {}).items():
            bit = self.bit_of.get(instance)
            if bit is not None:  # not on TP ranks > 0; a driver instance on the first stage only
                specs[bit] = parse_capture_spec(instance, raw, self.num_layers, self.hooks)
        if specs:
            new = _Request(prompt_len, specs, meta or {})
            old = self._requests.get(request_id)
            if old is not None:  # added again (the V2 runner re-adds a resumed request): what was
                new.planned_upto, new.dropped = old.planned_upto, old.dropped  # planned stays planned
            self._requests[request_id] = new
            self._finished.pop(request_id, None)

    def finish_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None or request_id in self._finished:
            return
        self._finished[request_id] = None
        while len(self._finished) > RESULTS_MAX:
            self._finished.popitem(last=False)
        key = req.meta.get("external_id") or request_id  # results go by the id callers know
        meta = {**req.meta, "prompt_len": req.prompt_len}
        bits = [b for b in req.specs if b in self._lanes]  # only the consumers this request used hear of its end
        with self._results_lock:
            f = self._finishing.get(key)
            if f is None:
                f = self._finishing[key] = _Finishing({}, {})
            for b in bits:
                f.left[b] = f.left.get(b, 0) + 1
                if self._lanes[b].driver:
                    f.instances[b] = self._lanes[b].instance
            if not f.left:
                del self._finishing[key]
        for b in bits:
            lane = self._lanes[b]
            if lane.finish_slots.acquire(blocking=False):
                lane.queue.put(("finish", request_id, key, meta, req))
                continue
            self._count("dropped_finishes")  # the lane is stuck: this request's end is not queued
            self._finished_by(key, b, lane.instance, {
                "error": "dropped", "message": f"the consumer is stuck ({MAX_QUEUED_FINISHES} finished requests "
                                               "undelivered): this request's capture was not delivered to it"})

    def _finished_by(self, key: str, bit: int, instance: str, out: Any) -> None:
        """A lane handled a finish packet (dispatch thread)."""
        with self._results_lock:
            f = self._finishing.get(key)
            if f is None:
                return
            if out is not None and bit in f.instances:
                f.results[instance] = out
            f.left[bit] -= 1
            if f.left[bit] <= 0:
                del f.left[bit]
            if not f.left:
                del self._finishing[key]
                self._done[key] = (time.monotonic(), f.results)
                self._done.move_to_end(key)
                self._evict()

    def _evict(self) -> None:
        """Results nobody collected: keep at most RESULTS_MAX, none older than the TTL (lock held)."""
        cutoff = time.monotonic() - self.results_ttl
        while self._done and (len(self._done) > RESULTS_MAX or next(iter(self._done.values()))[0] < cutoff):
            self._done.popitem(last=False)

    @property
    def active(self) -> bool:
        return bool(self._requests) or bool(self._plan_dirty)

    # ---- data plane: plan before the forward, hand off after it --------------------------
    def plan_step(self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray) -> None:
        host, bufs = self.buffers.plan_host, self.buffers
        for s in self._plan_dirty:
            host[s, :] = -1
        dirty: list[int] = []
        entries: list[_Entry] = []
        row = 0
        offset = 0
        for i, rid in enumerate(req_ids):
            n = int(num_scheduled[i])
            req = self._requests.get(rid)
            if req is not None and n:
                first = int(num_computed[i])
                # Recomputed after a preemption: positions below the mark were planned once already.
                skip = min(max(req.planned_upto - first, 0), n)
                req.planned_upto = max(req.planned_upto, first + n)
                self.stats["recomputed_positions"] += skip
                positions = first + np.arange(skip, n)
                per_site: dict[tuple[str, int], np.ndarray] = {}
                for bit, spec in req.specs.items():
                    sel = spec.select(positions, req.prompt_len)
                    if not sel.any():
                        continue
                    for site in spec.sites:
                        if site in bufs.site_index:  # a site this rank hooks
                            m = per_site.setdefault(site, np.zeros(n - skip, dtype=np.int64))
                            m[sel] |= bit
                for (hook, layer), masks in per_site.items():
                    toks = np.flatnonzero(masks)
                    k = min(len(toks), bufs.max_rows - row)
                    if k < len(toks):  # the pool is full: drop (never wait), count, and tell the consumer
                        self.stats["dropped_rows"] += len(toks) - k
                        req.drop(hook, layer, positions[toks[k:]], masks[toks[k:]])
                    if k == 0:
                        continue
                    s = bufs.site_index[(hook, layer)]
                    host[s, offset + skip + toks[:k]] = np.arange(row, row + k, dtype=np.int32)
                    dirty.append(s)
                    entries.append(_Entry(rid, layer, hook, positions[toks[:k]], row, masks[toks[:k]]))
                    row += k
            offset += n
        if bufs.plan.is_cuda:
            self.before_forward()
        if dirty or self._plan_dirty:
            src = torch.from_numpy(host)
            if bufs.plan.is_cuda:
                src = src.pin_memory()
            bufs.plan.copy_(src, non_blocking=True)
        self._plan_dirty = sorted(set(dirty))
        self._pending, self._rows_used = entries, row
        live.capture_live = bool(entries)

    def after_forward(self) -> None:
        """Hand the rows this step captured to the consumers' lanes (no device sync here).

        On a GPU the copy runs on a side stream into a leased pinned buffer: the side stream waits
        for the forward (an event), the next step's compute waits for the copy (an event) before
        its capture op overwrites the pool, and the lanes wait for the copy's event."""
        if not self._pending:
            return
        wanted = 0
        for e in self._pending:
            wanted |= int(np.bitwise_or.reduce(e.masks))
        lanes = []
        for bit, lane in self._lanes.items():
            if not wanted & bit:
                continue
            if lane.row_slots.acquire(blocking=False):
                lanes.append(lane)
                continue
            self._count("dropped_packets")  # 256 packets undelivered in this lane: drop its rows
            for e in self._pending:
                req = self._requests.get(e.request_id)
                mine = (e.masks & bit) != 0
                if req is not None and mine.any():
                    req.drop(e.hook, e.layer, e.positions[mine], e.masks[mine] & bit)
        if not lanes:
            self._pending = []
            return
        n = self._rows_used
        rows = self.buffers.pool[:n]
        event = None
        if rows.is_cuda:
            forward_done = torch.cuda.Event()
            forward_done.record()
            host = self._lease(n)
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(forward_done)
                host[:n].copy_(rows, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._copy_done = event
        else:
            host = rows.clone()
        self._count("rows", n)
        packet = _Packet(event, host, self._pending, len(lanes))
        for lane in lanes:
            lane.queue.put(("rows", packet))
        self._pending = []

    def before_forward(self) -> None:
        """The forward may overwrite the pool only once the last copy out of it is done (GPU-side wait)."""
        if self._copy_done is not None:
            torch.cuda.current_stream().wait_event(self._copy_done)
            self._copy_done = None

    def _lease(self, n: int) -> torch.Tensor:
        """A pinned host buffer of at least ``n`` rows, sized in 16-row steps, reused after delivery."""
        cap = -(-n // 16) * 16
        with self._pinned_lock:
            free = self._pinned_free.get(cap)
            if free:
                return free.pop()
        pool = self.buffers.pool
        return torch.empty(cap, pool.shape[1], dtype=pool.dtype, pin_memory=True)

    def _give_back(self, host: torch.Tensor) -> None:
        if host.is_pinned():
            with self._pinned_lock:
                self._pinned_free.setdefault(host.shape[0], []).append(host)

    # ---- results ----------------------------------------------------------------------
    def collect_results(self, request_ids: list[str]) -> dict[str, Any]:
        """Never waits. Publish the given requests (the caller knows they are done) if the runner
        has not yet, and answer by the ids given (engine or external): ``{"done": {id: driver
        results}, "pending": {id: {"waiting": [driver instances not yet finished], "results":
        {those that have}}}}``. An id this worker has no capture state for (never had, or already
        collected) is done with no results; done results are handed over once."""
        wanted = set(request_ids)
        for rid, req in list(self._requests.items()):
            if rid in wanted or req.meta.get("external_id") in wanted:
                self.finish_request(rid)
        done: dict[str, dict] = {}
        pending: dict[str, dict] = {}
        with self._results_lock:
            self._evict()
            for rid in request_ids:
                f = self._finishing.get(rid)
                if f is not None:
                    pending[rid] = {"waiting": sorted(f.instances[b] for b in f.left if b in f.instances),
                                    "results": dict(f.results)}
                elif rid in self._done:
                    done[rid] = self._done.pop(rid)[1]
                else:
                    done[rid] = {}
        return {"done": done, "pending": pending}
