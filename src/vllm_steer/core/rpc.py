"""Every method vllm-steer adds to vLLM's ``collective_rpc``: its name, its typed arguments, and the process
that answers it (the engine core, or each worker).

Callers build the argument struct and pass ``args=call_args(Struct(...))``: its fields, in order, are the
positional tuple ``collective_rpc`` carries (msgspec and pickle alike), so the wire is what it always was.
The answering side turns them back into the struct with ``parse_args`` (types checked; anything else is
refused with an ``RpcArgsError`` naming the method and the field) and finds its handler by one lookup
(``engine.module_rpc.HANDLERS``, ``runtime.worker_rpc.WORKER_METHODS``); tests check both cover this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_steer.core.struct_info import prebuild

ENGINE_CORE, WORKER = "engine core", "worker"


class RpcArgs(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, gc=False):
    """The arguments of one method (array-like: they travel as collective_rpc's positional args)."""


class NoArgs(RpcArgs):
    pass


class Names(RpcArgs):
    names: list[str]  # entries to fetch from a registry


class Name(RpcArgs):
    name: str


class Version(RpcArgs):
    version: int  # the registration being held (runtime SAEs under data parallelism)


class RegisterModule(RpcArgs):
    name: str
    version: int
    wire: dict  # core.payload.tiers_to_wire
    keys: list[str]  # the config keys of its phases
    policy: dict = {}  # replace, max_modules, meta: what the engine core's registry decides on and keeps


class StageModule(RpcArgs):
    """What the workers keep of a module the engine core's registry accepted."""

    name: str
    version: int
    wire: dict
    keys: list[str]


class ForgetModules(RpcArgs):
    versions: list[tuple[str, int]]  # (name, version) nothing can use any more


class StageSae(RpcArgs):
    """A runtime SAE's files and the reserved sites (``hook.layer``) it goes to, for the workers."""

    path: str
    format: str | None
    site: str | None
    features: list[int]
    sites: list[str]


class RegisterSae(StageSae):
    name: str
    version: int
    policy: dict  # replace, config

    @property
    def staged(self) -> StageSae:
        return StageSae(self.path, self.format, self.site, self.features, self.sites)


class HoldSae(RpcArgs):
    name: str
    version: int
    policy: dict
    sites: list[str]


class CapturePublish(RpcArgs):
    request_ids: list[str]


@dataclass(frozen=True)
class Method:
    args: type[RpcArgs]
    process: str  # ENGINE_CORE or WORKER
    doc: str


METHODS: dict[str, Method] = {
    "vllm_steer_metrics": Method(NoArgs, ENGINE_CORE, "a /metrics scrape: row gate + workers' status (engine.metrics_rpc)"),
    "vllm_steer_module_users": Method(NoArgs, ENGINE_CORE, "unfinished requests per named module"),
    "vllm_steer_sae_users": Method(NoArgs, ENGINE_CORE, "unfinished requests per runtime SAE name and site"),
    "vllm_steer_module_registry": Method(NoArgs, ENGINE_CORE, "the module registry's listing (name -> version)"),
    "vllm_steer_module_fetch": Method(Names, ENGINE_CORE, "modules' wire tiers and meta"),
    "vllm_steer_sae_registry": Method(NoArgs, ENGINE_CORE, "the SAE registry's listing"),
    "vllm_steer_sae_fetch": Method(Names, ENGINE_CORE, "runtime SAEs' registrations"),
    "vllm_steer_register_module": Method(RegisterModule, ENGINE_CORE, "decide a module registration, stage it"),
    "vllm_steer_unregister_module": Method(Name, ENGINE_CORE, "delete a module"),
    "vllm_steer_register_sae": Method(RegisterSae, ENGINE_CORE, "decide a runtime SAE registration, stage it"),
    "vllm_steer_sae_hold": Method(HoldSae, ENGINE_CORE, "hold an SAE's name and sites (data parallelism, step 1)"),
    "vllm_steer_sae_release": Method(Version, ENGINE_CORE, "release a hold"),
    "vllm_steer_unregister_sae": Method(Name, ENGINE_CORE, "delete a runtime SAE"),
    "vllm_steer_status": Method(NoArgs, WORKER, "a worker's pid, ops and row / capture counters"),
    "vllm_steer_capture_publish": Method(CapturePublish, WORKER, "end finished requests' capture now (capture.collect)"),
    "vllm_steer_stage_module": Method(StageModule, WORKER, "keep a module's tiers, materialize its rows"),
    "vllm_steer_forget_modules": Method(ForgetModules, WORKER, "drop module versions nothing uses"),
    "vllm_steer_stage_sae": Method(StageSae, WORKER, "stage a runtime SAE into reserved sites"),
}


prebuild(*{m.args for m in METHODS.values()})  # parse_args may first run on any thread of the answering process


class RpcArgsError(ValueError):
    pass


def call_args(args: RpcArgs) -> tuple:
    """The positional tuple ``collective_rpc`` carries for ``args``."""
    return msgspec.structs.astuple(args)


def parse_args(method: str, args: Any) -> RpcArgs:
    """``method``'s argument struct from the positional args it arrived with; RpcArgsError if they do not fit."""
    spec = METHODS[method]
    if isinstance(args, spec.args):
        return args
    try:
        return msgspec.convert(list(args or ()), spec.args)
    except (msgspec.ValidationError, TypeError) as e:
        raise RpcArgsError(f"{method}: arguments do not fit {spec.args.__name__}: {e}") from None


def methods_of(process: str) -> set[str]:
    return {name for name, m in METHODS.items() if m.process == process}
