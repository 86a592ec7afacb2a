"""Device buffers of SAE clamping on a worker: per SAE site of this rank, the site's pack (weights
staged once at start-up, or, at sites ``steer.sae_slots`` reserved, zeros until an SAE is registered
at runtime and staged in place; row tables updated in place; layout in kernels/sae_clamp/packed.py). Rows
share the numbering of the steering tables: a config key owns one row for its vectors and its clamps
alike, so the row gate, the index and preemption need nothing new. A full pack (TopK, or a site that allows
reconstruct) keeps W_enc / W_dec in bfloat16 (the tensor-core kernels' operands, kernels/sae_clamp/full_triton.py). A transcoder's packs (``tc_packs``, by its
post_attn.L site) have the clamp-only layout too; the norm of post_attn.L applies them to its output's delta."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_steer.core.sae_catalog import SaeEntry, Site
from vllm_steer.core.sae_files import SaeWeights, load_sae
from vllm_steer.core.sae_paths import FileAccess
from vllm_steer.core.sae_rows import SaeWire, unpack_entry
from vllm_steer.runtime.pinned_ring import PinnedRing

def _tensor(a: np.ndarray, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def _folded_bias(w: SaeWeights) -> np.ndarray:
    """b_enc with b_dec's input subtraction folded in: (x - b_dec) @ W_enc + b_enc = x @ W_enc + this."""
    b_enc = w.b_enc.astype(np.float32)
    if w.meta.b_dec_in:
        b_enc = b_enc - w.b_dec.astype(np.float32) @ w.w_enc.astype(np.float32)
    return b_enc


def _threshold(w: SaeWeights) -> np.ndarray:
    return w.threshold if w.threshold is not None else np.zeros(w.meta.d_sae, dtype=np.float32)


def _clampable(w: SaeWeights, feats: np.ndarray) -> list[np.ndarray]:
    """Pack entries 3..7 (enc, dec, bias, thr, features) of the clampable features ``feats``."""
    return [w.w_enc[:, feats].T, w.w_dec[feats], _folded_bias(w)[feats], _threshold(w)[feats], feats]


def _bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (nearest), as float32."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).bfloat16().float().numpy()


def _pack(w: SaeWeights, entry: SaeEntry, num_rows: int, device: torch.device) -> list[torch.Tensor]:
    """A site's pack. A full one keeps W_enc / W_dec in bfloat16 (the tensor-core kernels' operands; half the
    float32 bytes: 4 * d_model * d_sae per site) and derives everything else from those rounded weights (the
    clampable copies, the folded bias), so the reference and the kernels compute with the same SAE."""
    if entry.full:
        w = dataclasses.replace(w, w_enc=_bf16(w.w_enc), w_dec=_bf16(w.w_dec))
    enc, dec, bias, thr, feats = _clampable(w, np.asarray(entry.features, dtype=np.int64))
    pack = _row_tables(num_rows, len(feats), device)
    pack += [_tensor(a, device) for a in (enc, dec, bias, thr)] + [_tensor(feats, device, torch.int64)]
    if entry.full:
        pack += [_tensor(w.w_enc, device, torch.bfloat16), _tensor(_folded_bias(w), device),
                 _tensor(_threshold(w), device), _tensor(w.w_dec, device, torch.bfloat16), _tensor(w.b_dec, device)]
    return pack


def _row_tables(num_rows: int, c: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(num_rows, dtype=torch.int32, device=device),
            torch.zeros(num_rows, c, dtype=torch.int32, device=device),
            torch.zeros(num_rows, c, dtype=torch.float32, device=device)]


def _empty_pack(capacity: int, hidden: int, num_rows: int, device: torch.device) -> list[torch.Tensor]:
    """A reserved site's clamp-only pack: every row OFF, zero weights until an SAE is registered."""
    f32 = {"dtype": torch.float32, "device": device}
    return _row_tables(num_rows, capacity, device) + [
        torch.zeros(capacity, hidden, **f32), torch.zeros(capacity, hidden, **f32), torch.zeros(capacity, **f32),
        torch.zeros(capacity, **f32), torch.zeros(capacity, dtype=torch.int64, device=device)]


class SaeTables:
    def __init__(self, catalog: dict[str, SaeEntry], slots: dict[Site, int], sites: set[Site], num_rows: int,
                 hidden: int, device: torch.device, runtime_files: FileAccess) -> None:
        """Load the SAEs of ``sites`` (this rank's hooked sites) and stage their packs; reserve the
        packs of the ``slots`` among them (capacity in clampable features) for runtime SAEs, whose
        files are read only as ``runtime_files`` allows (steer.sae_root, steer.max_sae_bytes)."""
        self.runtime_files = runtime_files
        self.packs: dict[Site, list[torch.Tensor]] = {}
        self.tc_packs: dict[Site, list[torch.Tensor]] = {}  # transcoders: at post_attn.L, layer L's MLP
        self._tc_names = {name for name, e in catalog.items() if e.transcoder}
        self.topk: dict[Site, int] = {}
        self.slots = {s: n for s, n in slots.items() if s in sites}
        for site, capacity in self.slots.items():
            self.packs[site] = _empty_pack(capacity, hidden, num_rows, device)
        for entry in catalog.values():
            mine = [s for s in entry.sites if s in sites]
            if not mine:
                continue
            weights = load_sae(entry.config.path, entry.config.format, entry.config.site)
            for site in mine:
                w = weights[site]
                if entry.transcoder:
                    self.tc_packs[site] = _pack(w, entry, num_rows, device)
                    continue
                self.packs[site] = _pack(w, entry, num_rows, device)
                self.topk[site] = w.meta.k if w.meta.activation == "topk" else 0
        self._written: dict[int, list[tuple[bool, Site]]] = {}  # row -> (transcoder?, site) whose tables it set
        self._device = device
        self._code_ring = self._value_ring = None  # sized for every pack at the first write (_stage)
        if (self.packs or self.tc_packs) and device.type == "cuda":  # the split walk's buffers, before graph capture
            from vllm_steer.kernels.steered_rms_norm.triton import split_buffers

            split_buffers(device, hidden)

    def write_row(self, row: int, entries: list[SaeWire] | None) -> int:
        """Set ``row`` of every site's clamp tables to a config's entries (sites it does not name:
        OFF); only the sites the row had or gets are touched. Returns the bytes written (a mode
        word per touched site, plus a named site's whole code and value rows)."""
        touched = []
        written = 0
        for tc, site in self._written.pop(row, []):
            pack = (self.tc_packs if tc else self.packs)[site]
            pack[0][row : row + 1].fill_(0)
            written += pack[0].element_size()
        mine = []
        for entry in entries or ():
            name, hook, layer, mode, slots, codes, values = unpack_entry(entry)
            tc = name in self._tc_names
            pack = (self.tc_packs if tc else self.packs).get((hook, layer))
            if pack is not None:  # else another rank's site
                mine.append((tc, (hook, layer), pack, mode, slots, codes, values))
        if mine:  # staged in pinned buffers, a part per site, copied non-blocking: a pageable host -> device
            (code_host, land_code), (value_host, land_value) = self._stage()  # copy would wait for the forward
        for j, (tc, site, pack, mode, slots, codes, values) in enumerate(mine):
            c = pack[1].shape[1]
            code_host[j, :c], value_host[j, :c] = 0, 0
            code_host[j, slots] = codes
            value_host[j, slots] = values
            land_code(pack[1][row], (j, slice(0, c)))
            land_value(pack[2][row], (j, slice(0, c)))
            pack[0][row : row + 1].fill_(mode)
            touched.append((tc, site))
            written += 8 * c + pack[0].element_size()
        if touched:
            self._written[row] = touched
        return written

    def _stage(self) -> tuple:
        """A code and a value staging buffer ([sites, clamp slots]) and their ``land``s."""
        every = [*self.packs.values(), *self.tc_packs.values()]
        shape = (len(every), max(p[1].shape[1] for p in every))
        if self._code_ring is None or self._code_ring.shape != shape:
            self._code_ring = PinnedRing(shape, torch.int32, self._device)
            self._value_ring = PinnedRing(shape, torch.float32, self._device)
        return self._code_ring.stage(), self._value_ring.stage()

    def load_runtime(self, path: str, format: str | None, site: str | None, features: tuple[int, ...],
                     sites: list[Site]) -> list[Site]:
        """Stage a runtime SAE's clampable features into the reserved packs of its ``sites`` on this
        rank (the front end and the engine core checked that no unfinished request uses them). The
        path policy is checked again here (SaePathError), as the API process did, before any read."""
        mine = [s for s in sites if s in self.slots]
        if not mine:
            return []
        weights = load_sae(path, format, site, self.runtime_files)
        feats = np.asarray(features, dtype=np.int64)
        for s in mine:
            pack, n = self.packs[s], len(feats)
            for t, a in zip(pack[3:8], _clampable(weights[s], feats)):
                t[:n].copy_(torch.from_numpy(np.ascontiguousarray(a)).to(t.dtype))
                t[n:].zero_()
        return mine
