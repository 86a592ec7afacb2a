"""Keeps this API process's module store equal to the engine core's registry, when several API server
processes serve one engine (``--api-server-count`` above 1, or data parallelism, whose default is one
API process per engine).

The engine core decides every registration (``vllm_steer.engine.module_registry``) and bumps a
shared generation counter (``core.shared_counter``). Before a request that names a module, and before
the module routes answer, ``refresh`` compares the counter with the generation this process last
pulled: one memory read when nothing changed. After a change, it pulls the registry's listing and
then only the modules whose version this process lacks. Without the counter (an engine on another
host), every refresh pulls the listing. Registrations and deletions of this process hold the same
lock, so a pull never undoes what they just published.

A request prepared just before another process deleted or replaced its module runs with the version
it named: workers keep every version they were sent (``runtime.modules``), as with one API process.
"""

from __future__ import annotations

from vllm_steer.core.payload import tiers_from_wire
from vllm_steer.frontend.module_store import STORE, SteeringModule
from vllm_steer.frontend.registry_sync import RegistrySync, Rpc


def module_from_entry(name: str, entry: dict, hidden: int) -> SteeringModule:
    meta = entry.get("meta", {})
    return SteeringModule(name, tiers_from_wire(entry["wire"], hidden), meta.get("description", ""),
                          meta.get("source", "json"), meta.get("dtype", "float32"), entry["version"],
                          meta.get("created", 0.0), meta.get("condition"))


class ModuleSync(RegistrySync):
    what = "module registry"

    async def pull(self, rpc: Rpc, hidden: int) -> None:
        listing = (await rpc("vllm_steer_module_registry"))[0]
        versions: dict[str, int] = listing["versions"]
        missing = [n for n, v in versions.items() if (m := STORE.get(n)) is None or m.version != v]
        entries = (await rpc("vllm_steer_module_fetch", args=(missing,)))[0] if missing else {}
        fetched = {n: module_from_entry(n, e, hidden) for n, e in entries.items()}
        # a name deleted between the two calls is dropped, one replaced meanwhile taken as fetched
        current = {n: fetched[n].version if n in fetched else v for n, v in versions.items()
                   if n in fetched or n not in missing}
        STORE.sync(current, fetched)
        self.adopt(listing)


MODULE_SYNC = ModuleSync()
