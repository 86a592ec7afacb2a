"""Inputs shared by the GPU tests of the steered norm kernels (plain, SAE, conditional, transcoder): the dtypes,
the usual tolerances, one case's stream, residual, norm weight and two steering tables, the fixture that keeps the
references' matmuls in true float32, and the comparison of a kernel's outputs with the reference's."""

from __future__ import annotations

import pytest
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
    plain kernel's (``plain``), bit for bit. ``slack``: per element bounds (output, residual) [N, D] added to
    ``tol``'s, for a kernel whose error is derived per element (full SAE packs)."""
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
    assert torch.equal(got[0][idle], plain[0][idle]) and torch.equal(got[1][idle], plain[1][idle])
