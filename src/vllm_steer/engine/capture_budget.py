"""Capture rows per step in the scheduler: capturing prefills are chunked so a step's captured cells fit
the workers' pool (``steer.capture_max_rows``) instead of being dropped.

Each capturing request arrives with its cost (``SteerPayload.capture_rows``: pool rows one token takes in
each position class, counted by the front end, ``frontend.capture_rows``). Before a step, while any such
request is unfinished, ``token_cap`` adds up what the step can ask of the pool: one token's rows for every
capturing request past its prompt (decode; speculative tokens counted), and, for those still in their prompt,
their remaining prompt tokens at the widest of their prompt classes (a prompt token of any class costs at most
that). When that fits, nothing changes. When it does not, the step's token budget
(``Scheduler.max_num_scheduled_tokens``, read by ``schedule`` and restored after it) becomes the running decodes
plus the prompt tokens the room left by the decodes holds at the widest capturing prompt's cost: every prefill of
that step shares that budget (vLLM chunks prefills to its budget), so capturing prefills take a few steps more
instead of losing rows. At least one prompt token a step always goes through (a step's cells can then exceed the
pool by one token's rows: dropped and counted as before, ``dropped_rows``). Steps so capped are counted
(``throttled_steps``, on /metrics as ``vllm_steer_capture_throttled_steps_total``).

Decode cells are not chunked: a batch whose capturing decodes alone want more rows than the pool holds still
drops rows (counted); ``steer.capture_max_rows`` is the operator's knob. With no capturing request the
scheduler does nothing per step here (the dict is empty).
"""

from __future__ import annotations

from typing import Any, Iterable


class CaptureBudget:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.costs: dict[str, tuple[int, int, int]] = {}  # unfinished capturing requests -> rows per token by class
        self.throttled_steps = 0

    def __bool__(self) -> bool:
        return bool(self.costs)

    def arrive(self, req_id: str, cost: tuple[int, int, int] | None) -> None:
        if cost is not None and any(cost):
            self.costs[req_id] = tuple(cost)

    def release(self, req_id: str) -> None:
        self.costs.pop(req_id, None)

    def token_cap(self, requests: dict[str, Any], running: Iterable[Any], spec_tokens: int = 0) -> int | None:
        """The step's token budget that keeps its capture cells in the pool, or None (no cap needed).
        ``requests``: the scheduler's request table (``num_prompt_tokens``, ``num_computed_tokens``)."""
        per_decode = 1 + spec_tokens
        decode_cells = widest = wanted = 0
        for req_id, (c0, c1, c2) in self.costs.items():
            req = requests.get(req_id)
            if req is None:
                continue
            left = req.num_prompt_tokens - req.num_computed_tokens
            if left <= 0:
                decode_cells += c2 * per_decode
                continue
            per_token = max(c0, c1)  # a prompt token of any class costs at most this
            widest = max(widest, per_token)
            wanted += per_token * left
        room = self.max_rows - decode_cells
        if not wanted or wanted <= room:  # no capturing prompt left (decode rows cannot be chunked), or it fits
            return None
        self.throttled_steps += 1
        prompt_tokens = max(1, room // widest)
        decodes = sum(per_decode for r in running if r.num_computed_tokens >= r.num_prompt_tokens)
        return decodes + prompt_tokens
