"""The worker's steering runtime: request rows in, a token -> row index out, every step.

Control work happens when requests arrive or leave (row acquire/release, table writes). The
per-step work is one host ``np.repeat`` over the batch and one non-blocking copy of the index,
skipped entirely while no steered token is (or was last step) in the batch. No device sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from vllm_steer.config import SteerConfig, steer_config_of
from vllm_steer.hooks import HOOK_NAMES
from vllm_steer.hashing import config_hash
from vllm_steer.kernels.apply_steering import live
from vllm_steer.payload import PAYLOAD_KEY, EngineSteering, HookVectors, decode_payload, hook_vectors
from vllm_steer.runtime.capture import CaptureRuntime
from vllm_steer.runtime.install import find_decoder_layers, install_steering, num_decoder_layers
from vllm_steer.runtime.modules import WorkerModules
from vllm_steer.runtime.rows import RowAllocator
from vllm_steer.runtime.tables import SteeringTables

logger = logging.getLogger("vllm_steer")


@dataclass
class _Held:
    rows: tuple[int, int]  # (prefill row, decode row); 0 = unsteered phase
    keys: tuple[str, ...]


def hooked_layers_for(cfg: SteerConfig, layer_ids: list[int]) -> dict[str, list[int]]:
    wanted = set(cfg.layers) if cfg.layers is not None else None
    ids = [i for i in layer_ids if wanted is None or i in wanted]
    return {h: list(ids) for h in HOOK_NAMES if h in cfg.hooks}


class SteeringRuntime:
    def __init__(
        self,
        cfg: SteerConfig,
        model: nn.Module,
        hidden_size: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.hidden_size = hidden_size
        layer_ids = [i for i, _ in find_decoder_layers(model)]
        self.hooked_layers = hooked_layers_for(cfg, layer_ids)
        self.tables = SteeringTables(
            self.hooked_layers, cfg.max_configs, hidden_size, max_num_tokens, dtype, device
        )
        self.rows = RowAllocator(cfg.max_configs)
        self.modules = WorkerModules()
        self.capture: CaptureRuntime | None = None
        if cfg.capture:
            sites = [(h, l) for h, ls in self.hooked_layers.items() for l in ls]
            self.capture = CaptureRuntime(cfg, sites, num_decoder_layers(model), max_num_tokens,
                                          hidden_size, dtype, device, rank=_rank())
        self.num_ops = install_steering(
            model, self.tables, self.hooked_layers, self.capture.buffers if self.capture else None,
            inline=cfg.apply == "inline",
        )
        self._held: dict[str, _Held] = {}
        self.peak_live_configs = 0  # most configs live at once since start (capacity is strict)
        self.preemptions_seen = 0  # requests the scheduler preempted (their steering must survive)
        self._index_extent = 0  # tokens of the device index that may hold non-zero rows
        self._index_host = np.zeros(max_num_tokens, dtype=np.int32)
        logger.info(
            "vllm-steer: %d steering sites installed (apply=%s, hooks %s, %d layers, %d rows)",
            self.num_ops, cfg.apply, list(self.hooked_layers), len(layer_ids), cfg.max_configs,
        )

    @property
    def any_steered(self) -> bool:
        return bool(self._held)

    # ---- control plane: requests come and go -------------------------------------------
    def add_request(self, req_id: str, extra_args: dict | None, prompt_len: int = 0) -> tuple[int, int]:
        """Acquire (and if needed write) the rows of a request; returns (prefill row, decode row)."""
        payload = (extra_args or {}).get(PAYLOAD_KEY)
        if self.capture is not None:
            meta = {"external_id": payload.get("external_id")} if payload else {}
            self.capture.add_request(req_id, payload.get("capture") if payload else None, prompt_len, meta)
        if not payload or (payload["prefill"] is None and payload["decode"] is None):
            return (0, 0)
        if req_id in self._held:  # re-added (streaming input): drop the old state first
            self.remove_request(req_id)
        steering = decode_payload(payload, self.hidden_size)
        rows: dict[str, int] = {}
        for key in steering.keys:
            rows[key] = self._acquire(key, lambda k=key: self._vectors_for(steering, k))
        self.peak_live_configs = max(self.peak_live_configs, len(self.rows.live_keys()))
        pair = (rows.get(steering.prefill_key, 0), rows.get(steering.decode_key, 0))
        self._held[req_id] = _Held(pair, steering.keys)
        return pair

    def _acquire(self, key: str, vectors: Callable[[], dict[str, HookVectors]]) -> int:
        row, needs_write, became_live = self.rows.acquire(key)
        if needs_write:
            self.tables.write_row(row, vectors())
        if became_live:
            self.tables.set_live(row, True)
        return row

    def _release(self, key: str) -> None:
        row = self.rows.row_of(key)
        if self.rows.release(key):
            self.tables.set_live(row, False)

    def _vectors_for(self, steering: EngineSteering, key: str) -> dict[str, HookVectors]:
        if key in steering.configs:
            return steering.configs[key]
        ref = steering.module  # a bare module reference: build the row from the registry
        prefill, decode = self.modules.phases(ref["name"], ref["version"], ref["scale"])
        return hook_vectors(prefill if key == steering.prefill_key else decode, self.tables.dtype)

    def remove_request(self, req_id: str) -> None:
        held = self._held.pop(req_id, None)
        if held is None:
            return
        for key in held.keys:
            self._release(key)

    def warm_up_kernel(self, capture_sizes: list[int]) -> None:
        """JIT the Triton kernel for every CUDA-graph capture size (and both flag states) now, so
        no compile lands inside a captured graph or a served request."""

        sizes = sorted(set(capture_sizes) | {1, self.tables.index.shape[0]})
        table = torch.zeros(2, self.hidden_size, dtype=self.tables.dtype, device=self.tables.index.device)
        hidden = torch.zeros(max(sizes), self.hidden_size, dtype=self.tables.dtype, device=table.device)
        for active in (0, 1):
            flag = torch.full((1,), active, dtype=torch.uint8, device=table.device)
            for n in sizes:
                torch.ops.vllm_steer.apply_steering_(hidden[:n], table, self.tables.index, flag)
        torch.cuda.synchronize(table.device)

    def plan_capture(self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray) -> None:
        """Before the forward: this step's capture plan (nothing to do while nobody captures)."""
        if self.capture is not None and self.capture.active:
            self.capture.plan_step(req_ids, num_scheduled, num_computed)
        else:
            live.capture_live = False

    def after_forward(self) -> None:
        """Once the forward is enqueued: hand this step's captured rows to the consumers."""
        if self.capture is not None:
            self.capture.after_forward()

    def finish_request(self, req_id: str) -> None:
        """The request is done (not merely preempted): its captures can be published."""
        if self.capture is not None:
            self.capture.finish_request(req_id)

    # ---- named modules ----------------------------------------------------------------
    def register_module(self, name: str, version: int, tiers: dict, pin: bool) -> list[str]:
        """Keep a module's tiers; if ``pin``, pre-materialize and pin its scale-1 rows."""
        self.unregister_module(name)
        self.modules.add(name, version, tiers)
        if not pin:
            return []
        prefill, decode = self.modules.phases(name, version, 1.0)
        pinned = []
        for vecs in (prefill, decode):
            key = config_hash(vecs)
            if key is not None and key not in pinned:
                self._acquire(key, lambda v=vecs: hook_vectors(v, self.tables.dtype))
                pinned.append(key)
        self.modules.pinned[name] = tuple(pinned)
        return pinned

    def unregister_module(self, name: str) -> None:
        for key in self.modules.pinned.pop(name, ()):
            self._release(key)

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
            live.steering_live = False
            if self._index_extent:
                self.tables.index[: self._index_extent].zero_()
                self._index_extent = 0
            return
        live.steering_live = True
        # Tokens before the prompt's end are prefill tokens (also when recomputed after preemption).
        n_prefill = np.clip(prompt_len - num_computed_tokens, 0, num_scheduled_tokens)
        counts = np.stack([n_prefill, num_scheduled_tokens - n_prefill], axis=1).reshape(-1)
        expanded = np.repeat(rows.reshape(-1), counts)
        n = expanded.shape[0]
        extent = max(n, self._index_extent)  # also clear what the last step left beyond n
        host = self._index_host[:extent]
        host[:n] = expanded
        host[n:] = 0
        src = torch.from_numpy(host)
        if self.tables.index.is_cuda:
            src = src.pin_memory()
        self.tables.index[:extent].copy_(src, non_blocking=True)
        self._index_extent = n


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_runtime(runner: object) -> SteeringRuntime | None:
    """The runtime for a model runner (V1 or V2) whose model was just loaded; None: steering off."""
    cfg = steer_config_of(runner.vllm_config)
    if cfg is None:
        return None
    mc = runner.vllm_config.model_config
    runtime = SteeringRuntime(
        cfg,
        runner.model,
        hidden_size=mc.get_hidden_size(),
        max_num_tokens=runner.vllm_config.scheduler_config.max_num_batched_tokens,
        dtype=mc.dtype,
        device=runner.device,
    )
    runner.steer_runtime = runtime
    return runtime


def with_after_forward(execute_model: Callable) -> Callable:
    """Wrap a runner's ``execute_model`` (V1 or V2): after the forward is enqueued, hand the
    step's captured rows on (``SteeringRuntime.after_forward``)."""

    def wrapper(self, *args, **kwargs):
        out = execute_model(self, *args, **kwargs)
        rt = getattr(self, "steer_runtime", None)
        if rt is not None:
            rt.after_forward()
        return out

    return wrapper
