"""API-side store of named modules, per API process: name -> tiers, version, metadata.

With one API server it is the registry (every registration passes through it). With several, the
engine core's registry (``vllm_steer.engine.module_registry``) is the one they share and decides
each registration; this store is the process's cache of it, brought up to date by
``frontend.module_sync`` when the registry's generation moves. Versions are unique over every
process: microseconds since the epoch, strictly increasing per process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from vllm_steer.core.layout import config_hash
from vllm_steer.core.versions import VersionClock
from vllm_steer.core.vectors import TIER_FIELDS, Vectors, effective_phases
from vllm_steer.frontend.condition_spec import condition_summary


class ModuleExistsError(KeyError):
    pass


class ModuleLimitError(Exception):
    """The store holds ``steer.max_modules`` names (published or being registered)."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


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

    @property
    def nbytes(self) -> int:
        """Bytes of the module's float32 vectors, all tiers (``summary()["bytes"]``)."""
        return sum(v.nbytes for t in self.tiers.values() for ls in t.values() for v in ls.values())

    @property
    def keys(self) -> tuple[str | None, str | None]:
        """(prefill key, decode key) at scale 1, as the model's tables hold the rows."""
        pre, dec = effective_phases({}, self.tiers, 1.0)
        return config_hash(pre, self.dtype), config_hash(dec, self.dtype)

    def summary(self) -> dict:
        hooks = sorted({h for t in self.tiers.values() for h in t})
        layers = sorted({l for t in self.tiers.values() for ls in t.values() for l in ls})
        return {"name": self.name, "description": self.description, "source": self.source,
                "version": self.version, "hooks": hooks, "layers": layers,
                "tiers": [t for t in TIER_FIELDS if self.tiers.get(t)], "dtype": "float32",
                "bytes": self.nbytes, "created": self.created, "condition": condition_summary(self.condition)}


class ModuleStore:
    def __init__(self) -> None:
        self._modules: dict[str, SteeringModule] = {}
        self._lock = threading.Lock()
        self._versions = VersionClock()
        self._claimed: dict[str, int] = {}  # names being registered -> registrations in flight

    def claim(self, name: str, replace: bool, max_modules: int | None = None) -> None:
        """Reserve ``name`` for a registration in flight (``publish`` or ``unclaim`` ends it):
        ModuleExistsError when the name is taken (published or in flight) and not ``replace``;
        ModuleLimitError when it is new and ``max_modules`` names are taken."""
        with self._lock:
            taken = name in self._modules or name in self._claimed
            if taken and not replace:
                raise ModuleExistsError(name)
            if not taken and max_modules is not None and len(self._modules.keys() | self._claimed.keys()) >= max_modules:
                raise ModuleLimitError(max_modules)
            self._claimed[name] = self._claimed.get(name, 0) + 1

    def unclaim(self, name: str) -> None:
        with self._lock:
            self._unclaim(name)

    def _unclaim(self, name: str) -> None:
        n = self._claimed.pop(name, 0) - 1
        if n > 0:
            self._claimed[name] = n

    def reserve_version(self) -> int:
        return self._versions.next()

    def publish(self, module: SteeringModule) -> SteeringModule:
        with self._lock:
            self._modules[module.name] = module
            self._unclaim(module.name)
            return module

    def get(self, name: str) -> SteeringModule | None:
        return self._modules.get(name)

    def drop(self, name: str) -> SteeringModule | None:
        with self._lock:
            return self._modules.pop(name, None)

    def sync(self, versions: dict[str, int], fetched: dict[str, SteeringModule]) -> None:
        """Make the published modules the registry's: ``versions`` name -> current version, and
        ``fetched`` the modules this store did not hold at that version."""
        with self._lock:
            for name in [n for n in self._modules if n not in versions]:
                del self._modules[name]
            for name, version in versions.items():
                held = self._modules.get(name)
                if held is None or held.version != version:
                    self._modules[name] = fetched[name]

    def all(self) -> list[SteeringModule]:
        return sorted(self._modules.values(), key=lambda m: m.name)


STORE = ModuleStore()
