"""Per request slot of vLLM's V2 runner: its steering rows and prompt length, on the device.

``slot_rows`` ``[max_num_reqs, 4]`` int32 (prefill row, decode row, prompt length, unused) is what
the ``step_index`` kernel reads with vLLM's ``idx_mapping``. Rows are set when a request arrives and
cleared when it leaves (host array); ``sync`` copies the table to the device before a step, only if
something changed since the last one (one small copy from a pinned ring, no allocation).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.runtime.pinned_ring import PinnedRing


class SlotRows:
    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.host = np.zeros((max_num_reqs, 4), dtype=np.int32)
        self.device = torch.zeros(max_num_reqs, 4, dtype=torch.int32, device=device)
        self._ring = PinnedRing((max_num_reqs, 4), torch.int32, device)
        self._dirty = False

    def set(self, slot: int, rows: tuple[int, int], prompt_len: int) -> None:
        if rows == (0, 0) and not self.host[slot, :2].any():
            return  # unsteered, and the slot says so already
        self.host[slot] = (rows[0], rows[1], prompt_len, 0)
        self._dirty = True

    def clear(self, slot: int) -> None:
        if self.host[slot, :2].any():
            self.host[slot] = 0
            self._dirty = True

    def sync(self) -> None:
        """Before a step's ``step_index``: the device table equals the host's."""
        if self._dirty:
            buf, land = self._ring.stage()
            buf[...] = self.host
            land(self.device)
            self._dirty = False
