"""Worker-side named modules: their float32 tiers by (name, version), and the rows they pin.

Registration pre-materializes the module's scale-1 rows (so the first request pays nothing) and
pins them while the module exists. A request that references a module ships only
``{name, version, scale}`` and its keys; the worker builds a missing row from the tiers here with
the same arithmetic the front end hashed. Versions are kept after delete/replace (a request
admitted before the change may still arrive), so a request never mixes two versions.
"""

from __future__ import annotations

from vllm_steer.core.vectors import Vectors, effective_phases


class WorkerModules:
    def __init__(self) -> None:
        self._tiers: dict[tuple[str, int], dict[str, Vectors]] = {}
        self.pinned: dict[str, tuple[str, ...]] = {}  # module name -> keys pinned for it

    def add(self, name: str, version: int, tiers: dict[str, Vectors]) -> None:
        self._tiers[(name, version)] = tiers

    def phases(self, name: str, version: int, scale: float, inline: dict[str, Vectors] | None = None) -> tuple[Vectors, Vectors]:
        tiers = self._tiers.get((name, version))
        if tiers is None:
            raise KeyError(f"steering module {name!r} version {version} was never registered on this worker")
        return effective_phases(inline or {}, tiers, scale)
