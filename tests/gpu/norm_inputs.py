"""Inputs shared by the GPU tests of the steered norm kernels (plain, SAE, conditional, transcoder): the dtypes,
the usual tolerances, one case's stream, residual, norm weight and two steering tables, the fixture that keeps the
references' matmuls in true float32, the comparison of a kernel's outputs with the reference's, and of its rows that
should be another specialization's (``same_rows``)."""

from __future__ import annotations

import pytest
import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}

# float32 outputs of two specializations of the norm (EARLY or late, with or without projections, SAE, conditions) may
# sum a row's squares in another order. Each pairwise sum of D <= 8192 squares is within log2(D) <= 13 roundings
# (u = eps / 2) of the exact one, so two orders differ by <= 13 eps relative; the rsqrt halves that (6.5 eps) and
# the products after it round once more on each side: within 8 eps of the row's largest entry. Anything real (a
# vector missed or added twice, a row projected or clamped that should not be) moves a row by >= 1e-3 of it.
F32_ROW_ULPS = 8


def same_rows(a: torch.Tensor, b: torch.Tensor) -> None:
    """Rows ``a`` as another specialization's ``b``: bf16 / fp16 bit for bit; float32 within F32_ROW_ULPS eps of each
    row's largest entry (s29's H100: EARLY's float32 rows differed from the late kernel's in the last ulp)."""
    if a.dtype != torch.float32:
        assert torch.equal(a, b)
        return
    eps = torch.finfo(torch.float32).eps
    for ra, rb in zip(a.reshape(-1, a.shape[-1]).cpu(), b.reshape(-1, b.shape[-1]).cpu()):
        torch.testing.assert_close(ra, rb, rtol=0, atol=F32_ROW_ULPS * eps * float(rb.abs().max()))


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


@pytest.fixture
def full_fp32_matmuls():
    """The reference's matmuls in true float32 (no TF32), whatever the process set (``usefixtures``)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def check_outputs(got, want, plain, index, tol: dict, ambiguous: torch.Tensor, idle_rows, slack=None) -> None:
    """The kernel's (output, residual) as the reference's within ``tol`` for every token not on a threshold
    (``ambiguous``: rounding may flip a feature there; most tokens must remain), and tokens of ``idle_rows`` as the
    plain kernel's (``plain``, ``same_rows``: bit for bit but for float32's last ulp). ``slack``: per element bounds
    (output, residual) [N, D] added to ``tol``'s, for a kernel whose error is derived per element (full SAE packs)."""
    n = got[0].shape[0]
    rows = index[:n].long()
    keep = ~ambiguous
    assert n <= 2 or int(keep.sum()) >= (n + 1) // 2, "too many tokens on a threshold: the case is degenerate"
    for i, (g, w) in enumerate(zip(got, want)):
        if slack is None:
            torch.testing.assert_close(g[keep], w[keep], **tol)
            continue
        g, w = g[keep].float(), w[keep].float()
        err = (g - w).abs()
        bound = tol["atol"] + tol["rtol"] * w.abs() + slack[i][keep]
        bad = ~(err <= bound)  # NaN fails
        assert not bad.any(), (f"{'output' if i == 0 else 'residual'}: {int(bad.sum())} / {bad.numel()} elements "
                               f"off, worst {float((err - bound).max()):.3g} over its bound "
                               f"(err {float(err[bad].max()):.3g}, slack up to {float(slack[i].max()):.3g})")
    idle = torch.isin(rows, torch.tensor(idle_rows, device=rows.device))
    same_rows(got[0][idle], plain[0][idle])
    same_rows(got[1][idle], plain[1][idle])
