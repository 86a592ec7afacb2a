"""Keeps this API process's module store equal to the engine core's registry, when several API server
processes serve one engine (``--api-server-count`` above 1, or data parallelism, whose default is one
API process per engine).

The engine core decides every registration (``vllm_steer.engine.module_registry``) and bumps a
shared generation counter (``core.shared_counter``). Before a request that names a module, and before
the module routes answer, ``refresh`` compares the counter with the generation this process last
pulled: one memory read when nothing changed. After a change, it pulls the registry's listing and
then only the modules whose version this process lacks. Without the counter (an engine on another
host), every refresh pulls the listing. Registrations and deletions of this process hold the same
lock, so a pull never undoes what they just published.

A request prepared just before another process deleted or replaced its module runs with the version
it named: workers keep every version they were sent (``runtime.modules``), as with one API process.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from vllm_steer.core.payload import tiers_from_wire
from vllm_steer.core.shared_counter import SharedCounter
from vllm_steer.frontend.module_store import STORE, SteeringModule

logger = logging.getLogger("vllm.steer")

Rpc = Callable[..., Awaitable[Any]]


def module_from_entry(name: str, entry: dict, hidden: int) -> SteeringModule:
    meta = entry.get("meta", {})
    return SteeringModule(name, tiers_from_wire(entry["wire"], hidden), meta.get("description", ""),
                          meta.get("source", "json"), meta.get("dtype", "float32"), entry["version"],
                          meta.get("created", 0.0))


class ModuleSync:
    def __init__(self) -> None:
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

    async def refresh(self, rpc: Rpc, hidden: int) -> None:
        if not self.stale():
            return
        async with self.lock:
            if self.stale():
                try:
                    await self._pull(rpc, hidden)
                except Exception as e:  # the engine is busy dying or restarting: keep what is cached
                    logger.warning("vllm-steer: could not read the engine's module registry (%s: %s)",
                                   type(e).__name__, e)

    async def _pull(self, rpc: Rpc, hidden: int) -> None:
        listing = (await rpc("vllm_steer_module_registry"))[0]
        if self.counter is None and listing.get("counter"):
            self.counter = SharedCounter.open(listing["counter"])
        versions: dict[str, int] = listing["versions"]
        missing = [n for n, v in versions.items() if (m := STORE.get(n)) is None or m.version != v]
        entries = (await rpc("vllm_steer_module_fetch", args=(missing,)))[0] if missing else {}
        fetched = {n: module_from_entry(n, e, hidden) for n, e in entries.items()}
        # a name deleted between the two calls is dropped, one replaced meanwhile taken as fetched
        current = {n: fetched[n].version if n in fetched else v for n, v in versions.items()
                   if n in fetched or n not in missing}
        STORE.sync(current, fetched)
        self.generation = listing["generation"]
        self.pulls += 1


MODULE_SYNC = ModuleSync()
