"""Keeps an API process's store of one kind (``frontend.named_store``: steering modules, runtime SAEs)
equal to the engine core's registry of that kind, when several API server processes serve one engine
(``--api-server-count`` above 1, or data parallelism, whose default is one API process per engine).

The engine core decides every registration (``engine.module_registry``) and bumps the kind's shared
generation counter (``core.shared_counter``). Before a request that may name an entry, before the
kind's routes answer and before a registration, ``refresh`` compares the counter with the generation
this process last pulled: one memory read when nothing changed. After a change it pulls the registry's
listing (name -> version), then only the entries whose version this process lacks, and builds them
as the registering process did. Without the counter (an engine on another host) every refresh pulls.
Registrations and deletions of this process hold the same lock, so a pull never undoes what they
just published. A request prepared just before another process deleted or replaced a module runs
with the version it named (workers keep every version they were sent); runtime SAEs are checked
once more before a request leaves (``stale``, in ``frontend.prepare``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from vllm_steer.core.rpc import Names, call_args
from vllm_steer.core.shared_counter import SharedCounter
from vllm_steer.frontend.named_store import NamedStore

logger = logging.getLogger("vllm.steer")

Rpc = Callable[..., Awaitable[Any]]
Build = Callable[[str, dict, Any], Any]  # (name, the engine's fetched entry, context) -> store entry


class RegistrySync:
    def __init__(self, kind: str, what: str, store: NamedStore, build: Build) -> None:
        """``kind`` names the engine core's RPCs (``vllm_steer_<kind>_registry`` / ``_fetch``)."""
        self.kind, self.what, self.store, self.build = kind, what, store, build
        self.enabled = False  # set at server start: more than one API process shares the engine
        self.generation: int | None = None
        self.counter: SharedCounter | None = None
        self._lock: asyncio.Lock | None = None
        self.pulls = 0

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def stale(self) -> bool:
        return self.enabled and (self.counter is None or self.counter.value != self.generation)

    async def refresh(self, rpc: Rpc, context: Any) -> None:
        if not self.stale():
            return
        async with self.lock:
            await self.refresh_locked(rpc, context)

    async def refresh_locked(self, rpc: Rpc, context: Any) -> None:
        """``refresh`` for a caller that holds ``lock`` (a registration of this process)."""
        if not self.stale():
            return
        try:
            await self.pull(rpc, context)
        except Exception as e:  # the engine is busy dying or restarting: keep what is cached
            logger.warning("vllm-steer: could not read the engine's %s (%s: %s)", self.what, type(e).__name__, e)

    def adopt(self, listing: dict) -> None:
        """Open the registry's counter (first pull) and take its generation (after a pull)."""
        if self.counter is None and listing.get("counter"):
            self.counter = SharedCounter.open(listing["counter"])
        self.generation = listing["generation"]
        self.pulls += 1

    async def pull(self, rpc: Rpc, context: Any) -> None:
        listing = (await rpc(f"vllm_steer_{self.kind}_registry"))[0]
        versions: dict[str, int] = listing["versions"]
        missing = self.store.stale_names(versions)
        entries = (await rpc(f"vllm_steer_{self.kind}_fetch", args=call_args(Names(list(missing)))))[0] if missing else {}
        fetched = {n: self.build(n, e, context) for n, e in entries.items()}
        # a name deleted between the two calls is dropped, one replaced meanwhile taken as fetched
        current = {n: fetched[n].version if n in fetched else v for n, v in versions.items()
                   if n in fetched or n not in missing}
        self.store.sync(current, fetched)
        self.adopt(listing)
