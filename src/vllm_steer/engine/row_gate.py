"""Row capacity in the scheduler: a steered request waits, within a bound, until its configs fit.

The gate counts the distinct config keys of admitted requests (scheduled at least once and not
finished; a preempted request keeps its keys, so it can always resume). Nothing else holds a row:
a named module's pre-materialized rows are a cache the workers evict (least recently used) when a
request needs the row, never a reservation, so a request waits only for rows that running requests
hold. Steered requests are noted when they arrive; before each ``Scheduler.schedule`` that has any
waiting, the gate sets aside those whose new keys would exceed ``max_configs - 1`` rows (first come,
first served), and puts them back after. A request set aside for ``steer.max_row_wait_s`` (counted
from the first step that set it aside) during which no row turned over (no config became live or
stopped being live) is refused: the rows are stuck with long-running requests, and the scheduler
finishes it with an error the client sees (``engine.refusals``). While rows keep turning over (a
large batch of distinct configs) requests keep their place in the queue, as vLLM's own queue does.
Unsteered requests and requests whose keys are live pass. The worker's live rows are always a subset
of the admitted keys, so its allocator never runs out, and no request runs unsteered or on another's
row. With no steered request waiting the gate does nothing per step. Wired into vLLM's scheduler by
``engine.scheduler``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any


class RowGate:
    def __init__(self, capacity: int, max_wait_s: float = float("inf")) -> None:
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self._refs: Counter[str] = Counter()
        self._admitted: dict[str, tuple[str, ...]] = {}
        self.waiting: dict[str, tuple[str, ...]] = {}  # steered requests not admitted yet -> keys
        self._held_since: dict[str, float] = {}  # waiting requests set aside -> when first set aside
        self.wait_timeouts = 0  # requests refused after waiting max_wait_s for a row
        self._turnover = 0.0  # monotonic time a config last became live or stopped being live

    def arrive(self, req_id: str, keys: tuple[str, ...]) -> None:
        """A new request: steered ones wait for admission (unsteered ones never involve the gate)."""
        if keys and req_id not in self._admitted:
            self.waiting[req_id] = keys

    def admit_scheduled(self, req_ids: Any) -> None:
        """The scheduler started these requests: admit the steered ones among them."""
        for req_id in req_ids:
            keys = self.waiting.pop(req_id, None)
            if keys is not None:
                self._held_since.pop(req_id, None)
                self.admit(req_id, keys)

    @property
    def live_keys(self) -> int:
        return len(self._refs)

    def admit(self, req_id: str, keys: tuple[str, ...]) -> None:
        if req_id in self._admitted or not keys:
            return
        self._admitted[req_id] = keys
        if any(k not in self._refs for k in keys):
            self._turnover = time.monotonic()
        self._refs.update(keys)

    def release(self, req_id: str) -> None:
        self.waiting.pop(req_id, None)
        self._held_since.pop(req_id, None)
        keys = self._admitted.pop(req_id, None)
        if keys:
            self._refs.subtract(keys)
            for k in keys:
                if self._refs[k] <= 0:
                    del self._refs[k]
                    self._turnover = time.monotonic()

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

    def split_expired(self, held: list[Any], now: float) -> tuple[list[Any], list[Any]]:
        """(still waiting, waited ``max_wait_s`` with no row turning over meanwhile) of the requests
        set aside in this step."""
        keep, expired = [], []
        stuck = now - self._turnover >= self.max_wait_s
        for req in held:
            since = self._held_since.setdefault(req.request_id, now)
            (expired if stuck and now - since >= self.max_wait_s else keep).append(req)
        self.wait_timeouts += len(expired)
        return keep, expired

    def waited(self, req_id: str, now: float) -> float:
        """Seconds since the first step that set this request aside (0 if it never was)."""
        return now - self._held_since.get(req_id, now)
