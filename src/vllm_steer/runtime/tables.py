"""Device buffers of the steering data plane, allocated once and updated in place.

Per hook point: ``table[hook]`` ``[R, L_h, D]`` (model dtype; a config's row across every layer
is contiguous, so writing it is one non-blocking copy per hook, from a persistent pinned staging
ring filled by one numpy copy of the shipped bytes: no allocation, no torch op on the host) and
``active[hook]`` (uint8: some live row is non-zero at that layer). Shared by every hook: the
token -> row ``index`` ``[max_num_tokens]`` int32.

Every per-layer view handed to the model starts on a 16-byte boundary: Inductor compiles a piece
once and reuses it for every layer, assuming its inputs are as aligned as the first layer's, and
copies any input that is not (one copy kernel per misaligned input per replay, measured on an
H200: two per layer when the flags were 1-byte views of one ``[L, 1]`` tensor).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.core.layout import Layout
from vllm_steer.runtime.pinned_ring import PinnedRing

_ALIGN = 16  # bytes
_STAGING_SLOTS = 8  # pinned [L, D] slots per hook; a busy ring falls back to a fresh pinned block
_WORD = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}  # element bits, copied as words


class SteeringTables:
    def __init__(
        self,
        hooked_layers: dict[str, list[int]],
        num_rows: int,
        hidden_size: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.num_rows = num_rows
        self.slot_of_layer = {h: {l: i for i, l in enumerate(ls)} for h, ls in hooked_layers.items()}
        self.table = {
            h: torch.zeros(num_rows, len(ls), hidden_size, dtype=dtype, device=device)
            for h, ls in hooked_layers.items()
        }
        # One flag per layer, each in its own 16 bytes (see the module docstring).
        self.active = {
            h: torch.zeros(len(ls), _ALIGN, dtype=torch.uint8, device=device)
            for h, ls in hooked_layers.items()
        }
        self.index = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        # Host bookkeeping: per hook, per layer slot, how many live rows are non-zero there.
        self._nonzero_live = {h: np.zeros(len(ls), dtype=np.int64) for h, ls in hooked_layers.items()}
        # Per hook, per row: the layer slots where that row is non-zero.
        self._row_layers: dict[str, dict[int, np.ndarray]] = {h: {} for h in hooked_layers}
        self._pin = torch.cuda.is_available() and device.type == "cuda"
        self._word_t, self._word_np = _WORD[torch.empty((), dtype=dtype).element_size()]
        # rows are staged as words (numpy has no bfloat16) in pinned rings, then copied non-blocking
        self._row_rings = {h: PinnedRing((len(ls), hidden_size), self._word_t, device, _STAGING_SLOTS)
                           for h, ls in hooked_layers.items()} if self._pin else {}
        self._flag_rings = {h: PinnedRing((len(ls), _ALIGN), torch.uint8, device) for h, ls in hooked_layers.items()}

    def layer_views(self, hook: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(table ``[R, D]``, flag ``[1]``) of one hooked layer, both 16-byte aligned."""
        slot = self.slot_of_layer[hook][layer]
        return self.table[hook][:, slot], self.active[hook][slot, :1]

    def write_row(self, row: int, layout: Layout) -> int:
        """Overwrite ``row`` of every hooked table with a config in table layout (hooks absent
        from ``layout`` get zeros; layers this engine does not hook are skipped, validated
        API-side); nothing for a hook the row neither had nor gets. Returns the bytes written
        (a touched hook's whole ``[L_h, D]`` row)."""
        written = 0
        for hook, table in self.table.items():
            slots = self.slot_of_layer[hook]
            entry = layout.get(hook)
            src: list[int] = []
            dst: list[int] = []
            if entry is not None:
                for i, layer in enumerate(entry[0]):
                    slot = slots.get(layer)
                    if slot is not None:
                        src.append(i)
                        dst.append(slot)
            if dst or self._row_layers[hook].get(row) is not None:
                n_layers = table.shape[1]
                words, done = self._target(hook, table, row)
                if dst:
                    rows = np.frombuffer(entry[1], dtype=self._word_np).reshape(len(entry[0]), self.hidden_size)
                if dst == src and dst == list(range(n_layers)) and len(entry[0]) == n_layers:
                    words[...] = rows  # every hooked layer, in order, and no other: the common case
                else:
                    words[...] = 0
                    if dst:
                        words[dst] = rows[src]
                done()
                written += words.nbytes
            self._row_layers[hook][row] = np.asarray(sorted(dst), dtype=np.int64)
        return written

    def _target(self, hook: str, table: torch.Tensor, row: int):
        """(host words to fill with the row's ``[L, D]``, callable that lands them in the table).
        CPU: the table row itself. CUDA: a slot of the hook's pinned ring, then one non-blocking copy."""
        target = table[row].view(self._word_t)
        if not self._pin:
            return target.numpy(), lambda: None
        words, land = self._row_rings[hook].stage()
        return words, lambda: land(target)

    def set_live(self, row: int, live: bool) -> None:
        """Count ``row`` in (or out of) the any-active flags; flags change only at 0 <-> 1."""
        delta = 1 if live else -1
        for hook, counts in self._nonzero_live.items():
            slots = self._row_layers[hook].get(row)
            if slots is None or slots.size == 0:
                continue
            before = counts > 0
            counts[slots] += delta
            after = counts > 0
            if not np.array_equal(before, after):
                host, land = self._flag_rings[hook].stage()
                host[:, 0] = after
                land(self.active[hook])
