"""Directions from paired activations: difference of means (CAA) and PCA of paired differences (repeng).

Both take ``pos``, ``neg``: ``[n_pairs, hidden]`` (row i of each is one pair) and return ``[hidden]``
float32. ``mean_diff`` keeps its natural scale; ``pca`` is unit-norm, as repeng's ``pca_diff``: the first
principal component of the (centered) differences, its sign chosen so that in most pairs the positive
side projects higher than the negative one.
"""

from __future__ import annotations

import numpy as np

METHODS = ("mean_diff", "pca")


def mean_diff(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    return (pos.astype(np.float64).mean(axis=0) - neg.astype(np.float64).mean(axis=0)).astype(np.float32)


def pca(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    diffs = pos.astype(np.float64) - neg.astype(np.float64)
    centered = diffs - diffs.mean(axis=0)
    if len(diffs) < 2 or not np.any(centered):
        raise ValueError("pca needs at least two pairs whose differences are not all equal")
    _, _, vt = np.linalg.svd(centered, full_matrices=False)
    direction = vt[0]
    higher = np.mean(pos @ direction > neg @ direction)
    lower = np.mean(pos @ direction < neg @ direction)
    if lower > higher:
        direction = -direction
    return direction.astype(np.float32)


def direction(method: str, pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    if method == "mean_diff":
        return mean_diff(pos, neg)
    if method == "pca":
        return pca(pos, neg)
    raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
