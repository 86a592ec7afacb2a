"""Device buffers of the steering data plane, allocated once and updated in place.

Per hook point: ``table[hook]`` ``[R, L_h, D]`` (model dtype; a config's row across every layer
is contiguous, so writing it is one non-blocking copy from pinned memory per hook) and
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

from vllm_steer.core.payload import HookVectors

_ALIGN = 16  # bytes


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

    def layer_views(self, hook: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(table ``[R, D]``, flag ``[1]``) of one hooked layer, both 16-byte aligned."""
        slot = self.slot_of_layer[hook][layer]
        return self.table[hook][:, slot], self.active[hook][slot, :1]

    def write_row(self, row: int, vectors: dict[str, HookVectors]) -> None:
        """Overwrite ``row`` of every hooked table (hooks absent from ``vectors`` get zeros):
        per hook at most one pinned staging tensor, filled by one indexed copy, and one
        non-blocking H2D copy; nothing for a hook the row neither had nor gets."""
        for hook, table in self.table.items():
            slots = self.slot_of_layer[hook]
            hv = vectors.get(hook)
            src, dst = [], []
            if hv is not None:
                for i, layer in enumerate(hv.layers):
                    slot = slots.get(layer)
                    if slot is not None:  # else: layer not hooked on this engine (validated API-side)
                        src.append(i)
                        dst.append(slot)
            if dst or self._row_layers[hook].get(row) is not None:
                n_layers = table.shape[1]
                staging = torch.empty(n_layers, self.hidden_size, dtype=self.dtype, pin_memory=self._pin)
                if dst == list(range(n_layers)) and src == dst:
                    staging.copy_(hv.data)  # every hooked layer, in order: the common case
                else:
                    staging.zero_()
                    if dst:
                        staging[torch.tensor(dst)] = hv.data[torch.tensor(src)].to(self.dtype)
                table[row].copy_(staging, non_blocking=True)  # contiguous [L, D]: one plain copy
            self._row_layers[hook][row] = np.asarray(sorted(dst), dtype=np.int64)

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
                host = np.zeros((after.size, _ALIGN), dtype=np.uint8)
                host[:, 0] = after
                flags = torch.from_numpy(host)
                if self._pin:
                    flags = flags.pin_memory()
                self.active[hook].copy_(flags, non_blocking=True)
