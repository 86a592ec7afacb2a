"""Engine side of named-module registration: ``EngineCore.collective_rpc`` sees every module
registration on its way to the workers, so the row gate can pin (reserve) rows for the module's
configs, and answers the modules' ``in_flight`` counts from the scheduler, which knows queued
requests no worker has seen yet."""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_steer.core.payload import payload_of


def module_users(requests: Any) -> dict[str, int]:
    """Unfinished requests (waiting, running or preempted) per named module they reference."""
    users: Counter[str] = Counter()
    for request in requests:
        module = (payload_of(getattr(request, "sampling_params", None)) or {}).get("module")
        if module:
            users[module["name"]] += 1
    return dict(users)


def patch_engine_core_rpc() -> None:
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
