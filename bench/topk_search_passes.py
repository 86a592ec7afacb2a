"""Passes over a token's row that the full SAE's TopK search (``kernels/sae_clamp/full_triton._select``, the
in-register path) makes, in a numpy model of it: one bit a pass (the engine's), and begun by histogram rounds
(``_bucket_rounds``, ``Tuning.select_bits`` / ``select_rounds``); each model's selected set is checked against the
row's k largest. Rows: 16384 Gaussian pre-activations at scales 0.1-3, a third rounded to 2 decimals (ties), k 64,
64 groups for the lower bound. Counts only: which is faster on a GPU is for ``sae_kernel_bench.py --topk-sweep``.
Usage: python3 bench/topk_search_passes.py [--rows 200]"""

from __future__ import annotations

import argparse

import numpy as np

K, F, GROUPS = 64, 16384, 64


def _keys(v: np.ndarray) -> np.ndarray:
    """``_key``: relu's order as the float32's bits (0 for v <= 0)."""
    return np.maximum(v.astype(np.float32).view(np.int32), 0).astype(np.int64)


def _bounds(key: np.ndarray) -> tuple[int, int]:
    """(lo, hi): the smallest of the groups' largest keys (0 when fewer than K groups reach 0) and the largest."""
    g = key.reshape(GROUPS, -1).max(1)
    return (int(g.min()) if (g >= 0).sum() >= K else 0), int(key.max())


def one_bit(key: np.ndarray, thr: int, b: int, lo: int, hi: int) -> tuple[int, int]:
    """(threshold, counted passes) of the one-bit search from bit b down."""
    passes = 0
    while b >= 0:
        cand = thr | (1 << b)
        if cand <= lo:
            cnt = K + 1
        elif cand > hi:
            cnt = 0
        else:
            cnt, passes = int((key >= cand).sum()), passes + 1
        thr = cand if cnt >= K else thr
        b = -1 if cnt == K else b - 1
    return thr, passes


def bucketed(key: np.ndarray, bits: int, rounds: int) -> tuple[int, int, int]:
    """(threshold, histogram rounds, counted passes after them) of ``_bucket_rounds`` then the one-bit search (the
    first fixed bit exact here; the kernel's float32 estimate may fix one bit fewer)."""
    lo, hi = _bounds(key)
    p = min((lo ^ hi).bit_length(), 31)
    thr, above, done, n = hi >> p << p, 0, p == 0, 0
    for _ in range(rounds):
        if done:
            break
        shift = max(p - bits, 0)
        inside = (key >> p) == (thr >> p)
        h = np.bincount((key[inside] >> shift) & ((1 << (p - shift)) - 1), minlength=1 << bits)
        ge = above + np.cumsum(h[::-1])[::-1]
        ok = np.nonzero(ge >= K)[0]
        j = int(ok.max()) if len(ok) else 0
        done, above, thr, p, n = bool(ge[j] == K), int(ge[j] - h[j]), thr | (j << shift), shift, n + 1
        done = done or p == 0
    if done:
        return thr, n, 0
    thr, passes = one_bit(key, thr, p - 1, lo, hi)
    return thr, n, passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(args.rows):
        v = rng.standard_normal(F) * rng.uniform(0.1, 3)
        rows.append(_keys(np.round(v, 2) if i % 3 == 0 else v))
    want = [np.sort(key)[-K] for key in rows]  # the K-th largest key

    def check(key, thr, kth):  # the same set as the K-th largest key's: as many keys reach either
        assert (key >= thr).sum() == (key >= kth).sum(), (thr, kth)

    passes = []
    for key, kth in zip(rows, want):
        lo, hi = _bounds(key)
        thr, n = one_bit(key, 0, 30, lo, hi)
        check(key, thr, kth)
        passes.append(n)
    print(f"one bit a pass: {np.mean(passes):.1f} passes mean, {max(passes)} max")
    for bits, rounds in ((5, 1), (5, 2), (6, 1), (6, 2), (8, 1), (8, 2)):
        r, p = [], []
        for key, kth in zip(rows, want):
            thr, n, m = bucketed(key, bits, rounds)
            check(key, thr, kth)
            r.append(n)
            p.append(m)
        print(f"{1 << bits} bins x {rounds}: {np.mean(r):.2f} histogram rounds + {np.mean(p):.1f} passes mean "
              f"({max(p)} max)")


if __name__ == "__main__":
    main()
