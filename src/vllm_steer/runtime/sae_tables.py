"""Device buffers of SAE clamping on a worker: per SAE site of this rank, the site's pack (weights
staged once at start-up, row tables updated in place; layout in kernels/sae_clamp/packed.py). Rows
share the numbering of the steering tables: a config key owns one row for its vectors and its clamps
alike, so the row gate, the index and preemption need nothing new."""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.core.sae_catalog import SaeEntry, Site
from vllm_steer.core.sae_files import SaeWeights, load_sae
from vllm_steer.core.sae_rows import SaeWire, unpack_entry


def _pack(w: SaeWeights, entry: SaeEntry, num_rows: int, device: torch.device) -> list[torch.Tensor]:
    feats = np.asarray(entry.features, dtype=np.int64)
    b_enc = w.b_enc.astype(np.float32)
    if w.meta.b_dec_in:  # (x - b_dec) @ W_enc + b_enc = x @ W_enc + (b_enc - b_dec @ W_enc)
        b_enc = b_enc - w.b_dec.astype(np.float32) @ w.w_enc.astype(np.float32)
    thr = w.threshold if w.threshold is not None else np.zeros(w.meta.d_sae, dtype=np.float32)
    c = len(feats)

    def t(a: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    pack = [
        torch.zeros(num_rows, dtype=torch.int32, device=device),
        torch.zeros(num_rows, c, dtype=torch.int32, device=device),
        torch.zeros(num_rows, c, dtype=torch.float32, device=device),
        t(w.w_enc[:, feats].T), t(w.w_dec[feats]), t(b_enc[feats]), t(thr[feats]), t(feats, torch.int64),
    ]
    if entry.full:
        pack += [t(w.w_enc), t(b_enc), t(thr), t(w.w_dec), t(w.b_dec)]
    return pack


class SaeTables:
    def __init__(self, catalog: dict[str, SaeEntry], sites: set[Site], num_rows: int, device: torch.device) -> None:
        """Load the SAEs of ``sites`` (this rank's hooked sites) and stage their packs."""
        self.packs: dict[Site, list[torch.Tensor]] = {}
        self.topk: dict[Site, int] = {}
        for entry in catalog.values():
            mine = [s for s in entry.sites if s in sites]
            if not mine:
                continue
            weights = load_sae(entry.config.path, entry.config.format, entry.config.site)
            for site in mine:
                w = weights[site]
                self.packs[site] = _pack(w, entry, num_rows, device)
                self.topk[site] = w.meta.k if w.meta.activation == "topk" else 0
        self._written: dict[int, list[Site]] = {}  # row -> sites whose row tables it set

    def write_row(self, row: int, entries: list[SaeWire] | None) -> None:
        """Set ``row`` of every site's clamp tables to a config's entries (sites it does not name:
        OFF); only the sites the row had or gets are touched."""
        touched = []
        for site in self._written.pop(row, []):
            self.packs[site][0][row : row + 1].fill_(0)
        for entry in entries or ():
            _name, hook, layer, mode, slots, codes, values = unpack_entry(entry)
            pack = self.packs.get((hook, layer))
            if pack is None:
                continue  # another rank's site
            code = torch.zeros(pack[1].shape[1], dtype=torch.int32)
            value = torch.zeros(pack[2].shape[1], dtype=torch.float32)
            idx = torch.from_numpy(slots.astype(np.int64))
            code[idx] = torch.from_numpy(codes.copy())
            value[idx] = torch.from_numpy(values.copy())
            pack[1][row].copy_(code)  # one host -> device copy each (control plane, not per step)
            pack[2][row].copy_(value)
            pack[0][row : row + 1].fill_(mode)
            touched.append((hook, layer))
        if touched:
            self._written[row] = touched
