"""This API process's store of one kind of named resource registered while the server runs (steering
modules, runtime SAEs): name -> entry (anything with ``name`` and ``version``), the names claimed by
registrations in flight, and the version clock. The engine core's registry of the same kind
(``engine.module_registry``) decides every registration; with several API processes this store is
that registry's cache, kept by the kind's ``RegistrySync`` (``frontend.registry_sync``). Versions are
unique over every process (``core.versions``): microseconds since the epoch, increasing per process."""

from __future__ import annotations

import threading
from typing import Generic, Protocol, TypeVar

from vllm_steer.core.versions import VersionClock


class Named(Protocol):
    name: str
    version: int


E = TypeVar("E", bound=Named)


class NameTakenError(KeyError):
    """The name is registered or being registered, and the registration does not replace it (409)."""


class NameLimitError(Exception):
    """The store holds its limit of names, published or being registered (409)."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


class NamedStore(Generic[E]):
    def __init__(self) -> None:
        self.entries: dict[str, E] = {}
        self._lock = threading.Lock()
        self._versions = VersionClock()
        self._claimed: dict[str, int] = {}  # names being registered -> registrations in flight

    def next_version(self) -> int:
        """A registration number no API process of this server hands out twice; the engine core
        records it as the entry's version."""
        return self._versions.next()

    def claim(self, name: str, replace: bool, limit: int | None = None) -> None:
        """Reserve ``name`` for a registration in flight (``publish`` or ``unclaim`` ends it):
        NameTakenError when the name is taken (published or in flight) and not ``replace``;
        NameLimitError when it is new and ``limit`` names are taken."""
        with self._lock:
            taken = name in self.entries or name in self._claimed
            if taken and not replace:
                raise NameTakenError(name)
            if not taken and limit is not None and len(self.entries.keys() | self._claimed.keys()) >= limit:
                raise NameLimitError(limit)
            self._claimed[name] = self._claimed.get(name, 0) + 1

    def unclaim(self, name: str) -> None:
        with self._lock:
            self._unclaim(name)

    def _unclaim(self, name: str) -> None:
        n = self._claimed.pop(name, 0) - 1
        if n > 0:
            self._claimed[name] = n

    def publish(self, entry: E) -> E:
        with self._lock:
            self.entries[entry.name] = entry
            self._unclaim(entry.name)
            return entry

    def get(self, name: str) -> E | None:
        return self.entries.get(name)

    def drop(self, name: str) -> E | None:
        with self._lock:
            return self.entries.pop(name, None)

    def stale_names(self, versions: dict[str, int]) -> list[str]:
        """The names of the registry's listing (name -> version) this store lacks at that version."""
        return [n for n, v in versions.items() if (e := self.entries.get(n)) is None or e.version != v]

    def sync(self, versions: dict[str, int], fetched: dict[str, E]) -> None:
        """Make the published entries the registry's: ``versions`` name -> current version, and
        ``fetched`` the entries this store did not hold at that version."""
        with self._lock:
            for name in [n for n in self.entries if n not in versions]:
                del self.entries[name]
            for name, version in versions.items():
                held = self.entries.get(name)
                if held is None or held.version != version:
                    self.entries[name] = fetched[name]

    def all(self) -> list[E]:
        return sorted(self.entries.values(), key=lambda e: e.name)
