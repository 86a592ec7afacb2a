"""The Triton kernels (steered_rms_norm, capture_rows) against their plain-torch references, run by
Triton's CPU interpreter. Only meaningful with TRITON_INTERPRET=1 set before Triton is imported:
``tests/test_steered_norm.py`` runs this directory in such a process (``./dev test`` ignores it)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_steered_norm import DTYPES, NORMS, _case, _off, _on, vllm_norm  # noqa: F401 (fixture)
from vllm_steer.kernels.capture_rows import naive as capture_naive
from vllm_steer.kernels.steered_rms_norm.naive import steered_rms_norm_naive

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def interpreted():
    import vllm_steer.kernels.capture_rows.triton as cap
    import vllm_steer.kernels.steered_rms_norm.triton as norm

    return norm, cap


# The interpreter rounds float32 -> bfloat16 by truncation (numpy has no bf16), a GPU to nearest:
# bf16 gets one unit in the last place; float32 sums in another order.
_TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("tables", ["none", "a", "b", "ab"])
def test_triton_kernel_matches_reference(interpreted, vllm_norm, kind, dtype_name, tables):
    norm, _ = interpreted
    dtype = DTYPES[dtype_name]
    m, offset = vllm_norm(kind, 80, dtype, seed=9)  # D not a power of two: masked lanes
    x, r, (ta, tb), index = _case(7, 80, dtype, seed=10)
    args = (ta if "a" in tables else None, _on() if "a" in tables else None,
            tb if "b" in tables else None, _on() if "b" in tables else None)
    got = norm.steered_rms_norm_triton(x, r, m.weight.data, 1e-5, offset, index, *args)
    want = steered_rms_norm_naive(x, r, m.weight.data, 1e-5, offset, index, *args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **_TOL[dtype])


def test_triton_idle_flag_skips_the_table(interpreted):
    norm, _ = interpreted
    x, r, (ta, _), index = _case(4, 32, torch.float32, seed=11)
    w = torch.ones(32)
    idle = norm.steered_rms_norm_triton(x, r, w, 1e-5, 0.0, index, ta, _off())
    plain = steered_rms_norm_naive(x, r, w, 1e-5, 0.0, torch.zeros_like(index))
    for a, b in zip(idle, plain):
        torch.testing.assert_close(a, b, **_TOL[torch.float32])


@pytest.mark.parametrize("with_b", [True, False], ids=["a+b", "a"])
@pytest.mark.parametrize("with_table", [True, False], ids=["table", "no-table"])
def test_capture_rows_triton_matches_reference(interpreted, with_b, with_table):
    _, cap = interpreted
    x, r, (ta, _), index = _case(9, 40, torch.float32, seed=12)
    plan = torch.full((14,), -1, dtype=torch.int32)
    plan[[1, 4, 5, 8]] = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    table = (ta, _on(), index) if with_table else (None, None, None)
    want = torch.full((5, 40), float("nan"))
    got = want.clone()
    capture_naive.capture_rows_naive(want, x, r if with_b else None, plan, *table)
    cap.capture_rows_triton(got, x, r if with_b else None, plan, *table)
    torch.testing.assert_close(got, want, equal_nan=True, **_TOL[torch.float32])
    assert torch.isnan(got[4]).all()  # rows no token was planned for are untouched
    expect = x[4] + (r[4] if with_b else 0) + (ta[index[4].long()] if with_table else 0)
    torch.testing.assert_close(got[0], expect, rtol=1e-6, atol=1e-6)
