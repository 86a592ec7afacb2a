"""What the API process's caches of the engine core's registries share (``frontend.module_sync`` for
named modules, ``frontend.sae_sync`` for runtime SAEs): on only with several API processes, stale when
the registry's shared generation counter moved past the generation last pulled (one memory read),
one pull at a time under a lock that this process's own registrations also hold."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from vllm_steer.core.shared_counter import SharedCounter

logger = logging.getLogger("vllm.steer")

Rpc = Callable[..., Awaitable[Any]]


class RegistrySync:
    what = "registry"  # for the log line

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
        raise NotImplementedError
