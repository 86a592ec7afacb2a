"""The engine core's registries of named modules and of runtime SAEs: the ones every API server
process reads.

Registrations and deletions pass through ``EngineCore.collective_rpc`` on their way to the workers
(``engine.module_rpc``), and these registries decide them there. The engine core runs one call at a
time, so decisions never race each other, whichever API process asked. A name that exists without
``replace``, a new name beyond ``max_modules`` and a version not newer than the name's current one
are refused before any worker hears of them. What was accepted is kept as the workers got it (wire
tiers and the summary fields; an SAE's registration fields and sites), for API processes to fetch. A
generation number in a shared counter (``core.shared_counter``), one per registry, tells them that
their cache (``frontend.registry_sync``) is stale.

The workers keep every version of a module they were sent while a request may still build its rows
from it (a request admitted before a replace or delete keeps its version). ``sent`` lists those
versions; ``retire`` names the ones no current entry and no unfinished request uses any more, for
the workers to forget, so replacing and deleting modules never grows their memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm_steer.core.shared_counter import SharedCounter

KINDS = ("modules", "sae")
HOLD_SECONDS = 120.0  # a hold whose registration never came (its API process died) stops counting then


@dataclass
class _Entry:
    version: int
    wire: dict
    meta: dict


class EngineModuleRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        try:
            self._counter: SharedCounter | None = SharedCounter.create()
        except OSError:  # no writable temp dir: API processes ask on every module request instead
            self._counter = None
        self.generation = 0
        self._holds: dict[int, tuple[str, frozenset[str], float]] = {}  # version -> (name, sites, since)
        self.sent: set[tuple[str, int]] = set()  # (name, version) the workers hold

    def refusal(self, name: str, version: int, policy: dict) -> dict | None:
        """Why a registration may not go ahead (None: it may)."""
        old = self._entries.get(name)
        if old is not None and not policy.get("replace"):
            return {"refused": "exists"}
        limit = policy.get("max_modules")
        if old is None and limit is not None and len(self._entries) >= limit:
            return {"refused": "limit", "limit": limit}
        if old is not None and version <= old.version:
            return {"refused": "stale", "current": old.version}
        return None

    def hold(self, name: str, version: int, sites: list[str]) -> None:
        """Keep ``name`` and ``sites`` for the registration ``version`` (data parallelism: every engine
        agrees first, then each records it) until it is recorded or released."""
        self._holds[version] = (name, frozenset(sites), time.monotonic())

    def release(self, version: int) -> None:
        self._holds.pop(version, None)

    def held_by_another(self, name: str, version: int, sites: list[str]) -> dict | None:
        """A live hold of another registration on ``name`` or one of ``sites`` (None: there is none)."""
        now = time.monotonic()
        for v, (n, held, since) in list(self._holds.items()):
            if now - since > HOLD_SECONDS:
                del self._holds[v]
            elif v != version and (n == name or held & set(sites)):
                return {"refused": "pending", "holder": n}
        return None

    def record(self, name: str, version: int, wire: dict, meta: dict) -> None:
        self._holds.pop(version, None)
        self._entries[name] = _Entry(version, wire, meta)
        self.sent.add((name, version))
        self._changed()

    def current(self, name: str) -> int | None:
        """The version registered under ``name`` now (None: none)."""
        entry = self._entries.get(name)
        return entry.version if entry is not None else None

    def holds(self, name: str, version: int) -> bool:
        """Whether the workers still hold this version (its rows can be built)."""
        return (name, version) in self.sent

    def retire(self, in_use: set[tuple[str, int]]) -> list[tuple[str, int]]:
        """Versions the workers may forget now: neither current nor used by an unfinished request."""
        current = {(n, e.version) for n, e in self._entries.items()}
        gone = sorted(self.sent - current - in_use)
        self.sent.difference_update(gone)
        return gone

    def remove(self, name: str) -> bool:
        if self._entries.pop(name, None) is None:
            return False
        self._changed()
        return True

    def _changed(self) -> None:
        self.generation += 1
        if self._counter is not None:
            self._counter.bump()

    def listing(self) -> dict[str, Any]:
        """The generation, the shared counter's file and each name's current version."""
        return {"generation": self.generation, "counter": self._counter.path if self._counter else None,
                "versions": {name: e.version for name, e in self._entries.items()}}

    def holder(self, site: str) -> str | None:
        """The name whose ``meta["sites"]`` has ``site`` (runtime SAEs: one per reserved site)."""
        return next((n for n, e in self._entries.items() if site in e.meta.get("sites", ())), None)

    def fetch(self, names: list[str]) -> dict[str, dict]:
        return {n: {"version": e.version, "wire": e.wire, "meta": e.meta}
                for n in names if (e := self._entries.get(n)) is not None}


def registry_of(core: Any, kind: str = "modules") -> EngineModuleRegistry:
    """The engine core's registry of ``kind`` (``modules`` or ``sae``), made on first use; kept on its
    scheduler (``core`` may be the EngineCore or the Scheduler), which checks requests against it."""
    assert kind in KINDS
    holder = getattr(core, "scheduler", core)
    attr = f"_vllm_steer_registry_{kind}"
    registry = getattr(holder, attr, None)
    if registry is None:
        registry = EngineModuleRegistry()
        setattr(holder, attr, registry)
    return registry
