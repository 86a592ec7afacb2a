"""Engine side of named-module and runtime-SAE registration: ``EngineCore.collective_rpc`` sees every
registration on its way to the workers, so the module registry (``engine.module_registry``) decides
it and tells the workers which old module versions they may forget, and the SAE registry decides a runtime
SAE (name, sites) and has it staged into reserved sites only while no unfinished request clamps there.
It answers the registries' listings and entries, and the ``in_flight`` counts of modules and SAEs from
the scheduler, which knows queued requests no worker has seen yet."""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_steer.core.payload import payload_of
from vllm_steer.engine.metrics_rpc import engine_metrics
from vllm_steer.engine.module_registry import registry_of


def _module_refs(requests: Any) -> Any:
    """The named-module references (``{name, version, scale}``) of unfinished requests."""
    for request in requests:
        module = (payload_of(getattr(request, "sampling_params", None)) or {}).get("module")
        if module:
            yield module


def module_users(requests: Any) -> dict[str, int]:
    """Unfinished requests (waiting, running or preempted) per named module they reference."""
    return dict(Counter(m["name"] for m in _module_refs(requests)))


def module_versions_in_use(requests: Any) -> set[tuple[str, int]]:
    """(name, version) of the named modules unfinished requests reference."""
    return {(m["name"], m["version"]) for m in _module_refs(requests)}


def _forget_retired(core: Any, original: Any, timeout: Any) -> None:
    """Tell the workers to drop module versions nothing can use any more (after every mutation)."""
    gone = registry_of(core).retire(module_versions_in_use(core.scheduler.requests.values()))
    if gone:
        original(core, "vllm_steer_forget_modules", timeout, ([list(g) for g in gone],), None)


def sae_users(requests: Any) -> dict[str, dict[str, int]]:
    """Unfinished requests per SAE name and per SAE site (``hook.layer``) their clamps use."""
    names: Counter[str] = Counter()
    sites: Counter[str] = Counter()
    for request in requests:
        sae = (payload_of(getattr(request, "sampling_params", None)) or {}).get("sae")
        if sae:
            entries = [e for phase in sae.values() for e in phase]
            names.update({e[0] for e in entries})
            sites.update({f"{e[1]}.{e[2]}" for e in entries})
    return {"names": dict(names), "sites": dict(sites)}


_LISTINGS = {"vllm_steer_module_registry": ("modules", "listing"), "vllm_steer_module_fetch": ("modules", "fetch"),
             "vllm_steer_sae_registry": ("sae", "listing"), "vllm_steer_sae_fetch": ("sae", "fetch")}


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


def _hold_sae(core: Any, scheduler: Any, args: tuple) -> list:
    """First step of a registration across data-parallel engines (``vllm_steer_sae_hold``): this
    engine's answer, and, when it may go ahead, the name and sites kept for that registration."""
    name, version, policy, sites = args
    if (refused := _sae_refusal(core, scheduler, name, version, policy, sites)) is not None:
        return [refused]
    registry_of(core, "sae").hold(name, version, sites)
    return [{"held": version}]


def _register_sae(core: Any, scheduler: Any, original: Any, timeout: Any, args: tuple, kwargs: Any) -> list:
    """Decide a runtime SAE registration here (``_sae_refusal``), then stage it on the workers and
    record it. Args: the workers' (path, format, site, features, sites), then name, version and the
    policy (``replace``)."""
    staged, (name, version, policy) = args[:5], args[5:8]
    sites = staged[4]
    registry = registry_of(core, "sae")
    if (refused := _sae_refusal(core, scheduler, name, version, policy, sites)) is not None:
        return [refused]
    out = original(core, "vllm_steer_register_sae", timeout, staged, kwargs)
    registry.record(name, version, policy.get("config", {}), {"sites": list(sites)})
    return out


def patch_engine_core_rpc() -> None:
    """Patch: ``EngineCore.collective_rpc`` (0.26). Module registration passes through the engine
    core on its way to the workers: the registry decides it here, and old versions no request uses
    are forgotten by the workers after each change. ``vllm_steer_module_users`` is answered here (one
    entry, as if from one worker): the scheduler sees queued requests too, which no worker has yet."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.collective_rpc
    if getattr(original, "_vllm_steer", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        scheduler = getattr(self, "scheduler", None)
        gate = getattr(scheduler, "steer_gate", None)
        if method == "vllm_steer_metrics":  # a /metrics scrape (engine.metrics_rpc)
            return [engine_metrics(self, gate, lambda: original(self, "vllm_steer_status", timeout))]
        if method == "vllm_steer_module_users":
            return [module_users(scheduler.requests.values()) if gate is not None else {}]
        if method == "vllm_steer_sae_users":
            return [sae_users(scheduler.requests.values()) if gate is not None else {"names": {}, "sites": {}}]
        if gate is not None and method == "vllm_steer_register_sae":
            return _register_sae(self, scheduler, original, timeout, args, kwargs)
        if gate is not None and method == "vllm_steer_sae_hold":
            return _hold_sae(self, scheduler, args)
        if gate is not None and method == "vllm_steer_sae_release":
            registry_of(self, "sae").release(args[0])
            return [{"released": args[0]}]
        if gate is not None and method == "vllm_steer_unregister_sae":
            return [{"deleted": args[0]} if registry_of(self, "sae").remove(args[0]) else {"refused": "missing"}]
        if method in _LISTINGS:
            registry = registry_of(self, _LISTINGS[method][0])
            return [registry.listing() if _LISTINGS[method][1] == "listing" else registry.fetch(list(args[0]))]
        if gate is not None and method == "vllm_steer_register_module":
            name, version, wire, keys = args[:4]
            policy = args[4] if len(args) > 4 else {}
            registry = registry_of(self)
            if (refused := registry.refusal(name, version, policy)) is not None:
                return [refused]  # decided here, whichever API process asked: no worker hears of it
            out = original(self, method, timeout, (name, version, wire, keys), kwargs)
            registry.record(name, version, wire, policy.get("meta", {}))
            _forget_retired(self, original, timeout)
            return out
        if gate is not None and method == "vllm_steer_unregister_module":
            if not registry_of(self).remove(args[0]):
                return [{"refused": "missing"}]
            _forget_retired(self, original, timeout)  # its rows stay cached until evicted
            return [{"deleted": args[0]}]
        return original(self, method, timeout, args, kwargs)

    collective_rpc._vllm_steer = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc
