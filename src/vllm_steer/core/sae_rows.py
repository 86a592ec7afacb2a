"""A request's SAE clamps as they travel and as they are keyed: per SAE site, the row of the site's
clamp tables (mode, and per clampable slot a kind code and a value), in a wire form of plain bytes
(msgspec carries it unchanged), and the config key of vectors + clamps (BLAKE3 with its own domain
separator: an SAE config never shares a key, a row or a prefix-cache salt with a vector config)."""

from __future__ import annotations

import numpy as np
from blake3 import blake3

from vllm_steer.core.hooks import HOOK_NAMES

_DOMAIN = b"vllm-steer-sae-v1\0"
OFF, DELTA, RECONSTRUCT = 0, 1, 2  # row modes (kernels/sae_clamp)
NONE, SET, ADD, SCALE = 0, 1, 2, 3  # clamp kinds
ONLY_IF_ACTIVE = 4  # code bit

# [name, hook, layer, mode, slots (int32 bytes), codes (int32 bytes), values (float32 bytes)], slots ascending
SaeWire = list


def wire_entry(name: str, hook: str, layer: int, mode: int, slots: np.ndarray, codes: np.ndarray,
               values: np.ndarray) -> SaeWire:
    order = np.argsort(slots, kind="stable")
    v = values.astype(np.float32)[order] + np.float32(0.0)  # -0.0 as 0.0: equal clamps, equal bytes
    return [name, hook, int(layer), int(mode), slots.astype(np.int32)[order].tobytes(),
            codes.astype(np.int32)[order].tobytes(), v.tobytes()]


def sorted_entries(entries: list[SaeWire]) -> list[SaeWire]:
    """Entries in site order (hook order, then layer; then name: a residual SAE and a transcoder may share a
    site): the order the key hashes them in."""
    return sorted(entries, key=lambda e: (HOOK_NAMES.index(e[1]), e[2], e[0]))


def unpack_entry(entry: SaeWire) -> tuple[str, str, int, int, np.ndarray, np.ndarray, np.ndarray]:
    name, hook, layer, mode, slots, codes, values = entry
    return (name, hook, layer, mode, np.frombuffer(slots, dtype=np.int32), np.frombuffer(codes, dtype=np.int32),
            np.frombuffer(values, dtype=np.float32))


def sae_config_key(vector_key: str | None, entries: list[SaeWire], identity: dict[str, str]) -> str | None:
    """The key of a phase's vectors (``vector_key``, None: none) plus its SAE clamps; without clamps,
    the vector key itself. ``identity``: each SAE name's identity (its files), hashed in."""
    if not entries:
        return vector_key
    h = blake3(_DOMAIN + (vector_key or "").encode() + b"\0")
    for name, hook, layer, mode, slots, codes, values in sorted_entries(entries):
        h.update(identity[name].encode() + b"\0" + f"{hook}\0{layer}\0{mode}\0".encode())
        h.update(len(slots).to_bytes(4, "little") + slots + codes + values)
    return h.hexdigest()[:32]
