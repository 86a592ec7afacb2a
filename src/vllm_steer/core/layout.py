"""Vectors in table layout, and the config key: what a table row holds, and its name.

A config in table layout is, per hook point, the sorted layer ids and the rows in the model's
dtype, exactly the bytes the worker copies into its steering tables. The config key is a
domain-separated BLAKE3 hash of exactly those bytes (BLAKE3: a vLLM dependency, ~3x SHA-256 here),
so equal rows share a key, a table row and prefix-cache salt, however they were sent (floats,
packed in any dtype, a named module). A packed request already in the model dtype is keyed and
shipped as it came: no float32 round trip (``raw_rows``).
"""

from __future__ import annotations

import numpy as np
from blake3 import blake3

from vllm_steer.core import bf16
from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.vectors import Vectors, stack_rows

_DOMAIN = b"vllm-steer-config-v3\0"
_ZERO = np.float32(0.0)
# dtype name -> (unsigned word type of one element, sign bit, exponent mask: all ones = Inf/NaN)
_WORDS = {
    "float32": (np.uint32, 0x80000000, 0x7F800000),
    "float16": (np.uint16, 0x8000, 0x7C00),
    "bfloat16": (np.uint16, 0x8000, 0x7F80),
}

Layout = dict[str, tuple[tuple[int, ...], bytes]]  # hook -> (sorted layer ids, [n, D] rows in the dtype)


def itemsize(dtype_name: str) -> int:
    return 4 if dtype_name == "float32" else 2


def to_dtype_bytes(arr: np.ndarray, dtype_name: str) -> bytes:
    """float32 rows -> raw bytes in the model dtype (bf16 rounded to nearest even, as torch does)."""
    f32 = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype_name == "float32":
        return f32.tobytes()
    if dtype_name == "float16":
        return f32.astype(np.float16).tobytes()
    words = f32.view(np.uint32)
    if not (words & np.uint32(0xFFFF)).any():  # already on the bf16 grid: no rounding
        return (words >> np.uint32(16)).astype(np.uint16).tobytes()
    return bf16.to_bits(f32).tobytes()


_MAX = {"float32": "3.4e38", "float16": "65504", "bfloat16": "3.39e38"}


def check_representable(raw: bytes, dtype_name: str) -> None:
    """ValueError if rows in ``dtype_name`` hold Inf or NaN: values (e.g. a vector times a scale, or
    a sum of tiers) that overflowed the model's dtype on the way into the table."""
    word, _, exponent = _WORDS[dtype_name]
    w = np.frombuffer(raw, dtype=word)
    if w.size and ((w & word(exponent)) == word(exponent)).any():
        raise ValueError(f"does not fit the model's dtype {dtype_name} (largest magnitude {_MAX[dtype_name]}): "
                         "a value is NaN or Inf once scaled, summed and converted")


def table_layout(vectors: Vectors, dtype_name: str) -> Layout:
    """float32 vectors -> table layout in ``dtype_name`` (hooks in HOOK_NAMES order, -0.0 as 0.0).
    ValueError if a value does not fit ``dtype_name`` (``check_representable``)."""
    out: Layout = {}
    for hook in HOOK_NAMES:
        layers = vectors.get(hook)
        if not layers:
            continue
        ids = sorted(layers)
        rows = stack_rows(layers, ids)
        if (rows == _ZERO).any():  # + 0.0 folds -0.0 into 0.0, so equal values give equal bytes
            rows = rows + _ZERO
        raw = to_dtype_bytes(rows, dtype_name)
        check_representable(raw, dtype_name)
        out[hook] = (tuple(ids), raw)
    return out


def raw_rows(raw: bytes, layers: list[int], dtype_name: str, hidden: int) -> tuple[tuple[int, ...], bytes] | None:
    """Rows already in the model dtype -> (sorted ids, bytes) without all-zero rows (None: none
    left), the same bytes ``table_layout`` makes of the same values (-0.0 becomes 0.0). Raises
    ValueError on NaN or Inf. Checked on the bit patterns: three passes over the data (the
    magnitudes, their per-row maximum, the -0.0 test), each in numpy without the GIL."""
    word, sign, exponent = _WORDS[dtype_name]
    w = np.frombuffer(raw, dtype=word).reshape(len(layers), hidden)
    magnitude = w & word(sign - 1)  # every bit but the sign
    row_max = magnitude.max(axis=1) if magnitude.size else np.zeros(len(layers), dtype=word)
    if row_max.size and row_max.max() >= exponent:  # all exponent bits set: Inf or NaN
        raise ValueError("contains NaN or Inf")
    keep = row_max > 0
    order = np.argsort(np.asarray(layers), kind="stable")
    order = order[keep[order]]
    if not order.size:
        return None
    changed = order.size != len(layers) or bool((order != np.arange(len(layers))).any())
    negative_zero = w == word(sign)
    if negative_zero.any():
        w = np.where(negative_zero, word(0), w)
        changed = True
    if changed:
        w = w[order]
    ids = tuple(int(layers[i]) for i in order)
    return ids, (w.tobytes() if changed else bytes(raw))


def layout_key(layout: Layout, dtype_name: str) -> str | None:
    """Hex key of a config in table layout; None for an empty one (unsteered)."""
    if not layout:
        return None
    h = blake3(_DOMAIN + dtype_name.encode() + b"\0")
    for hook in HOOK_NAMES:
        entry = layout.get(hook)
        if entry is None:
            continue
        ids, raw = entry
        h.update(hook.encode() + b"\0")
        h.update(np.asarray(ids, dtype="<i4").tobytes())
        h.update(raw)
    return h.hexdigest()[:32]


def config_hash(vectors: Vectors, dtype_name: str) -> str | None:
    """The key of float32 vectors as the tables would hold them in ``dtype_name``."""
    return layout_key(table_layout(vectors, dtype_name), dtype_name)
