"""Inputs shared by the GPU tests of the steered norm kernels (plain, SAE, conditional): the dtypes, the
usual tolerances, and one case's stream, residual, norm weight and two steering tables."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def norm_inputs(g: torch.Generator, n: int, d: int, dtype: torch.dtype, rows: int, device: str = "cuda"):
    """(x [n, d], residual, weight [d], table A [rows, d], table B), drawn from ``g`` in that order; row 0
    of each table is zero (the unsteered row)."""
    x = torch.randn(n, d, generator=g, device=device).to(dtype)
    r = (torch.randn(n, d, generator=g, device=device) * 3).to(dtype)
    w = (torch.randn(d, generator=g, device=device) * 0.5).to(dtype)
    ta, tb = ((torch.randn(rows, d, generator=g, device=device) * 2).to(dtype) for _ in range(2))
    ta[0].zero_()
    tb[0].zero_()
    return x, r, w, ta, tb
