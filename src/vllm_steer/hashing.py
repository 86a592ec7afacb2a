"""The config hash: one key per distinct effective vector set, independent of how it was sent.

Domain-separated SHA-256 (truncated to 128 bits) over (hook, layer, float32 bytes) in a fixed
order; SHA-256 because CPUs hash it in hardware (about twice blake2b's speed here). Floats and packed
inputs (any dtype that represents the values exactly) give the same key, so they share table
rows and prefix-cache salt.
"""

from __future__ import annotations

import hashlib

import numpy as np

from vllm_steer.hooks import HOOK_NAMES
from vllm_steer.spec import Vectors, stack_rows

_DOMAIN = b"vllm-steer-config-v2\0"
_ZERO = np.float32(0.0)


def config_hash(vectors: Vectors) -> str | None:
    """Hex key of a non-zero vector set; None for an empty one (unsteered)."""
    if not vectors:
        return None
    h = hashlib.sha256(_DOMAIN)
    for hook in HOOK_NAMES:
        layers = vectors.get(hook)
        if not layers:
            continue
        ids = sorted(layers)
        h.update(hook.encode())
        h.update(np.asarray(ids, dtype="<i4").tobytes())
        rows = stack_rows(layers, ids)
        if (rows == _ZERO).any():  # + 0.0 folds -0.0 into 0.0 so equal values hash equally
            rows = rows + _ZERO
        h.update(np.ascontiguousarray(rows, dtype=np.float32))
    return h.hexdigest()[:32]
