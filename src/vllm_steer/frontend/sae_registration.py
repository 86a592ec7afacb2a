"""Registering and deleting SAEs while the server runs (``POST`` / ``DELETE /v1/steering/sae``, or
``register_sae(llm, ...)``): check the registration against the sites ``steer.sae_slots`` reserved,
send it through the engine core, whose registry decides it (a name taken without ``replace``, a site
another SAE holds, a site unfinished requests still clamp at) and has every worker stage it, then
publish the name in this process (others pull it: ``frontend.registry_sync``). A site a deleted SAE held
is reused only when no request of this process that is being added, and none unfinished in the
engine, clamps there. A registration may only name files inside ``steer.sae_root``
(``core.sae_paths``): checked here before the engine is asked, and again by every worker; refused
with ``SaePathError`` (403)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from vllm_steer.core.rpc import HoldSae, Name, RegisterSae, Version, call_args
from vllm_steer.core.config import SaeModuleConfig
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import SaeEntry, SlotError, runtime_entry
from vllm_steer.core.sae_paths import SaePathError
from vllm_steer.frontend.module_registration import check_name, check_replace
from vllm_steer.frontend.prepared import PREPARED
from vllm_steer.frontend.sae_registry import REGISTRY, SAE_SYNC

_CONFIG_FIELDS = ("path", "format", "site", "features", "reconstruct")
_FIELDS = {"name", "replace", *_CONFIG_FIELDS}


class SaeExistsError(KeyError):
    """The name is taken (409): by a runtime SAE (unless ``replace``) or one of ``steer.sae``."""


def sae_from_json(body: dict) -> tuple[str, SaeModuleConfig, bool]:
    """(name, config, replace) of a registration body; SteeringSpecError naming the field."""
    extra = set(body) - _FIELDS
    if extra:
        raise SteeringSpecError(sorted(extra)[0], f"unknown field in an SAE registration (fields: {sorted(_FIELDS)})")
    name = check_name(body.get("name"))
    replace = check_replace(body.get("replace"))
    if "path" not in body:
        raise SteeringSpecError("path", "an SAE registration needs the path of its files on the server")
    try:
        config = SaeModuleConfig.model_validate({k: body[k] for k in _CONFIG_FIELDS if k in body})
    except ValidationError as e:
        err = e.errors()[0]
        shown = repr(err.get("input"))
        raise SteeringSpecError(".".join(str(p) for p in err["loc"]) or "body",
                                f"{err['msg']} (got {shown[:100]})") from None
    return name, config, replace


def _in_transit(sites: set[str]) -> dict[str, int]:
    """Requests of this process on their way to the engine that clamp a runtime SAE at ``sites`` (``hook.layer``;
    a start-up SAE sharing the site has its own part of the site's pack)."""
    out: dict[str, int] = {}
    for payload in PREPARED.payloads():
        runtime = payload.sae_versions or {}
        used = {f"{e[1]}.{e[2]}" for phase in (payload.sae or {}).values() for e in phase if e[0] in runtime}
        for site in used & sites:
            out[site] = out.get(site, 0) + 1
    return out


def _busy(where: str, counts: dict[str, int]) -> SlotError:
    return SlotError(f"requests {where} still clamp at {', '.join(f'{s} ({n})' for s, n in sorted(counts.items()))}; "
                     "retry when they finish")


def _held(site: str, holder: str, slots: dict | None = None) -> str:
    """Why a registration at a taken reserved site is refused: the limit (one runtime SAE per reserved site) and,
    where this process knows them, the reserved sites still free."""
    free = sorted(f"{h}.{l}" for h, l in slots or () if REGISTRY.holder((h, l)) is None)
    where = f"; free reserved sites: {free}" if free else "; no reserved site is free" if slots is not None else ""
    return (f"site {site} holds the SAE {holder!r} (steer.sae_slots reserves one runtime SAE per site{where}); "
            "delete it first")


def _refusal(name: str, r: dict) -> Exception:
    """The error of the engine core's refusal of a registration (another API process got there first)."""
    if "busy" in r:
        return _busy("in the engine", r["busy"])
    if r["refused"] == "held":
        return SlotError(_held(r["site"], r["holder"]))
    if r["refused"] == "exists":
        return SaeExistsError(f"SAE {name!r} exists; pass replace=true to replace it")
    return SaeExistsError(f"SAE {name!r} was registered again meanwhile (refused: {r['refused']}); retry")


class _Registration:
    """One registration's check, hand-over and publication (the same for async and sync callers)."""

    def __init__(self, frontend: Any, name: str, config: SaeModuleConfig, replace: bool) -> None:
        if name in frontend.sae_config:
            raise SaeExistsError(f"SAE {name!r} was loaded at start-up (steer.sae) and cannot be replaced")
        self.old = REGISTRY.get(name)
        self.replace = replace
        if self.old is not None and not replace:
            raise SaeExistsError(f"SAE {name!r} exists; pass replace=true to replace it")
        cfg, shape = frontend.cfg, frontend.shape
        self.entry: SaeEntry = runtime_entry(name, config, cfg, shape.hidden_size, shape.num_layers,
                                             frontend.sae_slots, REGISTRY.next_version())
        for site in self.entry.sites:
            holder = REGISTRY.holder(site)
            if holder is not None and holder != name:
                raise SlotError(_held(f"{site[0]}.{site[1]}", holder, frontend.sae_slots))
        self.sites = [f"{h}.{l}" for h, l in self.entry.sites]
        if self.old is not None:  # new requests can no longer name the old one
            REGISTRY.drop(name)
        busy = _in_transit(set(self.sites))
        if busy:
            self.undo()
            raise _busy("being added", busy)
        REGISTRY.pending.update(self.entry.sites)

    @property
    def rpc_args(self) -> tuple:
        """The workers' staging arguments, then what the engine core's registry decides on and keeps."""
        c = self.entry.config
        policy = {"replace": self.replace, "config": c.model_dump(mode="json", exclude_defaults=True)}
        return call_args(RegisterSae(c.path, c.format, c.site, list(self.entry.features), self.sites,
                                     self.entry.name, self.entry.version, policy))

    def undo(self) -> None:
        REGISTRY.pending.difference_update(self.entry.sites)
        if self.old is not None:
            REGISTRY.publish(self.old)

    def finish(self, replies: list) -> SaeEntry:
        refused = next((r for r in replies if isinstance(r, dict) and ("busy" in r or "refused" in r)), None)
        if refused is not None:
            self.undo()
            raise _refusal(self.entry.name, refused)
        REGISTRY.pending.difference_update(self.entry.sites)
        REGISTRY.publish(self.entry)  # only now can a request name it
        return self.entry

    def failed(self, e: Exception) -> Exception:
        """The error of a worker's failure to stage it: a worker's path refusal stays one (403)."""
        self.undo()
        denied = SaePathError.within(e)
        if denied is not None:
            return denied
        return SteeringSpecError("path", f"a worker could not load the SAE: {type(e).__name__}: {str(e)[:300]}")


async def register_sae_async(rpc: Callable[..., Awaitable[Any]], frontend: Any, body: dict,
                             rpc_each: Callable[..., Awaitable[list]] | None = None) -> SaeEntry:
    """``rpc_each`` (data parallelism: one answer per engine) first has every engine agree and hold
    the name and sites, so that each then stages and records what the others do."""
    async with SAE_SYNC.lock:  # a registry pull of this process never undoes this registration
        await SAE_SYNC.refresh_locked(rpc, frontend)
        reg = _Registration(frontend, *sae_from_json(body))
        if rpc_each is not None:
            await _hold_everywhere(rpc, rpc_each, reg)
        try:
            replies = await rpc("vllm_steer_register_sae", args=reg.rpc_args)
        except Exception as e:
            raise reg.failed(e) from None
        entry = reg.finish(replies)
        if rpc_each is not None:
            await _check_everywhere(rpc_each, entry)
        await SAE_SYNC.refresh_locked(rpc, frontend)  # this process's own change: no need to refuse requests
        return entry


async def _hold_everywhere(rpc: Callable[..., Awaitable[Any]], rpc_each: Callable[..., Awaitable[list]],
                           reg: _Registration) -> None:
    """Every data-parallel engine decides the registration on its own (its requests are its own);
    all must agree before any stages it. Replacing a name is refused here: between the engines'
    answers and the staging, new requests could still name the old SAE on one of them."""
    if reg.old is not None:
        reg.undo()
        raise SaeExistsError(f"SAE {reg.entry.name!r} exists: under data parallelism delete it first, then "
                             "register it again (replace is not atomic across engines)")
    args = call_args(HoldSae(reg.entry.name, reg.entry.version, {"replace": False}, reg.sites))
    answers = await rpc_each("vllm_steer_sae_hold", args)
    refused = next((a for a in answers if not (isinstance(a, dict) and "held" in a)), None)
    if refused is not None:
        await rpc("vllm_steer_sae_release", args=call_args(Version(reg.entry.version)))
        reg.undo()
        if refused.get("refused") == "pending":
            raise SlotError(f"another registration of {refused['holder']!r} is in progress at these sites; retry")
        raise _refusal(reg.entry.name, refused)


async def _check_everywhere(rpc_each: Callable[..., Awaitable[list]], entry: SaeEntry) -> None:
    """Every engine recorded this version (vLLM's client returns engine 0's staging answer only)."""
    listings = await rpc_each("vllm_steer_sae_registry", ())
    missing = [i for i, lst in enumerate(listings) if lst.get("versions", {}).get(entry.name) != entry.version]
    if missing:
        raise SlotError(f"engines {missing} did not stage SAE {entry.name!r}; delete it and register it again")


async def unregister_sae_async(rpc: Callable[..., Awaitable[Any]], frontend: Any, name: str) -> SaeEntry | None:
    """Delete a runtime SAE (``DELETE /v1/steering/sae/{name}``): new requests naming it are refused from
    here on, running ones finish with its staged weights. The engine core's registry forgets it (None:
    no such SAE there); no worker is involved (the engine core keeps the site from being re-staged
    while it is in use)."""
    async with SAE_SYNC.lock:
        await SAE_SYNC.refresh_locked(rpc, frontend)
        if REGISTRY.get(name) is None:
            return None
        reply = (await rpc("vllm_steer_unregister_sae", args=call_args(Name(name))))[0]
        entry = REGISTRY.drop(name)
        await SAE_SYNC.refresh_locked(rpc, frontend)
        return None if reply.get("refused") else entry


def unregister_sae(llm: Any, name: str) -> SaeEntry:
    """Delete a runtime SAE of a ``vllm.LLM`` (as ``DELETE /v1/steering/sae/{name}``); KeyError for an
    unknown name. ``llm`` pairs it with ``register_sae``."""
    entry = REGISTRY.entries[name]
    llm.collective_rpc("vllm_steer_unregister_sae", args=call_args(Name(name)))
    return REGISTRY.drop(name) or entry


def register_sae(llm: Any, name: str, path: str, format: str | None = None, site: str | None = None,
                 features: list[int] | None = None, replace: bool = False, reconstruct: bool = False) -> dict:
    """Register an SAE on a ``vllm.LLM`` started with ``steer.sae_slots`` (as ``POST /v1/steering/sae``)."""
    from vllm_steer.frontend.prepare import SteeringFrontend

    frontend = SteeringFrontend(llm.llm_engine.vllm_config)
    body = {"name": name, "path": path, "format": format, "site": site, "features": features, "replace": replace,
            "reconstruct": reconstruct or None}
    reg = _Registration(frontend, *sae_from_json({k: v for k, v in body.items() if v is not None}))
    try:
        replies = llm.collective_rpc("vllm_steer_register_sae", args=reg.rpc_args)
    except Exception as e:
        raise reg.failed(e) from None
    return sae_summary(reg.finish(replies))


def sae_summary(e: SaeEntry) -> dict:
    """What ``GET /v1/steering/sae`` shows of one SAE."""
    metas = list(e.sites.values())
    return {"name": e.name, "source": "runtime" if e.version else "config",
            "sites": [f"{h}.{l}" for h, l in e.sites], "d_sae": metas[0].d_sae,
            "activation": metas[0].activation, "k": metas[0].k or None, "dtype": metas[0].dtype,
            "modes": ["delta", "reconstruct"] if e.config.reconstruct else ["delta"],
            "clampable": len(e.features), "features": list(e.features) if e.config.features is not None else None}
