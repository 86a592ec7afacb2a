"""``steering_condition.stop_when`` on the worker: which requests the probe's gate stops, with no
host sync on the hot path.

Per watched request: (above, tokens, whether the last prompt position counts), its prompt length and
its current run of consecutive gates above ``above``. Per step with a watched request in the batch
(nothing otherwise: one dict check): before the forward, ``plan`` picks the batch position of each
watched request's last token (the one its next token is sampled from) when that position counts;
after the forward, ``after_forward`` gathers the gate there (``ConditionTables.gate``, written by the
probe site's norm) and copies it non-blocking into pinned host memory on the step's stream. vLLM's
own wait for the sampled token ids orders after that copy, so ``attach`` reads it when vLLM's output
is ready (at once for a ``ModelRunnerOutput``; inside ``get_output`` for an async one) and sets
``vllm_steer_stops`` (request id -> gate) on the output, which the scheduler reads
(``engine.scheduler``). Outputs are read in step order, so runs count consecutive steps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_steer.runtime.pinned_ring import PinnedRing

ATTR = "vllm_steer_stops"  # the ModelRunnerOutput attribute the scheduler reads


@dataclass
class _Watch:
    above: float
    tokens: int
    first: int  # the first position whose gate counts
    run: int = 0


@dataclass
class _Step:
    req_ids: list[str]
    host: torch.Tensor  # the gates, filled by a non-blocking copy


class StopWatch:
    def __init__(self, gate: torch.Tensor, max_num_reqs: int) -> None:
        self.gate = gate
        self.watched: dict[str, _Watch] = {}
        self._lock = threading.Lock()  # async outputs are read on vLLM's output thread
        self._index = torch.zeros(max_num_reqs, dtype=torch.int64, device=gate.device)
        self._ring = PinnedRing((max_num_reqs,), torch.int64, gate.device)
        self._planned: list[str] = []
        self.pending: _Step | None = None

    def watch(self, req_id: str, stop: list, prompt_len: int) -> None:
        above, tokens, from_prompt = stop
        with self._lock:
            self.watched[req_id] = _Watch(float(above), int(tokens), prompt_len - 1 if from_prompt else prompt_len)

    def forget(self, req_id: str) -> None:
        with self._lock:
            self.watched.pop(req_id, None)

    def plan(self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray) -> None:
        """Before the forward: the watched requests' last-token positions in this step's batch."""
        self._planned = []
        if not self.watched:
            return
        ends = np.cumsum(num_scheduled[: len(req_ids)])
        picks, planned = [], []
        for i, req_id in enumerate(req_ids):
            w = self.watched.get(req_id)
            if w is not None and int(num_computed[i]) + int(num_scheduled[i]) - 1 >= w.first:
                picks.append(int(ends[i]) - 1)
                planned.append(req_id)
        if planned:
            host, land = self._ring.stage()
            host[: len(picks)] = picks
            land(self._index[: len(picks)])
            self._planned = planned

    def after_forward(self) -> None:
        """The forward is enqueued: copy the planned positions' gates to the host (non-blocking)."""
        if not self._planned:
            return
        n = len(self._planned)
        gates = self.gate.index_select(0, self._index[:n])
        pinned = gates.is_cuda
        host = torch.empty(n, dtype=torch.float32, pin_memory=pinned)
        host.copy_(gates, non_blocking=pinned)
        self.pending, self._planned = _Step(self._planned, host), []

    def attach(self, output: Any) -> None:
        """Give this step's stops to vLLM's output for it (an async one: when it is read)."""
        step, self.pending = self.pending, None
        if step is None or output is None:
            return
        get_output = getattr(output, "get_output", None)
        if get_output is None:
            setattr(output, ATTR, self._evaluate(step))
            return

        def get_output_with_stops():
            result = get_output()
            setattr(result, ATTR, self._evaluate(step))
            return result

        output.get_output = get_output_with_stops

    def _evaluate(self, step: _Step) -> dict[str, float]:
        """Advance each request's run with this step's gate; the requests whose run reached ``tokens``."""
        stops: dict[str, float] = {}
        with self._lock:
            for req_id, gate in zip(step.req_ids, step.host.tolist()):
                w = self.watched.get(req_id)
                if w is None:
                    continue
                w.run = w.run + 1 if gate > w.above else 0
                if w.run >= w.tokens:
                    stops[req_id] = gate
                    del self.watched[req_id]
        return stops
