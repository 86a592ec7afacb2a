"""The config hash: one key per distinct effective vector set, independent of how it was sent.

Domain-separated blake2b over (hook, layer, float32 bytes) in a fixed order. Floats and packed
inputs (any dtype that represents the values exactly) give the same key, so they share table
rows and prefix-cache salt.
"""

from __future__ import annotations

import hashlib

import numpy as np

from vllm_steer.hooks import HOOK_NAMES
from vllm_steer.spec import Vectors

_PERSON = b"vllm-steer-v1"
_ZERO = np.float32(0.0)


def config_hash(vectors: Vectors) -> str | None:
    """Hex key of a non-zero vector set; None for an empty one (unsteered)."""
    if not vectors:
        return None
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for hook in HOOK_NAMES:
        layers = vectors.get(hook)
        if not layers:
            continue
        ids = sorted(layers)
        h.update(hook.encode())
        h.update(np.asarray(ids, dtype="<i4").tobytes())
        # + 0.0 folds -0.0 into 0.0 so equal values hash equally
        h.update((np.stack([layers[i] for i in ids]).astype(np.float32, copy=False) + _ZERO).tobytes())
    return h.hexdigest()
