"""bfloat16 in plain numpy (numpy has no bf16): raw 16-bit words <-> float32, round-to-nearest-even
exactly as torch casts, so the client, the front end and the worker need no torch for it. Where torch is already
loaded (every vLLM process) ``to_bits`` lets it round: the same words, ~4x faster at 8b's 393k values (the front
end's float32 vectors; it also leaves the GIL for the cast)."""

from __future__ import annotations

import sys

import numpy as np


def from_bits(words: np.ndarray) -> np.ndarray:
    """uint16/int16 bf16 words -> float32 (exact)."""
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 words, round to nearest even (finite and inf inputs)."""
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    torch = sys.modules.get("torch")
    if torch is not None and f32.size >= 4096:  # torch's cast (small arrays: numpy's ops cost less than its call)
        return torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return numpy_to_bits(f32)


def numpy_to_bits(f32: np.ndarray) -> np.ndarray:
    """``to_bits`` in numpy alone (float32 ``f32``, contiguous): ``(u + 0x7FFF + (u >> 16 & 1)) >> 16``."""
    u = f32.view(np.uint32)
    r = u >> np.uint32(16)
    r &= np.uint32(1)
    r += u
    r += np.uint32(0x7FFF)
    r >>= np.uint32(16)
    return r.astype(np.uint16)


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, as float32."""
    return from_bits(to_bits(values))
