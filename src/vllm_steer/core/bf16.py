"""bfloat16 in plain numpy (numpy has no bf16): raw 16-bit words <-> float32, round-to-nearest-even
exactly as torch casts, so the client, the front end and the worker need no torch for it."""

from __future__ import annotations

import numpy as np


def from_bits(words: np.ndarray) -> np.ndarray:
    """uint16/int16 bf16 words -> float32 (exact)."""
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 words, round to nearest even (finite and inf inputs)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, as float32."""
    return from_bits(to_bits(values))
