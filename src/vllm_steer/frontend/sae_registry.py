"""This API process's view of the SAEs registered while the server runs: name -> catalog entry, the
reserved sites they hold, and the check that a prepared request still names the registration it was
prepared against (a request prepared just before its SAE was deleted or replaced is refused with a
400, never run with the new weights). The engine core's registry decides registrations; with several
API processes this store is its cache, kept by ``SAE_SYNC`` (``frontend.registry_sync``), which builds
the catalog entries of SAEs other processes registered from their files' headers.

``SAE_SYNC.stale()`` is also the last check before a request leaves for the engine core
(``frontend.prepare``, in ``process_inputs``): a request naming a runtime SAE is refused (400, send it
again) if any SAE registration changed after this process last pulled."""

from __future__ import annotations

from typing import Any

from vllm_steer.core.config import SaeModuleConfig
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.payload import SteerPayload
from vllm_steer.core.sae_catalog import SaeEntry, Site, runtime_entry
from vllm_steer.core.vectors import SAE_FIELD
from vllm_steer.frontend.named_store import NamedStore
from vllm_steer.frontend.registry_sync import RegistrySync


class SaeRegistry(NamedStore[SaeEntry]):
    def __init__(self) -> None:
        super().__init__()
        self.pending: set[Site] = set()  # sites of registrations on their way to the workers

    def holder(self, site: Site) -> str | None:
        """The runtime SAE at ``site`` (or ``"(registering)"`` while one is on its way)."""
        for name, e in self.entries.items():
            if site in e.sites:
                return name
        return "(registering)" if site in self.pending else None

    def check_current(self, payload: SteerPayload | None, changed: bool = False) -> None:
        """SteeringSpecError unless every runtime SAE a prepared payload names is still the
        registration it was prepared against (``changed``: another process changed the registry
        after this one last read it, so this process cannot tell)."""
        for name, version in ((payload.sae_versions if payload is not None else None) or {}).items():
            entry = self.entries.get(name)
            if changed or entry is None or entry.version != version:
                raise SteeringSpecError(f"{SAE_FIELD}.name", f"SAE {name!r} was deleted or replaced while this "
                                                             "request was being prepared; send it again")


def entry_from_wire(name: str, wire: dict, frontend: Any) -> SaeEntry:
    """The catalog entry of a runtime SAE another process registered (its files' headers read here)."""
    shape = frontend.shape
    return runtime_entry(name, SaeModuleConfig.model_validate(wire["wire"]), frontend.cfg, shape.hidden_size,
                         shape.num_layers, frontend.sae_slots, wire["version"])


REGISTRY = SaeRegistry()
SAE_SYNC = RegistrySync("sae", "SAE registry", REGISTRY, entry_from_wire)  # context: the SteeringFrontend
