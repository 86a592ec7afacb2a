"""Vectors in table layout, and the config key: what a table row holds, and its name.

A config in table layout is, per hook point, the sorted layer ids and the rows in the model's
dtype, exactly the bytes the worker copies into its steering tables. The config key is a
domain-separated BLAKE3 hash of exactly those bytes, each hook's rows hashed on their own first
(BLAKE3: a vLLM dependency, ~3x SHA-256 here),
so equal rows share a key, a table row and prefix-cache salt, however they were sent (floats,
packed in any dtype, a named module). A packed request already in the model dtype is keyed and
shipped as it came: no float32 round trip (``raw_rows``). Clients often send the same vectors with every
request: ``checked_rows`` answers a block whose bytes it checked and hashed lately (twice) from memory: one
comparison of the bytes, or none for the very object ``server.base64_lift`` decoded before, instead of the checks
and BLAKE3. A packed block in another dtype (float32 vectors for a bfloat16 model) is rounded as the float32 path
rounds it and remembered the same way (``converted_rows``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from blake3 import blake3

from vllm_steer.core import bf16
from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.recent_blocks import PROBE, Recent
from vllm_steer.core.vectors import Vectors, stack_rows

_DOMAIN = b"vllm-steer-config-v4\0"
_ZERO = np.float32(0.0)
# dtype name -> (unsigned word type of one element, sign bit, exponent mask: all ones = Inf/NaN)
_WORDS = {
    "float32": (np.uint32, 0x80000000, 0x7F800000),
    "float16": (np.uint16, 0x8000, 0x7C00),
    "bfloat16": (np.uint16, 0x8000, 0x7F80),
}
_SIGNED = {np.uint32: np.int32, np.uint16: np.int16}

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
        out[hook] = (tuple(ids), _rows_bytes(stack_rows(layers, ids), dtype_name))
    return out


def _rows_bytes(rows: np.ndarray, dtype_name: str) -> bytes:
    """float32 rows -> their bytes in ``dtype_name``, -0.0 as 0.0; ValueError as ``check_representable``."""
    if (rows == _ZERO).any():  # + 0.0 folds -0.0 into 0.0, so equal values give equal bytes
        rows = rows + _ZERO
    raw = to_dtype_bytes(rows, dtype_name)
    check_representable(raw, dtype_name)
    return raw


def raw_rows(raw: bytes, layers: list[int], dtype_name: str, hidden: int) -> tuple[tuple[int, ...], bytes] | None:
    """Rows already in the model dtype -> (sorted ids, bytes) without all-zero rows (None: none
    left), the same bytes ``table_layout`` makes of the same values (-0.0 becomes 0.0). Raises
    ValueError on NaN or Inf. Checked on the bit patterns in three passes without temporaries
    (numpy, without the GIL): each row's largest word read signed (its largest positive element) and
    unsigned (its largest negative one, if any), and the smallest signed word (-0.0 is the only word
    that is the signed minimum); what is left is a few dozen numbers, looked at in Python."""
    word, sign, exponent = _WORDS[dtype_name]
    w = np.frombuffer(raw, dtype=word).reshape(len(layers), hidden)
    if not w.size:
        return None
    signed = w.view(_SIGNED[word])
    top_signed, top = signed.max(axis=1).tolist(), w.max(axis=1).tolist()
    if max(top_signed) >= exponent or max(top) >= (sign | exponent):  # all exponent bits set: Inf or NaN
        raise ValueError("contains NaN or Inf")
    negative_zero = signed.min() == -sign
    keep = None  # every row has a nonzero magnitude, positive or negative (a positive maximum: the usual case)
    if min(top_signed) <= 0:
        nonzero = [s > 0 or u > sign for s, u in zip(top_signed, top)]
        keep = None if all(nonzero) else np.array(nonzero)
    if keep is None and layers == sorted(layers):  # the usual case: every row, in order (no index twice: spec checks)
        if not negative_zero:
            return tuple(layers), bytes(raw)
        order = None
    else:
        order = np.argsort(np.asarray(layers), kind="stable")
        if keep is not None:
            order = order[keep[order]]
        if not order.size:
            return None
    if negative_zero:
        w = np.where(w == word(sign), word(0), w)
    if order is None:
        return tuple(layers), w.tobytes()
    return tuple(np.asarray(layers)[order].tolist()), w[order].tobytes()


class KeyHasher:
    """The config key of a layout fed hook by hook in HOOK_NAMES order (``add``), so a caller can hash each
    hook's rows while they are still in cache; ``layout_key`` is this over a whole layout."""

    def __init__(self, dtype_name: str) -> None:
        self._h = blake3(_DOMAIN + dtype_name.encode() + b"\0")
        self._any = False

    def add(self, hook: str, ids: tuple[int, ...], raw: bytes, digest: bytes | None = None) -> None:
        """``digest``: ``rows_digest(raw)`` when the caller has it already (``checked_rows``)."""
        # the rows' own digest, not the rows after the hook's header: BLAKE3 hashes its widest (16 chunks at once
        # with AVX-512) from the start of its input, and ramps up again after every unaligned header (~20% slower)
        self._h.update(hook.encode() + b"\0" + np.asarray(ids, dtype="<i4").tobytes() + (digest or rows_digest(raw)))
        self._any = True

    def key(self) -> str | None:
        """Hex key; None when nothing was added (unsteered)."""
        return self._h.hexdigest()[:32] if self._any else None


def rows_digest(raw: bytes) -> bytes:
    """What ``KeyHasher.add`` folds into the key for one hook's rows."""
    return blake3(raw).digest()


CHECKED = Recent(64 * 1024 * 1024)  # fingerprint, layers, dtype, hidden -> (block, rows, digest): core.recent_blocks


def _held(raw: bytes, rows: tuple | None) -> int:
    """Bytes an entry keeps: the block, and its rows where they are another object (reordered, -0.0 folded)."""
    return len(raw) + (len(rows[1]) if rows is not None and rows[1] is not raw else 0)


def checked_rows(raw: bytes, layers: list[int], dtype_name: str,
                 hidden: int) -> tuple[tuple[tuple[int, ...], bytes] | None, bytes | None]:
    """(``raw_rows`` of the block, ``rows_digest`` of those rows; None, None: no row left), from memory when the
    same bytes came lately with the same layers (``CHECKED``). ValueError as ``raw_rows`` (never remembered)."""
    key = (len(raw), raw[:PROBE], raw[-PROBE:], tuple(layers), dtype_name, hidden)
    known = _remembered(key, raw)
    if known is not None:
        return known[1], known[2]
    rows = raw_rows(raw, layers, dtype_name, hidden) if layers else None
    digest = rows_digest(rows[1]) if rows is not None else None
    if isinstance(raw, bytes):  # immutable: its bytes cannot change under the entry
        CHECKED.put(key, lambda: ((raw, rows, digest), _held(raw, rows)))
    return rows, digest


def _remembered(key: tuple, raw: bytes) -> tuple | None:
    """``CHECKED``'s entry for ``key`` if it holds these very bytes (base64_lift's block, or equal bytes), else None."""
    known = CHECKED.get(key)
    return known if known is not None and (known[0] is raw or known[0] == raw) else None


def _converted_key(raw: bytes, layers: list[int], src_dtype: str, dtype_name: str, hidden: int) -> tuple:
    return (len(raw), raw[:PROBE], raw[-PROBE:], tuple(layers), src_dtype, dtype_name, hidden)


def converted_known(raw: bytes, layers: list[int], src_dtype: str, dtype_name: str, hidden: int) -> bool:
    """Whether ``converted_rows`` of this block would come from memory (no conversion: light work)."""
    return _remembered(_converted_key(raw, layers, src_dtype, dtype_name, hidden), raw) is not None


def converted_rows(raw: bytes, layers: list[int], src_dtype: str, dtype_name: str, hidden: int,
                   decode: Callable[[], np.ndarray]) -> tuple[tuple[tuple[int, ...], bytes] | None, bytes | None]:
    """A packed block in another dtype than the model's (float32 vectors for a bfloat16 model, say) -> what the
    general path makes of it: ``table_layout`` of its nonzero rows (sorted layers, -0.0 as 0.0, rounded to
    ``dtype_name``) and their ``rows_digest`` (None, None: no row left); from ``CHECKED`` when the same bytes came
    lately in the same dtype with the same layers. ``decode()``: the block as float32 ``[n, hidden]``. ValueError on
    NaN or Inf, sent or once rounded (never remembered)."""
    key = _converted_key(raw, layers, src_dtype, dtype_name, hidden)
    known = _remembered(key, raw)
    if known is not None:
        return known[1], known[2]
    values = decode()
    if not np.isfinite(values).all():
        raise ValueError("contains NaN or Inf")
    keep = values.any(axis=1).tolist()
    ids = sorted(layer for layer, k in zip(layers, keep) if k)
    rows = digest = None
    if ids:
        at = {layer: i for i, layer in enumerate(layers)}
        out = _rows_bytes(values[[at[layer] for layer in ids]], dtype_name)  # table_layout's rows of these values
        rows, digest = (tuple(ids), out), rows_digest(out)
    if isinstance(raw, bytes):
        CHECKED.put(key, lambda: ((raw, rows, digest), _held(raw, rows)))
    return rows, digest


def layout_key(layout: Layout, dtype_name: str) -> str | None:
    """Hex key of a config in table layout; None for an empty one (unsteered)."""
    if not layout:
        return None
    h = KeyHasher(dtype_name)
    for hook in HOOK_NAMES:
        entry = layout.get(hook)
        if entry is not None:
            h.add(hook, *entry)
    return h.key()


def config_hash(vectors: Vectors, dtype_name: str) -> str | None:
    """The key of float32 vectors as the tables would hold them in ``dtype_name``."""
    return layout_key(table_layout(vectors, dtype_name), dtype_name)
