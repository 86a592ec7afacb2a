"""Worker-side capture: per-step plans, the device pool, and the dispatch thread to consumers.

Per step (host, only while some request captures): for each capturing request of the batch, the
positions each consumer wants at each (hook, layer) site become pool rows; rows wanted by several
consumers are gathered once and carry a bitmask of them. The plan (token -> pool row, per site)
goes to the device in one non-blocking copy; the capture op fills the pool inside the forward.
After the forward, the used rows are copied to host (non-blocking, then an event) and handed to
a dispatch thread that waits on the event and calls consumers. A raising consumer is counted;
nothing stalls or kills the engine.

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
is dropped (``stats["dropped_packets"]``). Either way the positions are recorded per request, site
and consumer, and the request's finish meta names them (``dropped``, ``dropped_rows``; see
``vllm_steer.capture.consumer``). Finish packets are never dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
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


MAX_QUEUED_ROW_PACKETS = 256


@dataclass
class _Entry:
    request_id: str
    layer: int
    hook: str
    positions: np.ndarray
    row0: int
    masks: np.ndarray  # consumer bitmask per row


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
        self._requests: dict[str, _Request] = {}
        self._plan_dirty: list[int] = []  # site rows of plan_host set last step
        self._pending: list[_Entry] = []
        self._rows_used = 0
        self.stats = {"rows": 0, "dropped_rows": 0, "dropped_packets": 0, "consumer_errors": 0,
                      "recomputed_positions": 0}
        self.results: dict[str, dict[str, Any]] = {}
        self._finished: set[str] = set()
        # Unbounded: finish packets (one per request) always go in; rows packets take a slot first.
        self._queue: queue.Queue = queue.Queue()
        self._row_slots = threading.Semaphore(MAX_QUEUED_ROW_PACKETS)
        self._pinned_free: dict[int, list[torch.Tensor]] = {}
        self._pinned_lock = threading.Lock()
        self._copy_done: Any = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._dispatch_loop, name="vllm-steer-capture", daemon=True)
        self._thread.start()

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
            self._finished.discard(request_id)

    def finish_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and request_id not in self._finished:
            self._finished.add(request_id)
            bits = sum(req.specs)  # only the consumers this request used hear of its end
            self._queue.put(("finish", request_id, {**req.meta, "prompt_len": req.prompt_len}, bits, req))

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
                    for hook in spec.hooks:
                        for layer in spec.layers:
                            if (hook, layer) in bufs.site_index:
                                m = per_site.setdefault((hook, layer), np.zeros(n - skip, dtype=np.int64))
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
        """Hand the rows this step captured to the dispatch thread (no device sync here).

        On a GPU the copy runs on a side stream into a leased pinned buffer: the side stream waits
        for the forward (an event), the next step's compute waits for the copy (an event) before
        its capture op overwrites the pool, and the dispatch thread waits for the copy's event."""
        if not self._pending:
            return
        if not self._row_slots.acquire(blocking=False):  # 256 packets undelivered: drop this one
            self.stats["dropped_packets"] += 1
            for e in self._pending:
                req = self._requests.get(e.request_id)
                if req is not None:
                    req.drop(e.hook, e.layer, e.positions, e.masks)
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
        self.stats["rows"] += n
        self._queue.put(("rows", event, host, self._pending))
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

    # ---- dispatch thread ---------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while True:
            packet = self._queue.get()
            try:
                if packet[0] == "rows":
                    self._deliver_rows(*packet[1:])
                else:
                    self._deliver_finish(*packet[1:])
            except Exception:  # never let a consumer take the engine down
                self.stats["consumer_errors"] += 1
                logger.exception("vllm-steer: capture dispatch failed")
            finally:
                if packet[0] == "rows":
                    self._row_slots.release()
                self._queue.task_done()

    def _deliver_rows(self, event: Any, host: torch.Tensor, entries: list[_Entry]) -> None:
        if event is not None:
            event.synchronize()
        try:
            self._deliver_rows_synced(host, entries)
        finally:
            self._give_back(host)  # consumers got copies (boolean-mask indexing)

    def _deliver_rows_synced(self, host: torch.Tensor, entries: list[_Entry]) -> None:
        data = (host.float() if host.dtype == torch.bfloat16 else host).numpy()
        for e in entries:
            block = data[e.row0 : e.row0 + len(e.positions)]
            for bit, (instance, consumer) in self.consumers.items():
                take = (e.masks & bit) != 0
                if not take.any():
                    continue
                try:
                    consumer.on_rows(e.request_id, e.layer, e.hook, e.positions[take], block[take], {})
                except Exception:
                    self.stats["consumer_errors"] += 1
                    logger.exception("vllm-steer: capture consumer %s raised in on_rows", instance)

    def _deliver_finish(self, request_id: str, meta: dict, bits: int, req: _Request) -> None:
        results = {}
        for bit, (instance, consumer) in self.consumers.items():
            if not bits & bit:
                continue
            dropped = req.dropped_for(bit) if req.dropped else {}
            try:
                out = consumer.on_request_finished(
                    request_id, {**meta, "dropped": dropped, "dropped_rows": sum(map(len, dropped.values()))})
            except Exception:
                self.stats["consumer_errors"] += 1
                logger.exception("vllm-steer: capture consumer %s raised in on_request_finished", instance)
                continue
            if out is not None:
                results[instance] = out
        if results:  # keyed by the id callers know (vLLM suffixes the external id internally)
            self.results[meta.get("external_id") or request_id] = results

    def collect_results(self, request_ids: list[str], timeout: float = 30.0) -> dict[str, dict]:
        """Finish (publish) the given requests, which the caller knows are done, wait until every
        consumer has seen them, and return driver results by the ids given (engine or external)."""
        wanted = set(request_ids)
        for rid, req in list(self._requests.items()):
            if rid in wanted or req.meta.get("external_id") in wanted:
                self.finish_request(rid)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True)
        waiter.start()
        done.wait(timeout)
        return {rid: self.results.pop(rid) for rid in request_ids if rid in self.results}
