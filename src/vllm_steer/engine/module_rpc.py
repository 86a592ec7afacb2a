"""Engine side of named-module and runtime-SAE registration: ``EngineCore.collective_rpc`` sees every
registration on its way to the workers, so the module registry (``engine.module_registry``) decides
it and tells the workers which old module versions they may forget, and the SAE registry decides a runtime
SAE (name, sites) and has it staged into reserved sites only while no unfinished request clamps there.
It answers the registries' listings and entries, and the ``in_flight`` counts of modules and SAEs from
the scheduler, which knows queued requests no worker has seen yet. Each method the engine core answers
(``core.rpc.METHODS``) has one handler in ``HANDLERS``, found by name; every other name goes to the workers."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, NamedTuple

from vllm_steer.core.payload import request_payload
from vllm_steer.core.rpc import (ENGINE_CORE, ForgetModules, HoldSae, Name, Names, NoArgs, RegisterModule, RegisterSae,
                                 RpcArgs, StageModule, Version, call_args, methods_of, parse_args)
from vllm_steer.engine.metrics_rpc import engine_metrics
from vllm_steer.engine.module_registry import registry_of


class Call(NamedTuple):
    """One engine-core RPC being answered: the EngineCore, its row gate (None: steering off), and
    ``forward(method, args)``, vLLM's own collective_rpc to the workers."""

    core: Any
    gate: Any
    forward: Callable[[str, RpcArgs], list]

    @property
    def requests(self) -> Any:
        return self.core.scheduler.requests.values()


def _payloads(requests: Any) -> Any:
    for request in requests:
        payload = request_payload(request)
        if payload is not None:
            yield payload


def module_users(requests: Any) -> dict[str, int]:
    """Unfinished requests (waiting, running or preempted) per named module they reference."""
    return dict(Counter(p.module.name for p in _payloads(requests) if p.module is not None))


def module_versions_in_use(requests: Any) -> set[tuple[str, int]]:
    """(name, version) of the named modules unfinished requests reference."""
    return {(p.module.name, p.module.version) for p in _payloads(requests) if p.module is not None}


def _forget_retired(call: Call) -> None:
    """Tell the workers to drop module versions nothing can use any more (after every mutation)."""
    gone = registry_of(call.core).retire(module_versions_in_use(call.requests))
    if gone:
        call.forward("vllm_steer_forget_modules", ForgetModules([tuple(g) for g in gone]))


def sae_users(requests: Any) -> dict[str, dict[str, int]]:
    """Unfinished requests per SAE name, and per site (``hook.layer``) where they clamp a runtime SAE (a start-up
    SAE sharing the site has its own part of the site's pack)."""
    names: Counter[str] = Counter()
    sites: Counter[str] = Counter()
    for payload in _payloads(requests):
        if payload.sae:
            entries = [e for phase in payload.sae.values() for e in phase]
            names.update({e[0] for e in entries})
            runtime = payload.sae_versions or {}
            sites.update({f"{e[1]}.{e[2]}" for e in entries if e[0] in runtime})
    return {"names": dict(names), "sites": dict(sites)}


def _sae_refusal(core: Any, scheduler: Any, name: str, version: int, policy: dict, sites: list[str]) -> dict | None:
    """Why this engine refuses a runtime SAE registration: the name exists (without ``replace``), a
    site another name holds, another registration's hold (data parallelism), a site unfinished
    requests still clamp at. None: it may go ahead."""
    registry = registry_of(core, "sae")
    if (refused := registry.refusal(name, version, policy)) is not None:
        return refused
    for site in sites:
        holder = registry.holder(site)
        if holder is not None and holder != name:
            return {"refused": "held", "site": site, "holder": holder}
    if (pending := registry.held_by_another(name, version, sites)) is not None:
        return pending
    in_use = sae_users(scheduler.requests.values())["sites"]
    busy = {site: in_use[site] for site in sites if site in in_use}
    if busy:  # requests of the SAE that held these sites are still running: refuse, do not overwrite
        return {"busy": busy}
    return None


def _steering_on(call: Call, method: str) -> None:
    if call.gate is None:
        raise RuntimeError(f"{method}: steering is off on this engine (no steer config)")


def _metrics(call: Call, _: NoArgs) -> list:
    return [engine_metrics(call.core, call.gate, lambda: call.forward("vllm_steer_status", NoArgs()))]


def _module_users(call: Call, _: NoArgs) -> list:
    return [module_users(call.requests) if call.gate is not None else {}]


def _sae_users(call: Call, _: NoArgs) -> list:
    return [sae_users(call.requests) if call.gate is not None else {"names": {}, "sites": {}}]


def _listing(kind: str) -> Callable[[Call, NoArgs], list]:
    return lambda call, _: [registry_of(call.core, kind).listing()]


def _fetch(kind: str) -> Callable[[Call, Names], list]:
    return lambda call, args: [registry_of(call.core, kind).fetch(list(args.names))]


def _register_module(call: Call, args: RegisterModule) -> list:
    """Decided here, whichever API process asked: a refused registration reaches no worker."""
    staged = StageModule(args.name, args.version, args.wire, args.keys)
    if call.gate is None:
        return call.forward("vllm_steer_stage_module", staged)
    registry = registry_of(call.core)
    if (refused := registry.refusal(args.name, args.version, args.policy)) is not None:
        return [refused]
    out = call.forward("vllm_steer_stage_module", staged)
    registry.record(args.name, args.version, args.wire, args.policy.get("meta", {}))
    _forget_retired(call)
    return out


def _unregister_module(call: Call, args: Name) -> list:
    _steering_on(call, "vllm_steer_unregister_module")
    if not registry_of(call.core).remove(args.name):
        return [{"refused": "missing"}]
    _forget_retired(call)  # its rows stay cached until evicted
    return [{"deleted": args.name}]


def _register_sae(call: Call, args: RegisterSae) -> list:
    """Decide a runtime SAE registration here (``_sae_refusal``), then stage it on the workers and record it."""
    if call.gate is None:
        return call.forward("vllm_steer_stage_sae", args.staged)
    refused = _sae_refusal(call.core, call.core.scheduler, args.name, args.version, args.policy, args.sites)
    if refused is not None:
        return [refused]
    out = call.forward("vllm_steer_stage_sae", args.staged)
    registry_of(call.core, "sae").record(args.name, args.version, args.policy.get("config", {}),
                                         {"sites": list(args.sites)})
    return out


def _hold_sae(call: Call, args: HoldSae) -> list:
    """First step of a registration across data-parallel engines: this engine's answer, and, when it
    may go ahead, the name and sites kept for that registration."""
    _steering_on(call, "vllm_steer_sae_hold")
    refused = _sae_refusal(call.core, call.core.scheduler, args.name, args.version, args.policy, args.sites)
    if refused is not None:
        return [refused]
    registry_of(call.core, "sae").hold(args.name, args.version, args.sites)
    return [{"held": args.version}]


def _release_sae(call: Call, args: Version) -> list:
    _steering_on(call, "vllm_steer_sae_release")
    registry_of(call.core, "sae").release(args.version)
    return [{"released": args.version}]


def _unregister_sae(call: Call, args: Name) -> list:
    _steering_on(call, "vllm_steer_unregister_sae")
    return [{"deleted": args.name} if registry_of(call.core, "sae").remove(args.name) else {"refused": "missing"}]


HANDLERS: dict[str, Callable[[Call, Any], list]] = {
    "vllm_steer_metrics": _metrics,
    "vllm_steer_module_users": _module_users,
    "vllm_steer_sae_users": _sae_users,
    "vllm_steer_module_registry": _listing("modules"),
    "vllm_steer_module_fetch": _fetch("modules"),
    "vllm_steer_sae_registry": _listing("sae"),
    "vllm_steer_sae_fetch": _fetch("sae"),
    "vllm_steer_register_module": _register_module,
    "vllm_steer_unregister_module": _unregister_module,
    "vllm_steer_register_sae": _register_sae,
    "vllm_steer_sae_hold": _hold_sae,
    "vllm_steer_sae_release": _release_sae,
    "vllm_steer_unregister_sae": _unregister_sae,
}
assert set(HANDLERS) == methods_of(ENGINE_CORE), "core.rpc.METHODS and HANDLERS disagree"


def patch_engine_core_rpc() -> None:
    """Patch: ``EngineCore.collective_rpc`` (0.26). The methods ``core.rpc.METHODS`` gives to the engine
    core are answered here, between steps (one list, as if from one worker: the scheduler sees queued
    requests too, which no worker has yet); every other method goes to the workers unchanged."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.collective_rpc
    if getattr(original, "_vllm_steer", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        handler = HANDLERS.get(method) if isinstance(method, str) else None
        if handler is None:
            return original(self, method, timeout, args, kwargs)
        gate = getattr(getattr(self, "scheduler", None), "steer_gate", None)
        call = Call(self, gate, lambda name, a: original(self, name, timeout, call_args(a), None))
        return handler(call, parse_args(method, args))

    collective_rpc._vllm_steer = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc
