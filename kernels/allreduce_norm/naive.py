"""The reference of ``triton.py``: vLLM's unfused path at TP > 1, an all-reduce of the partial sums, then the fused
add + RMSNorm, in float32: ``s = sum_r x_r + residual``, ``out = s / rms(s) * weight``; ``residual`` becomes ``s``."""

from __future__ import annotations

import torch


def add_rms_norm(total: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new residual) of the reduced ``total`` ([T, D], the ranks' partial sums added) and ``residual``, in
    the inputs' dtype: the float32 sum rounded once, as the kernel stores it."""
    s = total.float() + residual.float()
    out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(residual.dtype), s.to(residual.dtype)


def partials_sum(partials: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' partial sums added in rank order in float32 (what every rank's kernel computes, bit for bit alike
    on every rank)."""
    total = torch.zeros_like(partials[0], dtype=torch.float32)
    for p in partials:
        total += p.float()
    return total
