"""Device buffers of SAE clamping on a worker: per SAE site of this rank, the site's pack (weights
staged once at start-up, or, in the region ``steer.sae_slots`` reserved at a site, zeros until an SAE is
registered at runtime and staged in place; row tables updated in place; layout in kernels/sae_clamp/packed.py).
Several clamp-only SAEs at one site share its pack, one region of clamp slots each (``core.sae_catalog.site_regions``:
the wire's slots are each SAE's own, offset here), so the norm's one clamp walk applies them all. Rows
share the numbering of the steering tables: a config key owns one row for its vectors and its clamps
alike, so the row gate, the index and preemption need nothing new. A full pack (TopK, or a site that allows
reconstruct) keeps W_enc / W_dec in bfloat16 (the tensor-core kernels' operands, kernels/sae_clamp/full_triton.py).
A transcoder's packs (``tc_packs``, by its post_attn.L site; ``tc_topk`` its k) have either layout (full: a TopK
transcoder, sparsify's, alone at its site); the norm of post_attn.L applies them to its output's delta. A transcoder
that reads that norm's output without its gain (``SaeMeta.input == "gain_free"``: Gemma Scope's
``ln2.hook_normalized``) is staged with the norm's gain g folded into W_enc (``gain_folded``): the kernels encode the
norm's output y, and (y / g) W_enc = y (diag(1/g) W_enc)."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Callable

import numpy as np
import torch

from vllm_steer.core.sae_catalog import Region, SaeEntry, Site, Slot, site_regions
from vllm_steer.core.sae_files import SaeFileError, SaeWeights, load_sae
from vllm_steer.core.sae_paths import FileAccess
from vllm_steer.core.sae_rows import SaeWire, unpack_entry
from vllm_steer.runtime.pinned_ring import PinnedRing

GAIN_MIN = 1e-6  # a norm gain below this in magnitude cannot be divided out of a gain-free SAE's input

Gains = Callable[[Site], "np.ndarray | None"]  # a site -> the gain of the norm whose output is its SAE's input


def _no_gains(site: Site) -> None:
    return None


def gain_folded(w: SaeWeights, gains: Gains, name: str, site: Site, path: str | None = None) -> SaeWeights:
    """``w`` as it encodes the output y of the site's norm, whose gain is g = ``gains(site)`` (asked only for a
    gain-free SAE: a copy from the device). A "gain_free" SAE reads y / g: e = (y / g) W_enc + b = y (diag(1/g) W_enc)
    + b, folded in float32 before any bfloat16 rounding (a b_dec input subtraction goes into b_enc first, with the
    unfolded W_enc). Other SAEs are returned as they are.
    SaeFileError (key ``input``, naming the SAE and the site) when the norm has no gain or one of |g| < GAIN_MIN."""
    if w.meta.input != "gain_free":
        return w
    where = f"SAE {name!r} at {site[0]}.{site[1]} reads the norm's output without its gain"
    gain = gains(site)
    if gain is None:
        raise SaeFileError(path, "input", f"{where}, but no norm with a gain makes that site's stream here")
    g = np.asarray(gain, dtype=np.float32).reshape(-1)
    small = np.flatnonzero(np.abs(g) < GAIN_MIN)
    if small.size:
        raise SaeFileError(path, "input", f"{where}; the norm's gain is {float(g[small[0]]):.3g} at dimension "
                                          f"{int(small[0])} ({small.size} of {g.size} under {GAIN_MIN:g} in "
                                          "magnitude): it cannot be divided out")
    b_enc = _folded_bias(w)
    meta = dataclasses.replace(w.meta, b_dec_in=False)
    return dataclasses.replace(w, meta=meta, w_enc=(w.w_enc.astype(np.float32) / g[:, None]).astype(np.float32),
                               b_enc=b_enc)


def _tensor(a: np.ndarray, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def _put(t: torch.Tensor, a: np.ndarray) -> None:
    """Copy ``a`` into the device tensor (view) ``t`` in its dtype."""
    t.copy_(torch.from_numpy(np.ascontiguousarray(a)).to(t.dtype))


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
    """An SAE's pack when it is alone at its site. A full one (TopK, or reconstruct: always alone) keeps W_enc /
    W_dec in bfloat16 (the tensor-core kernels' operands; half the float32 bytes: 4 * d_model * d_sae per site)
    and derives everything else from those rounded weights (the clampable copies, the folded bias), so the
    reference and the kernels compute with the same SAE."""
    if not entry.full:
        return _clamp_only_pack([_clampable(w, np.asarray(entry.features, dtype=np.int64))], num_rows, device)
    w = dataclasses.replace(w, w_enc=_bf16(w.w_enc), w_dec=_bf16(w.w_dec))
    enc, dec, bias, thr, feats = _clampable(w, np.asarray(entry.features, dtype=np.int64))
    pack = _row_tables(num_rows, len(feats), device)
    pack += [_tensor(a, device) for a in (enc, dec, bias, thr)] + [_tensor(feats, device, torch.int64)]
    pack += [_tensor(w.w_enc, device, torch.bfloat16), _tensor(_folded_bias(w), device),
             _tensor(_threshold(w), device), _tensor(w.w_dec, device, torch.bfloat16), _tensor(w.b_dec, device)]
    return pack


def _clamp_only_pack(parts: list[list[np.ndarray]], num_rows: int, device: torch.device) -> list[torch.Tensor]:
    """A clamp-only pack of the regions ``parts`` (each (enc, dec, bias, thr, features), ``_clampable``'s, or zeros
    for a reserved region), one after the other in slot order."""
    enc, dec, bias, thr, feats = (np.concatenate([p[i] for p in parts]) for i in range(5))
    return (_row_tables(num_rows, len(feats), device) + [_tensor(a, device) for a in (enc, dec, bias, thr)]
            + [_tensor(feats, device, torch.int64)])


def _row_tables(num_rows: int, c: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(num_rows, dtype=torch.int32, device=device),
            torch.zeros(num_rows, c, dtype=torch.int32, device=device),
            torch.zeros(num_rows, c, dtype=torch.float32, device=device)]


_PAD_BIAS = -1e30  # a reserved full pack's features past its SAE's d_sae: never active, never in a TopK


def _reserved_full(slot: Slot, hidden: int, num_rows: int, device: torch.device) -> list[torch.Tensor]:
    """A full reservation's pack (every row OFF) until an SAE of at most ``slot.d_sae`` features is staged in it."""
    f, bf16 = slot.d_sae, {"dtype": torch.bfloat16, "device": device}
    return _clamp_only_pack([_reserved(slot.features, hidden)], num_rows, device) + [
        torch.zeros(hidden, f, **bf16), torch.full((f,), _PAD_BIAS, device=device), torch.zeros(f, device=device),
        torch.zeros(f, hidden, **bf16), torch.zeros(hidden, device=device)]


def _reserved(capacity: int, hidden: int) -> list[np.ndarray]:
    """A reserved region's zeros (its clamps read zero weights until an SAE is registered there)."""
    z = np.zeros(capacity, dtype=np.float32)
    return [np.zeros((capacity, hidden), np.float32), np.zeros((capacity, hidden), np.float32), z, z,
            np.zeros(capacity, dtype=np.int64)]


class SaeTables:
    def __init__(self, catalog: dict[str, SaeEntry], slots: dict[Site, Slot], sites: set[Site], num_rows: int,
                 hidden: int, device: torch.device, runtime_files: FileAccess, gains: Gains = _no_gains) -> None:
        """Load the SAEs of ``sites`` (this rank's hooked sites) and stage their packs, one per site and kind
        (``site_regions``: the clamp-only SAEs of a site one after the other, then the region the ``slots``
        reserve there, in clampable features, for a runtime SAE, whose files are read only as ``runtime_files``
        allows (steer.sae_root, steer.max_sae_bytes)). ``gains``: the gain of the norm a site's SAEs read (its
        output's), folded into a gain-free SAE's W_enc (``gain_folded``; the norm's weight is replicated under TP:
        every rank folds)."""
        self.runtime_files = runtime_files
        self._gains = gains
        self.packs: dict[Site, list[torch.Tensor]] = {}
        self.tc_packs: dict[Site, list[torch.Tensor]] = {}  # transcoders: at post_attn.L, layer L's MLP
        self._tc_names = {name for name, e in catalog.items() if e.transcoder}
        self.topk: dict[Site, int] = {}
        self.tc_topk: dict[Site, int] = {}  # a full (TopK) transcoder pack's k, by its post_attn.L site
        self.slots = {s: n for s, n in slots.items() if s in sites}
        self.slot_base: dict[Site, int] = {}  # where a site's reserved region starts in its pack
        self._offset: dict[tuple[bool, Site], dict[str, int]] = {}  # where each start-up SAE's region starts
        mine = {key: regions for key, regions in site_regions(catalog, self.slots).items() if key[0] in sites}
        left = Counter(r.name for regions in mine.values() for r in regions if r.name is not None)
        weights: dict[str, dict] = {}  # an SAE's weights from its first site of this rank to its last only
        for (site, tc), regions in mine.items():
            names = [r.name for r in regions if r.name is not None]
            for name in names:
                if name not in weights:
                    c = catalog[name].config
                    weights[name] = {where: gain_folded(w, gains, name, where, c.path) if where in sites
                                     else w for where, w in load_sae(c.path, c.format, c.site).items()}
            (self.tc_packs if tc else self.packs)[site] = self._site_pack(site, tc, regions, catalog, weights, hidden,
                                                                          num_rows, device)
            self._offset[(tc, site)] = {r.name: r.offset for r in regions if r.name is not None}
            self.slot_base.update({site: r.offset for r in regions if r.name is None})
            left.subtract(names)
            for name in names:
                if not left[name]:
                    del weights[name]
        self._written: dict[int, list[tuple[bool, Site]]] = {}  # row -> (transcoder?, site) whose tables it set
        self._device = device
        self._code_ring = self._value_ring = None  # sized for every pack at the first write (_stage)
        if (self.packs or self.tc_packs) and device.type == "cuda":  # the split walks' buffers, before graph capture
            from vllm_steer.kernels.sae_clamp.full_triton import arrival_counts
            from vllm_steer.kernels.steered_rms_norm.triton import split_buffers

            split_buffers(device, hidden)
            arrival_counts(device)

    def _site_pack(self, site: Site, tc: bool, regions: list[Region], catalog: dict[str, SaeEntry], weights: dict,
                   hidden: int, num_rows: int, device: torch.device) -> list[torch.Tensor]:
        first = catalog[regions[0].name] if regions[0].name is not None else None
        topk = self.tc_topk if tc else self.topk
        if first is None and self.slots[site].full:  # alone at its site (sae_catalog)
            self.topk[site] = self.slots[site].k
            return _reserved_full(self.slots[site], hidden, num_rows, device)
        if first is not None and first.full:  # alone at its site and kind (sae_catalog)
            w = weights[first.name][site]
            topk[site] = w.meta.k if w.meta.activation == "topk" else 0
            return _pack(w, first, num_rows, device)
        topk[site] = 0
        parts = [_reserved(r.size, hidden) if r.name is None
                 else _clampable(weights[r.name][site], np.asarray(catalog[r.name].features, dtype=np.int64))
                 for r in regions]
        return _clamp_only_pack(parts, num_rows, device)

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
        mine: dict[tuple[bool, Site], list] = {}  # a pack's entries: several SAEs may share its site
        for entry in entries or ():
            name, hook, layer, mode, slots, codes, values = unpack_entry(entry)
            tc = name in self._tc_names
            if (hook, layer) in (self.tc_packs if tc else self.packs):  # else another rank's site
                offset = self._offset.get((tc, (hook, layer)), {}).get(name, self.slot_base.get((hook, layer), 0))
                mine.setdefault((tc, (hook, layer)), []).append((mode, offset + slots, codes, values))
        if mine:  # staged in pinned buffers, a part per site, copied non-blocking: a pageable host -> device
            (code_host, land_code), (value_host, land_value) = self._stage()  # copy would wait for the forward
        for j, ((tc, site), parts) in enumerate(mine.items()):
            pack = (self.tc_packs if tc else self.packs)[site]
            c = pack[1].shape[1]
            code_host[j, :c], value_host[j, :c] = 0, 0
            for _, slots, codes, values in parts:
                code_host[j, slots] = codes
                value_host[j, slots] = values
            land_code(pack[1][row], (j, slice(0, c)))
            land_value(pack[2][row], (j, slice(0, c)))
            pack[0][row : row + 1].fill_(max(p[0] for p in parts))  # several only in clamp-only packs: all DELTA
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
        """Stage a runtime SAE's clampable features (and at a full reservation the whole SAE, its W_enc / W_dec
        rounded to bfloat16 as a start-up full SAE's) into the reserved regions of its ``sites`` on this rank
        (the front end and the engine core checked that no unfinished request uses them), zeroing what a larger
        SAE left there. The path policy is checked again here (SaePathError), as the API process did, before any
        read."""
        mine = [s for s in sites if s in self.slots]
        if not mine:
            return []
        weights = load_sae(path, format, site, self.runtime_files)
        feats = np.asarray(features, dtype=np.int64)
        # (runtime transcoders are refused by sae_catalog.runtime_entry; the fold keeps this path right if that goes)
        folded = {s: gain_folded(weights[s], self._gains, os.path.basename(os.path.normpath(path)), s, path) for s in mine}
        for s in mine:
            w, pack, n = folded[s], self.packs[s], len(feats)
            if self.slots[s].full:
                w = dataclasses.replace(w, w_enc=_bf16(w.w_enc), w_dec=_bf16(w.w_dec))
                f = w.meta.d_sae
                w_enc, b_enc, thr_f, w_dec, b_dec = pack[8:13]
                _put(w_enc[:, :f], w.w_enc), w_enc[:, f:].zero_()
                _put(b_enc[:f], _folded_bias(w)), b_enc[f:].fill_(_PAD_BIAS)
                _put(thr_f[:f], _threshold(w)), thr_f[f:].zero_()
                _put(w_dec[:f], w.w_dec), w_dec[f:].zero_()
                _put(b_dec, w.b_dec)
            base, end = self.slot_base[s], self.slot_base[s] + self.slots[s].features
            for t, a in zip(pack[3:8], _clampable(w, feats)):
                _put(t[base : base + n], a)
                t[base + n : end].zero_()
        return mine
