"""The SAEs registered while the server runs (one registry per API process, like named modules):
name -> catalog entry, the reserved sites they hold, and the check that a prepared request still
names the registration it was prepared against (a request prepared just before its SAE was deleted
or replaced is refused with a 400, never run with the new weights)."""

from __future__ import annotations

import threading

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import SaeEntry, Site
from vllm_steer.core.vectors import SAE_FIELD

VERSIONS_KEY = "sae_versions"  # payload key: runtime SAE name -> the registration a request used


class SaeRegistry:
    def __init__(self) -> None:
        self.entries: dict[str, SaeEntry] = {}
        self.pending: set[Site] = set()  # sites of registrations on their way to the workers
        self.lock = threading.Lock()
        self._next_version = 1

    def next_version(self) -> int:
        with self.lock:
            v = self._next_version
            self._next_version += 1
            return v

    def holder(self, site: Site) -> str | None:
        """The runtime SAE at ``site`` (or ``"(registering)"`` while one is on its way)."""
        for name, e in self.entries.items():
            if site in e.sites:
                return name
        return "(registering)" if site in self.pending else None

    def check_current(self, payload: dict | None) -> None:
        """SteeringSpecError unless every runtime SAE a prepared payload names is still the
        registration it was prepared against."""
        for name, version in ((payload or {}).get(VERSIONS_KEY) or {}).items():
            entry = self.entries.get(name)
            if entry is None or entry.version != version:
                raise SteeringSpecError(f"{SAE_FIELD}.name", f"SAE {name!r} was deleted or replaced while this "
                                                             "request was being prepared; send it again")


REGISTRY = SaeRegistry()
