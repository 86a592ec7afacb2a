"""This API process's view of the SAEs registered while the server runs: name -> catalog entry, the
reserved sites they hold, and the check that a prepared request still names the registration it was
prepared against (a request prepared just before its SAE was deleted or replaced is refused with a
400, never run with the new weights). The engine core's registry decides registrations; with several
API processes this one is a cache kept by ``frontend.sae_sync``."""

from __future__ import annotations

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import SaeEntry, Site
from vllm_steer.core.versions import VersionClock
from vllm_steer.core.vectors import SAE_FIELD

VERSIONS_KEY = "sae_versions"  # payload key: runtime SAE name -> the registration a request used


class SaeRegistry:
    def __init__(self) -> None:
        self.entries: dict[str, SaeEntry] = {}
        self.pending: set[Site] = set()  # sites of registrations on their way to the workers
        self._versions = VersionClock()

    def next_version(self) -> int:
        """A registration number no API process of this server hands out twice (core.versions): it is
        also the version the engine core records."""
        return self._versions.next()

    def holder(self, site: Site) -> str | None:
        """The runtime SAE at ``site`` (or ``"(registering)"`` while one is on its way)."""
        for name, e in self.entries.items():
            if site in e.sites:
                return name
        return "(registering)" if site in self.pending else None

    def check_current(self, payload: dict | None, changed: bool = False) -> None:
        """SteeringSpecError unless every runtime SAE a prepared payload names is still the
        registration it was prepared against (``changed``: another process changed the registry
        after this one last read it, so this process cannot tell)."""
        for name, version in ((payload or {}).get(VERSIONS_KEY) or {}).items():
            entry = self.entries.get(name)
            if changed or entry is None or entry.version != version:
                raise SteeringSpecError(f"{SAE_FIELD}.name", f"SAE {name!r} was deleted or replaced while this "
                                                             "request was being prepared; send it again")


REGISTRY = SaeRegistry()
