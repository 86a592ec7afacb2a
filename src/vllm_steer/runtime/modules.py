"""Worker-side named modules: their float32 tiers by (name, version).

Registration pre-materializes the module's scale-1 rows into the row cache (so the first request
usually pays nothing; the rows may be evicted like any released row). A request that references a
module ships only ``{name, version, scale}`` (and a layer / hook selection, if any) and its keys; the worker builds a missing row from the
tiers here with the same arithmetic the front end hashed. Versions are kept after delete/replace
while a request admitted before the change may still use them, and forgotten when the engine core
says none can (``engine.module_registry.retire``), so a request never mixes two versions and memory
stays bounded.
"""

from __future__ import annotations

from vllm_steer.core.vectors import Vectors, effective_phases, selected


class WorkerModules:
    def __init__(self) -> None:
        self._tiers: dict[tuple[str, int], dict[str, Vectors]] = {}

    def add(self, name: str, version: int, tiers: dict[str, Vectors]) -> None:
        self._tiers[(name, version)] = tiers

    def forget(self, versions: list) -> None:
        for name, version in versions:
            self._tiers.pop((name, version), None)

    def __len__(self) -> int:
        return len(self._tiers)

    def phases(self, name: str, version: int, scale: float, inline: dict[str, Vectors] | None = None,
               layers: list[int] | None = None, hooks: list[str] | None = None) -> tuple[Vectors, Vectors]:
        """The effective phases of a reference: the module's tiers (cut to ``layers`` / ``hooks``) x scale."""
        tiers = self._tiers.get((name, version))
        if tiers is None:
            raise KeyError(f"steering module {name!r} version {version} was never registered on this worker")
        return effective_phases(inline or {}, selected(tiers, layers, hooks), scale)
