"""API-side registry of named modules (one per API process) and the tier <-> bytes codec used to
ship a module to the workers once, through ``collective_rpc``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from vllm_steer.hashing import config_hash
from vllm_steer.spec import TIER_FIELDS, Vectors, effective_phases


class ModuleExistsError(KeyError):
    pass


@dataclass
class SteeringModule:
    name: str
    tiers: dict[str, Vectors]
    description: str = ""
    source: str = "json"
    version: int = 0
    created: float = field(default_factory=time.time)

    @property
    def keys(self) -> tuple[str | None, str | None]:
        """(prefill key, decode key) at scale 1."""
        pre, dec = effective_phases({}, self.tiers, 1.0)
        return config_hash(pre), config_hash(dec)

    def summary(self) -> dict:
        hooks = sorted({h for t in self.tiers.values() for h in t})
        layers = sorted({l for t in self.tiers.values() for ls in t.values() for l in ls})
        nbytes = sum(v.nbytes for t in self.tiers.values() for ls in t.values() for v in ls.values())
        return {"name": self.name, "description": self.description, "source": self.source,
                "version": self.version, "hooks": hooks, "layers": layers,
                "tiers": [t for t in TIER_FIELDS if self.tiers.get(t)], "dtype": "float32",
                "bytes": nbytes, "created": self.created}


class ModuleStore:
    def __init__(self) -> None:
        self._modules: dict[str, SteeringModule] = {}
        self._lock = threading.Lock()
        self._next_version = 1

    def reserve_version(self) -> int:
        with self._lock:
            v = self._next_version
            self._next_version += 1
            return v

    def publish(self, module: SteeringModule) -> SteeringModule:
        with self._lock:
            self._modules[module.name] = module
            return module

    def get(self, name: str) -> SteeringModule | None:
        return self._modules.get(name)

    def remove(self, name: str) -> SteeringModule:
        with self._lock:
            return self._modules.pop(name)

    def all(self) -> list[SteeringModule]:
        return sorted(self._modules.values(), key=lambda m: m.name)


STORE = ModuleStore()


def tiers_to_wire(tiers: dict[str, Vectors]) -> dict:
    """Tiers as {tier: {hook: [layers, float32 bytes]}}: plain types for collective_rpc."""
    out: dict = {}
    for tier, hooks in tiers.items():
        for hook, layers in hooks.items():
            ids = sorted(layers)
            arr = np.stack([layers[i] for i in ids]).astype(np.float32)
            out.setdefault(tier, {})[hook] = [ids, arr.tobytes()]
    return out


def tiers_from_wire(wire: dict, hidden: int) -> dict[str, Vectors]:
    out: dict[str, Vectors] = {}
    for tier, hooks in wire.items():
        for hook, (ids, raw) in hooks.items():
            arr = np.frombuffer(raw, dtype=np.float32).reshape(len(ids), hidden)
            out.setdefault(tier, {})[hook] = {int(l): arr[i] for i, l in enumerate(ids)}
    return out
