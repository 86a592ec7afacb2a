"""The worker's steering runtime: request rows in, a token -> row index out, every step.

Control work happens when requests arrive or leave (row acquire/release, table writes). The
per-step work, skipped entirely (one attribute check) while no steered token is, or was last step,
in the batch: with vLLM's V2 runner one launch of the ``step_index`` kernel, which reads each
request's rows from a per-slot device table (``slot_rows``) and the request boundaries vLLM already
has on the device (``index_on_device``); with the V1 runner (the CPU lane) one host ``np.repeat``
over the batch and one copy of the index from a pinned ring (``prepare_step``). No device sync.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from vllm_steer.core import gc_watch
from vllm_steer.core.config import SteerConfig, steer_config_of
from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.layout import layout_key, table_layout
from vllm_steer.core.layout import Layout
from vllm_steer.core.payload import SteerPayload, dtype_name, payload_from_extra
from vllm_steer.core.sae_catalog import sae_catalog, slot_sites
from vllm_steer.core.sae_paths import runtime_access
from vllm_steer.kernels.capture_rows import live
from vllm_steer.kernels.step_index.op import step_index
from vllm_steer.runtime import allreduce_fusion
from vllm_steer.runtime.capture import CaptureRuntime
from vllm_steer.runtime.condition_tables import ConditionTables
from vllm_steer.runtime.install import install_steering, norm_sites, num_decoder_layers, site_gains
from vllm_steer.runtime.modules import WorkerModules
from vllm_steer.runtime.pinned_ring import PinnedRing
from vllm_steer.runtime.projection_tables import ProjectionTables, dirs_dtype
from vllm_steer.runtime.rows import RowAllocator
from vllm_steer.runtime.sae_tables import SaeTables
from vllm_steer.runtime.slot_rows import SlotRows
from vllm_steer.runtime.stop_watch import StopWatch
from vllm_steer.runtime.tables import SteeringTables

# an eager step's capture plan is made by its first capturing op (CaptureRuntime.defer_step); "0": before the forward
PLAN_IN_FORWARD = os.environ.get("VLLM_STEER_CAPTURE_IN_FORWARD", "1") != "0"
logger = logging.getLogger("vllm.steer")


@dataclass
class _Held:
    rows: tuple[int, int]  # (prefill row, decode row); 0 = unsteered phase
    keys: tuple[str, ...]


def wanted_sites(cfg: SteerConfig, num_layers: int) -> set[tuple[str, int]]:
    """Every (hook, layer) the config asks for, whichever rank's norm receives it."""
    layers = [i for i in range(num_layers) if cfg.layers is None or i in cfg.layers]
    return {(h, l) for h in cfg.hooks for l in layers}


def hooked_layers_of(sites: list) -> dict[str, list[int]]:
    """{hook: sorted layers} of the sites folded into this rank's norms, in hook order."""
    found = {(w[0], w[1]) for s in sites for w in (s.a, s.b) if w is not None}
    out = {h: sorted(l for hh, l in found if hh == h) for h in HOOK_NAMES}
    return {h: ls for h, ls in out.items() if ls}


class SteeringRuntime:
    def __init__(
        self,
        cfg: SteerConfig,
        model: nn.Module,
        hidden_size: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_reqs: int = 1024,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.hidden_size = hidden_size
        self._dtype_name = dtype_name(dtype)
        sites = norm_sites(model, wanted_sites(cfg, num_decoder_layers(model)))
        self.hooked_layers = hooked_layers_of(sites)
        self.tables = SteeringTables(
            self.hooked_layers, cfg.max_configs, hidden_size, max_num_tokens, dtype, device
        )
        self.rows = RowAllocator(cfg.max_configs)
        self.modules = WorkerModules()
        self.capture: CaptureRuntime | None = None
        flat = [(h, l) for h, ls in self.hooked_layers.items() for l in ls]
        if cfg.capture:
            self.capture = CaptureRuntime(cfg, flat, num_decoder_layers(model), max_num_tokens,
                                          hidden_size, dtype, device, *_capture_ranks())
        catalog = sae_catalog(cfg, hidden_size, num_decoder_layers(model))
        slots = slot_sites(cfg, num_decoder_layers(model))
        self.sae = (SaeTables(catalog, slots, set(flat), cfg.max_configs, hidden_size, device,
                              runtime_access(cfg.sae_root, cfg.max_sae_bytes), site_gains(sites))
                    if catalog or slots else None)
        self.conditions = (ConditionTables(cfg.max_configs, hidden_size, max_num_tokens, device)
                           if cfg.conditions else None)
        self.stops = StopWatch(self.conditions.gate, max_num_reqs) if self.conditions is not None else None
        self.projections = (ProjectionTables(set(flat), cfg.max_configs, cfg.max_projections, hidden_size, device,
                                             dirs_dtype(dtype))
                            if cfg.max_projections > 0 else None)
        self.num_ops = install_steering(sites, self.tables, self.capture.buffers if self.capture else None, self.sae,
                                        self.conditions, self.projections)
        self.steered_norms = [s.name for s in sites]
        self.norm_modes = [s.mode for s in sites]  # runtime.families' layout of each (runtime.allreduce_fusion reads it)
        self._held: dict[str, _Held] = {}
        self.peak_live_configs = 0  # most configs live at once since start (capacity is strict)
        self.preemptions_seen = 0  # requests the scheduler preempted (their steering must survive)
        self.row_uploads = 0  # configs written into the tables (a resident row is reused, not rewritten)
        self.row_upload_bytes = 0  # bytes those writes copied into the vector tables
        self._index_extent = 0  # tokens of the device index that may hold non-zero rows
        self._index_ring = PinnedRing((max_num_tokens,), torch.int32, device)
        logger.info(
            "vllm-steer: %d steering sites folded into %d norms (hooks %s, %d rows)",
            self.num_ops, len(sites), list(self.hooked_layers), cfg.max_configs,
        )

    @property
    def any_steered(self) -> bool:
        return bool(self._held)

    @property
    def step_work(self) -> bool:
        """Whether ``prepare_step`` has anything to do (a steered request, or an index to clear)."""
        return bool(self._held) or self._index_extent > 0

    # ---- control plane: requests come and go -------------------------------------------
    def add_request(self, req_id: str, extra_args: dict | None, prompt_len: int = 0,
                    max_tokens: int | None = None) -> tuple[int, int]:
        """Acquire (and if needed write) the rows of a request; returns (prefill row, decode row).
        ``max_tokens``: the request's sampling cap (its capture ends with its last token's step)."""
        steering = payload_from_extra(extra_args)  # the scheduler refused any that do not decode
        if self.capture is not None:
            meta = {"external_id": steering.external_id, "capture_reply": steering.capture_reply} \
                if steering is not None else {}
            self.capture.add_later(req_id, steering.capture if steering is not None else None, prompt_len, meta,
                                   max_tokens)
        if steering is None or not steering.steered:
            return (0, 0)
        if req_id in self._held:  # re-added (streaming input): drop the old state first
            self.remove_request(req_id)
        rows: dict[str, int] = {}
        sae, conditions, projections = steering.sae or {}, steering.condition or {}, steering.projections or {}
        for key in steering.keys:
            rows[key] = self._acquire(key, lambda k=key: self._vectors_for(steering, k), sae.get(key),
                                      conditions.get(key), projections.get(key))
        self.peak_live_configs = max(self.peak_live_configs, len(self.rows.live_keys()))
        if self.stops is not None and steering.stop_when:
            self.stops.watch(req_id, steering.stop_when, prompt_len)
        pair = (rows.get(steering.prefill, 0), rows.get(steering.decode, 0))
        self._held[req_id] = _Held(pair, steering.keys)
        return pair

    def _acquire(self, key: str, rows: Callable[[], Layout], sae: list | None = None,
                 condition: list | None = None, projections: list | None = None) -> int:
        row, needs_write, became_live = self.rows.acquire(key)
        if needs_write:
            self._write(row, rows(), sae, condition, projections)
        if became_live:
            self._set_live(row, True)
        return row

    def _write(self, row: int, layout: Layout, sae: list | None = None, condition: list | None = None,
               projections: list | None = None) -> None:
        self.row_upload_bytes += self.tables.write_row(row, layout)
        self.row_uploads += 1
        if self.sae is not None:
            self.row_upload_bytes += self.sae.write_row(row, sae)
        if self.conditions is not None:
            self.row_upload_bytes += self.conditions.write_row(row, condition)
        if self.projections is not None:
            self.row_upload_bytes += self.projections.write_row(row, projections)

    def _release(self, key: str) -> None:
        row = self.rows.row_of(key)
        if self.rows.release(key):
            self._set_live(row, False)

    def _set_live(self, row: int, live: bool) -> None:
        """A row became live or was released: the tables' any-active flags, the condition flag and the projection
        sites' idle marks follow."""
        self.tables.set_live(row, live)
        if self.conditions is not None:
            self.conditions.set_live(row, live)
        if self.projections is not None:
            self.projections.set_live(row, live)

    def _vectors_for(self, steering: SteerPayload, key: str) -> Layout:
        if (rows := steering.rows_of(key)) is not None:
            return rows
        ref = steering.module  # a bare module reference: build the row from the registry
        prefill, decode = self.modules.phases(ref.name, ref.version, ref.scale, layers=ref.layers, hooks=ref.hooks)
        # float32 vectors -> table rows in the model dtype (the bytes the front end hashed)
        return table_layout(prefill if key == steering.prefill else decode, self._dtype_name)

    def remove_request(self, req_id: str) -> None:
        if self.stops is not None:
            self.stops.forget(req_id)
        held = self._held.pop(req_id, None)
        if held is None:
            return
        for key in held.keys:
            self._release(key)

    def plan_capture(self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray,
                     eager: bool = False) -> None:
        """Before the forward: this step's capture plan (callers check ``capture`` is configured); ``eager``: no
        CUDA graph replays the forward, so the plan is left to its first capturing op (``CaptureRuntime.defer_step``;
        ``VLLM_STEER_CAPTURE_IN_FORWARD=0``: always before)."""
        capture = self.capture
        if capture.active:
            if eager and PLAN_IN_FORWARD:
                capture.defer_step(req_ids, num_scheduled, num_computed)
            else:
                capture.plan_step(req_ids, num_scheduled, num_computed)
        else:
            live.capture_live, live.deferred = False, None

    def finish_requests(self, req_ids: list[str]) -> None:
        """The requests are done (not merely preempted): their captures can be published (together: one gather
        and one copy for their device-reduced rows)."""
        if self.capture is not None and req_ids:
            self.capture.finish_requests(list(req_ids))

    # ---- named modules ----------------------------------------------------------------
    def register_module(self, name: str, version: int, tiers: dict) -> list[str]:
        """Keep a module's tiers and materialize its scale-1 rows into the row cache where a row is
        free or holds only a cached config (none is taken from a running request); their keys."""
        self.modules.add(name, version, tiers)
        prefill, decode = self.modules.phases(name, version, 1.0)
        written = []
        for vecs in (prefill, decode):
            layout = table_layout(vecs, self._dtype_name)
            key = layout_key(layout, self._dtype_name)
            row = self.rows.materialize(key) if key is not None else None
            if row is not None:
                self._write(row, layout)
                written.append(key)
        return written

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """[len(req_ids), 2] int32 rows of requests in batch order (0 for unsteered)."""
        zero = (0, 0)
        held = self._held
        return np.array([held[r].rows if r in held else zero for r in req_ids], dtype=np.int32).reshape(-1, 2)

    # ---- data plane: once per step, before the forward ------------------------------------
    def prepare_step(
        self,
        rows: np.ndarray | None,  # [num_reqs, 2] (prefill row, decode row), batch order
        num_scheduled_tokens: np.ndarray,  # [num_reqs]
        num_computed_tokens: np.ndarray,  # [num_reqs], before this step
        prompt_len: np.ndarray,  # [num_reqs]
    ) -> None:
        """Write the token -> row index for this step (tokens in batch order, as vLLM lays them out).

        ``rows`` None means no request of the batch is steered."""
        if rows is None or not rows.any():
            self._clear_index()
            return
        # Tokens before the prompt's end are prefill tokens (also when recomputed after preemption).
        n_prefill = np.clip(prompt_len - num_computed_tokens, 0, num_scheduled_tokens)
        counts = np.stack([n_prefill, num_scheduled_tokens - n_prefill], axis=1).reshape(-1)
        expanded = np.repeat(rows.reshape(-1), counts)
        n = expanded.shape[0]
        extent = max(n, self._index_extent)  # also clear what the last step left beyond n
        host, land = self._index_ring.stage()
        host[:n] = expanded
        host[n:extent] = 0
        land(self.tables.index[:extent])
        self._index_extent = n

    def index_on_device(self, slots: SlotRows, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                        positions: torch.Tensor, num_reqs: int, pad_end: int) -> None:
        """The V2 runner's step: the token -> row index from the batch's request slots, boundaries and
        positions (device tensors vLLM has written for this step) and ``slots`` (synced here when a
        request's rows changed); padding up to ``pad_end`` gets row 0. Nothing while no request is
        steered (the index is cleared once)."""
        if not self._held:
            self._clear_index()
            return
        slots.sync()
        step_index(self.tables.index, idx_mapping, query_start_loc, positions, slots.device, num_reqs, pad_end)
        self._index_extent = max(self._index_extent, pad_end)

    def _clear_index(self) -> None:
        """Zero what earlier steps wrote into the index (once: nothing after that)."""
        if self._index_extent:
            self.tables.index[: self._index_extent].zero_()
            self._index_extent = 0

    def index_on_device_warmup(self, slots: SlotRows, input_buffers: Any = None) -> None:
        """Compile ``step_index`` at start-up (a launch with no request: nothing written), not at the first steered
        step: with the runner's own ``query_start_loc`` and ``positions`` buffers (``input_buffers``; without them
        vLLM 0.26's dtypes, int32 and int64) and an int32 ``idx_mapping``, the tensors each step passes, so the kernel
        compiled here is the one the steps launch (Triton compiles one per argument dtype: an int32 ``positions``
        here compiled another, and the first steered step compiled its own, a JIT during inference that
        ``--jit-monitor-mode error`` turns into an engine error)."""
        device = slots.device.device
        qsl = getattr(input_buffers, "query_start_loc", None)
        positions = getattr(input_buffers, "positions", None)
        qsl = qsl[:1] if qsl is not None else torch.zeros(1, dtype=torch.int32, device=device)
        positions = positions[:1] if positions is not None else torch.zeros(1, dtype=torch.int64, device=device)
        idx_mapping = torch.zeros(1, dtype=torch.int32, device=device)
        step_index(self.tables.index, idx_mapping, qsl, positions, slots.device, 0, 0)


def _capture_ranks() -> tuple[int, int, int]:
    """(TP rank, PP rank, PP size) of this worker within its engine (DP engines each count from 0)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pp = get_pp_group()
        return get_tp_group().rank_in_group, pp.rank_in_group, pp.world_size
    except (ImportError, AssertionError):  # no distributed state (tests building a runtime by hand)
        return 0, 0, 1


def build_runtime(runner: object) -> SteeringRuntime | None:
    """The runtime for a model runner (V1 or V2) whose model was just loaded; None: steering off."""
    cfg = steer_config_of(runner.vllm_config)
    if cfg is None:
        return None
    existing = getattr(runner, "steer_runtime", None)
    if existing is not None and existing.model is runner.model:
        return existing  # vLLM 0.32+: load_model(model=...) handed the already steered model back
    mc = runner.vllm_config.model_config
    gc_watch.install()  # VLLM_STEER_GC_WATCH: slow collections logged (a diagnostic, off by default)
    runtime = SteeringRuntime(
        cfg,
        runner.model,
        hidden_size=mc.get_hidden_size(),
        max_num_tokens=runner.vllm_config.scheduler_config.max_num_batched_tokens,
        dtype=mc.dtype,
        device=runner.device,
        max_num_reqs=runner.vllm_config.scheduler_config.max_num_seqs,
    )
    allreduce_fusion.warn_lost(runner.vllm_config, runtime.norm_modes, _capture_ranks()[0])
    # the all-reduce inside the steered norm (opt-in): every TP rank makes the group's workspace here, alike
    allreduce_fusion.make_workspace(runner.vllm_config, torch.device(runner.device), mc.dtype, mc.get_hidden_size())
    runner.steer_runtime = runtime
    runner.steer_capture = runtime.capture
    runner.steer_stops = runtime.stops
    return runtime


def with_after_forward(execute_model: Callable) -> Callable:
    """Wrap a runner's ``execute_model`` (V1 or V2): after the forward is enqueued, copy the gates ``stop_when`` reads
    and hand the step's captured rows on (only runners whose runtime captures or watches a request do anything here).
    When the runner samples in its own call (``execute_model`` returned None: ``sample_tokens`` follows) the hand-off
    waits for it (``with_after_sample``); one still pending when the next step begins is made then."""

    def wrapper(self, *args, **kwargs):
        capture = getattr(self, "steer_capture", None)
        if capture is not None and capture.sample_due:  # no sample_tokens came after the last step's forward
            capture.sample_due = False
            capture.after_forward()
        out = execute_model(self, *args, **kwargs)
        if capture is not None:
            capture.launched()
            if out is None and not getattr(self, "is_pooling_model", False):  # V2 pools without sample_tokens
                capture.sample_due = True
            else:
                capture.after_forward()
        stops: StopWatch | None = getattr(self, "steer_stops", None)
        if stops is not None and stops.watched:
            stops.after_forward()
            if out is not None:  # a runner that returned its output without sample_tokens
                stops.attach(out)
        return out

    return wrapper


def with_after_sample(sample_tokens: Callable) -> Callable:
    """Wrap a runner's ``sample_tokens`` (V1 or V2): the step's captured rows are handed on now, their D2H copy after
    the runner's own output copy (its event: V2 ``copy_event``, V1 ``async_copy_ready_event``): one device-to-host
    copy engine serves both in order, and a step's capture (hundreds of MB in a prefill) queued first held the sampled
    tokens, so the host's next step, for its whole length (s38's prefill profile: ~4.9 ms a step). The step's
    ``stop_when`` gates go with its output."""

    def wrapper(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        capture = getattr(self, "steer_capture", None)
        if capture is not None and capture.sample_due:
            capture.sample_due = False
            capture.after_forward(getattr(out, "copy_event", None) or getattr(out, "async_copy_ready_event", None))
        stops: StopWatch | None = getattr(self, "steer_stops", None)
        if stops is not None and stops.pending is not None:
            stops.attach(out)
        return out

    return wrapper
