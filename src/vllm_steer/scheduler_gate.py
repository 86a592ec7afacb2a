"""Strict row capacity in the scheduler: a steered request waits until its configs fit the tables.

The gate counts the distinct config keys of admitted requests (scheduled at least once and not
finished; a preempted request keeps its keys, so it can always resume). Before each
``Scheduler.schedule`` it sets aside the waiting requests whose new keys would exceed
``max_configs - 1`` rows (first come, first served), and puts them back after; unsteered requests
and requests whose keys are already live pass. The worker's live rows are always a subset of the
admitted keys, so its allocator never runs out, and no request runs unsteered or on another's row.

Patch: ``vllm.v1.core.sched.scheduler.Scheduler.{__init__, schedule, _free_request}`` (0.26).
Why: vLLM has no admission hook for plugins (LoRA's max_loras check is inline). Remove when it does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_steer.config import steer_config_of
from vllm_steer.payload import payload_keys, payload_of


class RowGate:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._refs: Counter[str] = Counter()
        self._admitted: dict[str, tuple[str, ...]] = {}

    @property
    def live_keys(self) -> int:
        return len(self._refs)

    def admit(self, req_id: str, keys: tuple[str, ...]) -> None:
        if req_id in self._admitted or not keys:
            return
        self._admitted[req_id] = keys
        self._refs.update(keys)

    def release(self, req_id: str) -> None:
        keys = self._admitted.pop(req_id, None)
        if keys:
            self._refs.subtract(keys)
            for k in keys:
                if self._refs[k] <= 0:
                    del self._refs[k]

    def try_pin(self, name: str, keys: tuple[str, ...]) -> bool:
        """Reserve rows for a module's pre-materialized configs, if they fit (best effort)."""
        self.unpin(name)
        new = {k for k in keys if k not in self._refs}
        if len(self._refs) + len(new) > self.capacity:
            return False
        self.admit(_pin_id(name), tuple(keys))
        return True

    def unpin(self, name: str) -> None:
        self.release(_pin_id(name))

    def select_held(self, requests: list[Any]) -> list[Any]:
        """Requests (in queue order) that cannot be admitted now."""
        tentative: set[str] = set()
        held = []
        for req in requests:
            if req.request_id in self._admitted:
                continue
            keys = payload_keys(payload_of(req.sampling_params))
            new = {k for k in keys if k not in self._refs and k not in tentative}
            if not new:
                continue
            if len(self._refs) + len(tentative) + len(new) <= self.capacity:
                tentative |= new
            else:
                held.append(req)
        return held


def _pin_id(name: str) -> str:
    return f"\0module:{name}"  # cannot collide with a request id


def _queues(scheduler: Any) -> list[Any]:
    return [q for q in (scheduler.skipped_waiting, scheduler.waiting) if q]


def patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_vllm_steer", False):
        return
    orig_init, orig_schedule, orig_free = Scheduler.__init__, Scheduler.schedule, Scheduler._free_request

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        cfg = steer_config_of(self.vllm_config)
        self.steer_gate = RowGate(cfg.usable_rows) if cfg is not None else None

    def schedule(self, *args, **kwargs):
        gate: RowGate | None = self.steer_gate
        if gate is None:
            return orig_schedule(self, *args, **kwargs)
        set_aside = []
        for queue in _queues(self):
            held = gate.select_held(list(queue))
            if held:
                queue.remove_requests(held)
                set_aside.append((queue, held))
        try:
            out = orig_schedule(self, *args, **kwargs)
        finally:
            for queue, held in set_aside:
                for req in reversed(held):
                    queue.prepend_request(req)
        for new_req in out.scheduled_new_reqs:
            gate.admit(new_req.req_id, payload_keys(payload_of(new_req.sampling_params)))
        return out

    def _free_request(self, request, *args, **kwargs):
        if self.steer_gate is not None:
            self.steer_gate.release(request.request_id)
        return orig_free(self, request, *args, **kwargs)

    schedule._vllm_steer = True  # type: ignore[attr-defined]
    Scheduler.__init__ = __init__
    Scheduler.schedule = schedule
    Scheduler._free_request = _free_request
    _patch_engine_core_rpc()


def module_users(requests: Any) -> dict[str, int]:
    """Unfinished requests (waiting, running or preempted) per named module they reference."""
    users: Counter[str] = Counter()
    for request in requests:
        module = (payload_of(getattr(request, "sampling_params", None)) or {}).get("module")
        if module:
            users[module["name"]] += 1
    return dict(users)


def _patch_engine_core_rpc() -> None:
    """Patch: ``EngineCore.collective_rpc`` (0.26). Module registration passes through the engine
    core on its way to the workers; the gate reserves (pins) rows for the module's configs here,
    and tells the workers whether they may pre-materialize them. Why: the gate and the workers
    must agree on every row in use. ``vllm_steer_module_users`` is answered here (one entry, as
    if from one worker): the scheduler sees queued requests too, which no worker has yet."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.collective_rpc
    if getattr(original, "_vllm_steer", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        scheduler = getattr(self, "scheduler", None)
        gate = getattr(scheduler, "steer_gate", None)
        if method == "vllm_steer_module_users":
            return [module_users(scheduler.requests.values()) if gate is not None else {}]
        if gate is not None and method == "vllm_steer_register_module":
            name, _version, _tiers, keys = args[:4]
            args = (*args[:4], gate.try_pin(name, tuple(keys)))
        elif gate is not None and method == "vllm_steer_unregister_module":
            gate.unpin(args[0])
        return original(self, method, timeout, args, kwargs)

    collective_rpc._vllm_steer = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc
