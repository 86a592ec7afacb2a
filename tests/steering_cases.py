"""Deterministic steering vectors and request builders shared by the tests."""

from __future__ import annotations

import numpy as np


def vector(hidden: int, seed: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(hidden).astype(np.float32)
    return v / np.linalg.norm(v) * np.float32(scale)


def params(max_tokens: int = 12, *, logprobs: bool = True, prompt_logprobs: bool = False, **steering) -> dict:
    """SamplingParams kwargs: greedy, EOS ignored; steering fields go to extra_args as given."""
    p = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    if logprobs:
        p["logprobs"] = 0
    if prompt_logprobs:
        p["prompt_logprobs"] = 0
    extra = {k: v for k, v in steering.items() if v is not None}
    if extra:
        p["extra_args"] = extra
    return p


def floats(hook: str, layer: int, vec: np.ndarray) -> dict:
    """{hook: {layer: [floats]}}: the inline float form."""
    return {hook: {str(layer): [float(x) for x in vec]}}
