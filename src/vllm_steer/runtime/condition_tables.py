"""Device buffers of conditional steering (``steer.conditions``), allocated once, updated in place.

Per row: ``site`` [R] int32 (the probe site's position in the forward pass, ``core.hooks.site_order``,
in the low 16 bits, plus ``VECTORS_UNGATED`` when ``applies_to`` leaves the vectors unconditional and
``SAE_GATED`` when it scales the SAE clamps, ``PROJ_GATED`` when it scales the projections; -1: the row has no condition), ``params`` [R, 4] float32
(threshold, sharpness, hard, unused) and ``probe`` [R, D] float32; ``params[0, 3]`` (row 0 never has a
condition) is 1 while a live row has one, else 0, and the kernel then adds every row as the plain one
does (no gate work on a server with ``conditions`` while no conditional request runs). Per token:
``gate`` [max_num_tokens] float32, written by the steered norm at a row's probe site and read by the
later norms of the same forward pass (``kernels/steered_rms_norm``). A row is written with the config
that takes it (its condition, or none), so a reused row never keeps an old condition. Writes go through
pinned staging rings (``runtime.pinned_ring``): non-blocking copies, no host sync.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.core.hooks import site_order
from vllm_steer.core.vectors import GATES_PROJECTIONS, GATES_SAE, GATES_VECTORS
from vllm_steer.kernels.steered_rms_norm.naive import PROJ_GATED, SAE_GATED, VECTORS_UNGATED
from vllm_steer.runtime.pinned_ring import PinnedRing


def site_word(hook: str, layer: int, applies: int) -> int:
    """A conditional row's ``site`` entry: its probe site and what its gate scales."""
    return (site_order(hook, layer) | (0 if applies & GATES_VECTORS else VECTORS_UNGATED)
            | (SAE_GATED if applies & GATES_SAE else 0) | (PROJ_GATED if applies & GATES_PROJECTIONS else 0))


class ConditionTables:
    def __init__(self, num_rows: int, hidden_size: int, max_num_tokens: int, device: torch.device) -> None:
        self.site = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self.params = torch.zeros(num_rows, 4, dtype=torch.float32, device=device)
        self.probe = torch.zeros(num_rows, hidden_size, dtype=torch.float32, device=device)
        self.gate = torch.zeros(max_num_tokens, dtype=torch.float32, device=device)
        self._conditional: set[int] = set()  # rows holding a condition now
        self._live: set[int] = set()  # of those, the rows live (a running request holds them)
        self._rings = {name: PinnedRing(tuple(t.shape[1:]) or (1,), t.dtype, device)
                       for name, t in (("site", self.site), ("params", self.params), ("probe", self.probe))}

    def _put(self, name: str, row: int, value: np.ndarray) -> None:
        host, land = self._rings[name].stage()
        host[...] = value.reshape(host.shape)
        target = getattr(self, name)[row]
        land(target.view(1) if target.dim() == 0 else target)

    def set_live(self, row: int, live: bool) -> None:
        """A row became live or was released: the any-live-condition flag follows (0 <-> 1 only)."""
        before = bool(self._live)
        if live and row in self._conditional:
            self._live.add(row)
        elif not live:
            self._live.discard(row)
        if bool(self._live) != before:
            self._put("params", 0, np.array([0.0, 0.0, 0.0, float(bool(self._live))], dtype=np.float32))

    def write_row(self, row: int, wire: list | None) -> int:
        """Give ``row`` the condition ``wire`` (``frontend.condition_spec``), or none; bytes written."""
        if wire is None:
            if row not in self._conditional:
                return 0
            self._conditional.discard(row)
            self._put("site", row, np.array([-1], dtype=np.int32))
            return 4
        hook, layer, threshold, sharpness, hard, probe, applies = wire
        self._put("site", row, np.array([site_word(hook, int(layer), int(applies))], dtype=np.int32))
        self._put("params", row, np.array([threshold, sharpness, float(hard), 0.0], dtype=np.float32))
        self._put("probe", row, np.frombuffer(probe, dtype=np.float32))
        self._conditional.add(row)
        return 4 + 16 + len(probe)
