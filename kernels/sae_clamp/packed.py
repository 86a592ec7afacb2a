"""SAE clamping in the engine's layout (a site's "pack" of device tensors), in plain torch: what the
steered norm runs at a site with an SAE on CPU, and the spec its GPU twin is tested against. Same
math as ``naive.sae_clamp_naive`` (the README's formulas); the pack keeps the clampable features'
encoder columns / decoder rows apart so delta with ReLU / JumpReLU reads only those. A transcoder's pack has either
layout (full for a TopK transcoder: sparsify's); ``clamp_delta_naive`` gives its edit of the MLP's output
(``naive.transcoder_clamp_naive``).

A pack is a list of tensors, in this order (R rows of the row tables, C clampable features, D the
hidden size, F = d_sae; the full weights only at TopK sites or sites that allow reconstruct):

 0 mode     [R]    int32    per row: OFF 0 / DELTA 1 / RECONSTRUCT 2
 1 code     [R, C] int32    per row and feature: kind (NONE 0 / SET 1 / ADD 2 / SCALE 3) | 4 * only_if_active
 2 value    [R, C] float32
 3 enc      [C, D] float32  W_enc[:, features].T
 4 dec      [C, D] float32  W_dec[features]
 5 bias     [C]    float32  b_enc[features] - b_dec @ W_enc[:, features] if b_dec_in else b_enc[features]
 6 thr      [C]    float32  JumpReLU thresholds (0 for ReLU: relu(p) = p * (p > 0))
 7 features [C]    int64    the clampable features' ids
 8 w_enc    [D, F]          full weights (any float dtype; accumulated in float32)
 9 b_enc    [F]    float32  folded like ``bias``
10 thr_f    [F]    float32
11 w_dec    [F, D]
12 b_dec    [D]    float32
"""

from __future__ import annotations

import torch

from vllm_steer.kernels.sae_clamp.naive import ADD, RECONSTRUCT, SCALE, SET

N_CLAMP_ONLY, N_FULL = 8, 13  # pack lengths


def _full_features(xs: torch.Tensor, pack: list[torch.Tensor], topk: int) -> torch.Tensor:
    """Every feature's activation [n, F] (the full encoder)."""
    w_enc, b_enc, thr_f = pack[8], pack[9], pack[10]
    pre = xs @ w_enc.float() + b_enc
    if topk:
        top = torch.topk(pre, topk, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
    return torch.where(pre > thr_f, pre, torch.zeros_like(pre))


def _clamped(f: torch.Tensor, c: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """f' of the activations ``f`` under the codes ``c`` and values ``v`` (each token's row's)."""
    kind, only = c & 3, (c >> 2) & 1
    new = torch.where(kind == SET, v, torch.where(kind == ADD, f + v, torch.where(kind == SCALE, f * v, f)))
    return torch.where((kind != 0) & ((only == 0) | (f > 0)), new, f)


def clamp_delta_naive(x: torch.Tensor, rows: torch.Tensor, pack: list[torch.Tensor], topk: int = 0) -> torch.Tensor:
    """``sum_c (f'_c - f_c) dec[c]`` per token [N, D] (float32) of a pack's clamps (DELTA rows), f from ``x``
    [N, D] (float32): a clamp-only pack's clampable features, a full one's every feature (TopK of ``topk``, as
    ``apply_site_naive``); exactly 0 for tokens whose row mode is OFF. A transcoder's pack: what the clamps add to
    the MLP's output, ``x`` the MLP's input (the steered norm's output)."""
    mode, code, value, enc, dec, bias, thr, features = pack[:8]
    on = mode[rows] != 0
    if len(pack) == N_FULL:
        f = _full_features(x, pack, topk)[:, features]
    else:
        pre = x @ enc.T + bias
        f = torch.where(pre > thr, pre, torch.zeros_like(pre))
    delta = (_clamped(f, code[rows], value[rows]) - f) @ dec
    return torch.where(on[:, None], delta, torch.zeros_like(delta))


def apply_site_naive(s: torch.Tensor, rows: torch.Tensor, pack: list[torch.Tensor], topk: int) -> torch.Tensor:
    """The float32 stream ``s`` [N, D] after each token's row (``rows`` [N] int64) clamps this site.

    Dense over the batch and free of host syncs on a GPU (CUDA graphs replay it): every token is
    encoded, tokens whose row mode is OFF keep ``s`` bit for bit. On the host an idle site returns
    at once."""
    mode, code, value, enc, dec, bias, thr, features = pack[:8]
    m = mode[rows]
    on = m != 0
    if not s.is_cuda and not bool(on.any()):
        return s
    full = len(pack) == N_FULL
    if full:
        f_all = _full_features(s, pack, topk)
        f = f_all[:, features]
    else:
        pre = s @ enc.T + bias
        f = torch.where(pre > thr, pre, torch.zeros_like(pre))
    f_new = _clamped(f, code[rows], value[rows])
    base = s
    if full:
        recon = f_all @ pack[11].float() + pack[12]
        base = torch.where((m == RECONSTRUCT)[:, None], recon, s)
    return torch.where(on[:, None], base + (f_new - f) @ dec, s)
