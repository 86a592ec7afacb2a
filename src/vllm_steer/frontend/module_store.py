"""Named steering modules in the API process: ``SteeringModule`` (name -> tiers, version, metadata),
this process's ``STORE`` of them (``frontend.named_store``) and ``MODULE_SYNC``, which keeps the store
equal to the engine core's registry when several API processes share it (``frontend.registry_sync``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.layout import config_hash
from vllm_steer.core.payload import tiers_from_wire
from vllm_steer.core.site_norms import Norms, as_json, parse_norms
from vllm_steer.core.vectors import TIER_FIELDS, Vectors, effective_phases
from vllm_steer.frontend.condition_spec import condition_summary
from vllm_steer.frontend.projection_spec import summary as projection_summary
from vllm_steer.frontend.named_store import NamedStore
from vllm_steer.frontend.registry_sync import RegistrySync


@dataclass
class SteeringModule:
    name: str
    tiers: dict[str, Vectors]
    description: str = ""
    source: str = "json"
    dtype: str = "float32"  # the model's: the keys name rows as its tables hold them
    version: int = 0
    created: float = field(default_factory=time.time)
    condition: dict | None = None  # its steering_condition as registered (frontend.condition_spec)
    projections: dict | None = None  # its projection fields as registered (frontend.projection_spec)
    site_norms: Norms | None = None  # typical residual norms its ``norm`` strength reads (frontend.site_norms)

    @property
    def has_vectors(self) -> bool:
        return any(self.tiers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the module's float32 vectors, all tiers (``summary()["bytes"]``)."""
        return sum(v.nbytes for t in self.tiers.values() for ls in t.values() for v in ls.values())

    @property
    def keys(self) -> tuple[str | None, str | None]:
        """(prefill key, decode key) at scale 1, as the model's tables hold the rows."""
        pre, dec = effective_phases({}, self.tiers, 1.0)
        return config_hash(pre, self.dtype), config_hash(dec, self.dtype)

    def sites(self) -> dict[str, list[str]]:
        """Per tier holding vectors, its sites (``hook.layer``), in hook then layer order."""
        return {t: [f"{h}.{l}" for h in sorted(v, key=HOOK_NAMES.index) for l in sorted(v[h])]
                for t in TIER_FIELDS if (v := self.tiers.get(t))}

    def summary(self) -> dict:
        hooks = sorted({h for t in self.tiers.values() for h in t})
        layers = sorted({l for t in self.tiers.values() for ls in t.values() for l in ls})
        return {"name": self.name, "description": self.description, "source": self.source,
                "version": self.version, "hooks": hooks, "layers": layers, "sites": self.sites(),
                "tiers": [t for t in TIER_FIELDS if self.tiers.get(t)], "dtype": "float32",
                "bytes": self.nbytes, "created": self.created, "condition": condition_summary(self.condition),
                "projections": projection_summary(self.projections),
                "site_norms": as_json(self.site_norms) if self.site_norms else None}


def module_from_entry(name: str, entry: dict, hidden: int) -> SteeringModule:
    """The module another API process registered, from the engine core's registry entry."""
    meta = entry.get("meta", {})
    norms = meta.get("site_norms")
    return SteeringModule(name, tiers_from_wire(entry["wire"], hidden), meta.get("description", ""),
                          meta.get("source", "json"), meta.get("dtype", "float32"), entry["version"],
                          meta.get("created", 0.0), meta.get("condition"), meta.get("projections"),
                          parse_norms(norms, "site_norms") if norms else None)


STORE: NamedStore[SteeringModule] = NamedStore()
MODULE_SYNC = RegistrySync("module", "module registry", STORE, module_from_entry)  # context: the hidden size
