"""Plain-torch reference of SAE feature clamping: the spec (README.md) in the fewest lines.

Per token ``t`` whose row ``r = index[t]`` is not 0 and whose row mode is not OFF, in float32 whatever
the weights' dtype: encode the stream, apply the activation, clamp the row's features, then either add
the clamped features' decoder delta (DELTA) or replace the stream by the decoded features (RECONSTRUCT).
Tokens of row 0 (or an OFF row) come back unchanged, bit for bit. One function per architecture (``relu``,
``jumprelu``, ``topk``: the activation; ``transcoder_clamp_naive``: a transcoder's edit of the MLP output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# activations
RELU, JUMPRELU, TOPK = 0, 1, 2
# clamp kinds (per row, per feature): 0 leaves the feature alone
NONE, SET, ADD, SCALE = 0, 1, 2, 3
# row modes
OFF, DELTA, RECONSTRUCT = 0, 1, 2


@dataclass(frozen=True)
class Sae:
    """One site's SAE: ``pre = (x - b_dec * b_dec_in) @ w_enc + b_enc``; ``x_hat = f @ w_dec + b_dec``."""

    w_enc: torch.Tensor  # [D, F]
    b_enc: torch.Tensor  # [F]
    w_dec: torch.Tensor  # [F, D]
    b_dec: torch.Tensor  # [D]
    activation: int = RELU
    threshold: torch.Tensor | None = None  # [F], JUMPRELU
    k: int = 0  # TOPK
    b_dec_in: bool = False  # sae-lens' apply_b_dec_to_input


# One function per architecture, as sae-lens has one class each: the activation of the pre-activations.
def relu(sae: Sae, pre: torch.Tensor) -> torch.Tensor:
    return torch.relu(pre)


def jumprelu(sae: Sae, pre: torch.Tensor) -> torch.Tensor:
    return torch.relu(pre) * (pre > sae.threshold.float())  # sae-lens' JumpReLU


def topk(sae: Sae, pre: torch.Tensor) -> torch.Tensor:
    top = torch.topk(pre, sae.k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))


ARCHITECTURES = {RELU: relu, JUMPRELU: jumprelu, TOPK: topk}


def encode(sae: Sae, x: torch.Tensor) -> torch.Tensor:
    """Feature activations ``f`` [N, F] of the stream ``x`` [N, D], in float32."""
    xf = x.float()
    if sae.b_dec_in:
        xf = xf - sae.b_dec.float()
    if sae.activation not in ARCHITECTURES:
        raise ValueError(f"unknown activation code {sae.activation}")
    return ARCHITECTURES[sae.activation](sae, xf @ sae.w_enc.float() + sae.b_enc.float())


def clamp(f: torch.Tensor, kind: torch.Tensor, value: torch.Tensor, only_if_active: torch.Tensor) -> torch.Tensor:
    """Clamped activations: per feature, SET to ``value``, ADD ``value``, SCALE by ``value`` (NONE:
    unchanged); where ``only_if_active`` is set, a feature that is not active (``f <= 0``) is left alone."""
    new = torch.where(kind == SET, value, torch.where(kind == ADD, f + value, torch.where(kind == SCALE, f * value, f)))
    gate = (kind != NONE) & ((only_if_active == 0) | (f > 0))
    return torch.where(gate, new, f)


def sae_clamp_naive(
    x: torch.Tensor,  # [N, D], the residual stream at the site
    index: torch.Tensor,  # [>= N] int32: each token's row (0: none)
    sae: Sae,
    mode: torch.Tensor,  # [R] int8: OFF / DELTA / RECONSTRUCT per row
    kind: torch.Tensor,  # [R, F] int8
    value: torch.Tensor,  # [R, F] float32
    only_if_active: torch.Tensor,  # [R, F] int8
) -> torch.Tensor:
    """The stream after each token's row's clamps; a fresh tensor in ``x``'s dtype."""
    n = x.shape[0]
    rows = index[:n].long()
    m = mode[rows]
    steered = m != OFF
    out = x.clone()
    if not bool(steered.any()):
        return out
    xs, rs, ms = x[steered], rows[steered], m[steered]
    f = encode(sae, xs)
    f_new = clamp(f, kind[rs], value[rs].float(), only_if_active[rs])
    w_dec = sae.w_dec.float()
    delta = xs.float() + (f_new - f) @ w_dec  # x + decode(f') - decode(f): the bias cancels
    recon = f_new @ w_dec + sae.b_dec.float()
    out[steered] = torch.where((ms == RECONSTRUCT)[:, None], recon, delta).to(x.dtype)
    return out


def transcoder_clamp_naive(
    mlp_in: torch.Tensor,  # [N, D], the MLP's input (layer L's pre-MLP norm output)
    index: torch.Tensor,  # [>= N] int32: each token's row (0: none)
    tc: Sae,  # a transcoder: w_enc [D, F], w_dec [F, D_out], b_dec [D_out] (sae-lens Transcoder; b_dec_in off)
    mode: torch.Tensor,  # [R] int8: OFF / DELTA per row (a transcoder does not reconstruct)
    kind: torch.Tensor,  # [R, F] int8
    value: torch.Tensor,  # [R, F] float32
    only_if_active: torch.Tensor,  # [R, F] int8
) -> torch.Tensor:
    """What each token's row's clamps add to the MLP's output [N, D_out] (float32): ``dec(f') - dec(f)`` =
    ``(f' - f) @ W_dec``, f encoded from ``mlp_in`` (b_dec and a skip transcoder's ``W_skip @ x`` cancel);
    zeros for row 0 / OFF rows."""
    n = mlp_in.shape[0]
    rows = index[:n].long()
    on = mode[rows] != OFF
    f = encode(tc, mlp_in)
    f_new = clamp(f, kind[rows], value[rows].float(), only_if_active[rows])
    return torch.where(on[:, None], (f_new - f) @ tc.w_dec.float(), torch.zeros((), dtype=torch.float32))
