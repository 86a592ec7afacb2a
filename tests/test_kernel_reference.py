"""The apply_steering op on CPU: registered op == plain-torch reference; idle and row 0 untouched."""

from __future__ import annotations

import pytest
import torch

from vllm_steer.kernels.apply_steering import op
from vllm_steer.kernels.apply_steering.naive import apply_steering_naive


@pytest.fixture(scope="module", autouse=True)
def registered():
    op.register()


@pytest.mark.parametrize("n,d,dtype", [(1, 8, torch.float32), (37, 64, torch.float32), (256, 576, torch.bfloat16)],
                         ids=lambda v: str(v))
def test_registered_op_matches_reference_and_leaves_row0_tokens_bitwise(n, d, dtype):
    g = torch.Generator().manual_seed(n)
    table = torch.randn(5, d, generator=g).to(dtype)
    table[0] = 0
    index = torch.randint(0, 5, (n + 3,), generator=g, dtype=torch.int32)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    expected = hidden.clone()
    apply_steering_naive(expected, table, index, torch.ones(1, dtype=torch.uint8))
    got = hidden.clone()
    op.apply_steering_(got, table, index, torch.ones(1, dtype=torch.uint8))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    row0 = index[:n] == 0
    assert torch.equal(got[row0], hidden[row0])


def test_idle_table_is_a_no_op():
    hidden = torch.randn(4, 8)
    before = hidden.clone()
    op.apply_steering_(hidden, torch.ones(3, 8), torch.ones(4, dtype=torch.int32), torch.zeros(1, dtype=torch.uint8))
    assert torch.equal(hidden, before)
