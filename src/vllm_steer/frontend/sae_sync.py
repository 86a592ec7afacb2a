"""Keeps this API process's runtime SAEs equal to the engine core's SAE registry, when several API
server processes serve one engine (``--api-server-count`` above 1).

The engine core decides every runtime SAE registration and deletion (``engine.module_rpc``, its
registry ``engine.module_registry``) and bumps the registry's shared generation counter. Before a
request that may name an SAE, before the SAE routes answer and before a registration, ``refresh``
compares the counter with the generation this process last pulled (one memory read when nothing
changed); after a change it pulls the listing, then the registration fields of the SAEs whose version
this process lacks, and builds their catalog entries from the files' headers, as the registering
process did. Registrations of this process hold the same lock, so a pull never undoes them.

``stale()`` is also the last check before a request leaves for the engine core
(``frontend.prepare``, in ``process_inputs``): a request naming a runtime SAE is refused (400, send it again) if any SAE
registration changed after this process last pulled, so it never reaches the engine against a
registration another process replaced.
"""

from __future__ import annotations

from typing import Any

from vllm_steer.core.config import SaeModuleConfig
from vllm_steer.core.sae_catalog import SaeEntry, runtime_entry
from vllm_steer.frontend.registry_sync import RegistrySync, Rpc
from vllm_steer.frontend.sae_registry import REGISTRY


def entry_from_wire(frontend: Any, name: str, wire: dict) -> SaeEntry:
    """The catalog entry of a runtime SAE another process registered (its files' headers read here)."""
    shape = frontend.shape
    return runtime_entry(name, SaeModuleConfig.model_validate(wire["wire"]), frontend.cfg, shape.hidden_size,
                         shape.num_layers, frontend.sae_slots, wire["version"])


class SaeSync(RegistrySync):
    what = "SAE registry"

    async def pull(self, rpc: Rpc, frontend: Any) -> None:
        listing = (await rpc("vllm_steer_sae_registry"))[0]
        versions: dict[str, int] = listing["versions"]
        missing = [n for n, v in versions.items() if (e := REGISTRY.entries.get(n)) is None or e.version != v]
        fetched = (await rpc("vllm_steer_sae_fetch", args=(missing,)))[0] if missing else {}
        built = {n: entry_from_wire(frontend, n, w) for n, w in fetched.items()}
        # a name deleted between the two calls is dropped, one replaced meanwhile taken as fetched
        REGISTRY.entries = {n: built[n] if n in built else REGISTRY.entries[n] for n in versions
                            if n in built or n not in missing}
        self.adopt(listing)


SAE_SYNC = SaeSync()
