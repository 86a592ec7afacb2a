"""Host -> device copies of small per-step buffers without allocating or pinning per copy.

A ring of pinned host buffers of one shape: ``stage()`` hands out the next buffer whose previous
copy has finished (an event query, never a wait; a busy ring gives a fresh pinned block) and a
``land(dst)`` that enqueues the non-blocking copy and records the buffer's event (``land(dst, at)``: one of several
parts of the buffer, e.g. one row write's sites, each landed where it goes). The host may run
steps ahead of the device (async scheduling), so a buffer is never refilled before its copy ran.
On CPU devices the host buffer is plain memory and ``land`` copies at once.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from vllm_steer.runtime.streams import current_stream


SLOTS = 4  # buffers per ring unless a caller asks for more (a busy ring gives a one-off pinned block)


class PinnedRing:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slots: int = SLOTS) -> None:
        self.shape, self.dtype = shape, dtype
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self._bufs = [torch.zeros(shape, dtype=dtype, pin_memory=self.pinned) for _ in range(slots)]
        self._events: list = [None] * slots
        self._cursor = 0

    def stage(self) -> tuple[np.ndarray, Callable[[torch.Tensor], None]]:
        """(numpy view of a host buffer to fill, ``land(dst)``: copy the filled prefix into ``dst``)."""
        i = self._cursor % len(self._bufs)
        self._cursor += 1
        event = self._events[i]
        if not self.pinned or event is None or event.query():
            buf = self._bufs[i]
        else:  # the device is further behind than the ring is deep: a one-off block
            buf, i = torch.zeros(self.shape, dtype=self.dtype, pin_memory=True), None

        def land(dst: torch.Tensor, at: int | tuple | None = None) -> None:
            """Copy the buffer's first ``len(dst)`` rows (or ``buf[at]``: several copies out of one staged
            buffer, each a contiguous part) into ``dst``."""
            dst.copy_(buf[: dst.shape[0]] if at is None else buf[at], non_blocking=self.pinned)
            if self.pinned and i is not None:
                ev = self._events[i] or torch.cuda.Event()
                ev.record(current_stream(self.device))
                self._events[i] = ev

        return buf.numpy(), land
