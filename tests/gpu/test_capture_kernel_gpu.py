"""GPU: the Triton capture_rows kernel equals the plain-torch reference (bit for bit)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("n", [1, 7, 256, 2048])
@pytest.mark.parametrize("d", [64, 4096, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("with_b", [True, False], ids=["a+b", "a"])
@pytest.mark.parametrize("with_table", [True, False], ids=["table", "no-table"])
def test_capture_rows_triton_matches_naive(n, d, dtype, with_b, with_table):
    from vllm_steer.kernels.capture_rows.naive import capture_rows_naive
    from vllm_steer.kernels.capture_rows.triton import capture_rows_triton

    g = torch.Generator(device="cuda").manual_seed(n + d)
    a = torch.randn(n, d, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(n, d, device="cuda", dtype=dtype, generator=g) if with_b else None
    plan = torch.full((n + 5,), -1, dtype=torch.int32, device="cuda")
    take = torch.randperm(n, device="cuda", generator=g)[: max(1, n // 3)]
    plan[take] = torch.arange(take.numel(), dtype=torch.int32, device="cuda")
    table = (torch.randn(5, d, device="cuda", dtype=dtype, generator=g), torch.ones(1, dtype=torch.uint8, device="cuda"),
             torch.randint(0, 5, (n + 5,), device="cuda", dtype=torch.int32, generator=g)) if with_table else (None,) * 3
    if with_table:
        table[0][0].zero_()  # row 0 is the no-op row of every steering table
    want = torch.full((n + 2, d), float("nan"), device="cuda", dtype=dtype)
    got = want.clone()
    capture_rows_naive(want, a, b, plan, *table)
    capture_rows_triton(got, a, b, plan, *table)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
