"""Strict row capacity in the scheduler: a steered request waits until its configs fit the tables.

The gate counts the distinct config keys of admitted requests (scheduled at least once and not
finished; a preempted request keeps its keys, so it can always resume). Steered requests are noted
when they arrive; before each ``Scheduler.schedule`` that has any waiting, the gate sets aside
those whose new keys would exceed ``max_configs - 1`` rows (first come, first served), and puts
them back after; unsteered requests and requests whose keys are already live pass. The worker's
live rows are always a subset of the admitted keys, so its allocator never runs out, and no
request runs unsteered or on another's row. With no steered request waiting the gate does nothing
per step. Wired into vLLM's scheduler by ``engine.scheduler``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class RowGate:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._refs: Counter[str] = Counter()
        self._admitted: dict[str, tuple[str, ...]] = {}
        self.waiting: dict[str, tuple[str, ...]] = {}  # steered requests not admitted yet -> keys

    def arrive(self, req_id: str, keys: tuple[str, ...]) -> None:
        """A new request: steered ones wait for admission (unsteered ones never involve the gate)."""
        if keys and req_id not in self._admitted:
            self.waiting[req_id] = keys

    def admit_scheduled(self, req_ids: Any) -> None:
        """The scheduler started these requests: admit the steered ones among them."""
        for req_id in req_ids:
            keys = self.waiting.pop(req_id, None)
            if keys is not None:
                self.admit(req_id, keys)

    @property
    def live_keys(self) -> int:
        return len(self._refs)

    def admit(self, req_id: str, keys: tuple[str, ...]) -> None:
        if req_id in self._admitted or not keys:
            return
        self._admitted[req_id] = keys
        self._refs.update(keys)

    def release(self, req_id: str) -> None:
        self.waiting.pop(req_id, None)
        keys = self._admitted.pop(req_id, None)
        if keys:
            self._refs.subtract(keys)
            for k in keys:
                if self._refs[k] <= 0:
                    del self._refs[k]

    def try_pin(self, name: str, keys: tuple[str, ...]) -> bool:
        """Reserve rows for a module's pre-materialized configs, if they fit (best effort)."""
        self.unpin(name)
        new = {k for k in keys if k not in self._refs}
        if len(self._refs) + len(new) > self.capacity:
            return False
        self.admit(_pin_id(name), tuple(keys))
        return True

    def unpin(self, name: str) -> None:
        self.release(_pin_id(name))

    def select_held(self, requests: list[Any]) -> list[Any]:
        """Requests (in queue order) that cannot be admitted now."""
        tentative: set[str] = set()
        held = []
        for req in requests:
            keys = self.waiting.get(req.request_id)
            if keys is None:  # unsteered, or already admitted (e.g. preempted)
                continue
            new = {k for k in keys if k not in self._refs and k not in tentative}
            if not new:
                continue
            if len(self._refs) + len(tentative) + len(new) <= self.capacity:
                tentative |= new
            else:
                held.append(req)
        return held


def _pin_id(name: str) -> str:
    return f"\0module:{name}"  # cannot collide with a request id
