"""The one-shot all-reduce + add + RMSNorm kernel (``kernels/allreduce_norm``) run by Triton's CPU interpreter as a
TP group of one rank (its push, its wait on the sentinels, the sum, the norm, the epoch) against the reference; the
group of two is compiled for sm_90 only (``tests/test_kernels_compile.py``: one process cannot be two ranks) and run
on two GPUs by ``tests/gpu/test_allreduce_norm_gpu.py``."""

from __future__ import annotations

import os

import pytest
import torch
from triton import knobs

from vllm_steer.kernels.allreduce_norm import naive

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
D, MAX_T, EPS = 96, 8, 1e-5


def _launch(world: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, programs: int, state=None):
    """The kernel on host memory: one rank's buffers (the sentinel everywhere) and flags, its addresses as the
    symmetric handle gives them; ``state``: an earlier call's, for a next launch."""
    from vllm_steer.kernels.allreduce_norm.triton import _ar_norm_kernel

    if state is None:
        buf = torch.full((2, world, MAX_T, D), -0.0, dtype=x.dtype)
        state = (buf, torch.zeros(2, dtype=torch.int32), torch.tensor([buf.data_ptr()] * world, dtype=torch.int64))
    buf, flags, ptrs = state
    out = torch.empty_like(residual)
    _ar_norm_kernel[(programs,)](ptrs, flags, x, residual, weight, out, x.shape[0], x.stride(0), residual.stride(0),
                                 out.stride(0), EPS, D=D, BLOCK_D=128, RANK=0, WORLD=world, MAX_T=MAX_T)
    return out, state


def _all_sentinel(buf: torch.Tensor) -> bool:
    return bool(((buf == 0) & torch.signbit(buf)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_group_of_one_normalizes_its_own_partial_and_leaves_the_sentinels_for_the_next_epoch(dtype):
    if not knobs.runtime.interpret:  # compile_sm90 (tests/test_kernels_compile.py): the group of two compiled too
        _launch(2, torch.zeros(4, D, dtype=dtype), torch.zeros(4, D, dtype=dtype), torch.ones(D, dtype=dtype), 4)
    g = torch.Generator().manual_seed(0)
    state = None
    for epoch, t in enumerate((5, 3)):
        x = torch.randn(t, D, generator=g).to(dtype)
        x[0, :4] = -0.0  # a partial's negative zeros are data, not the sentinel
        residual = torch.randn(t, D, generator=g).to(dtype)
        weight = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
        want_out, want_res = naive.add_rms_norm(naive.partials_sum([x]), residual, weight, EPS)
        out, state = _launch(1, x, residual, weight, 2, state)  # two programs: rows 0, 2, 4 and 1, 3
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, want_out, **tol)
        torch.testing.assert_close(residual, want_res, **tol)
        buf, flags, _ = state
        assert flags.tolist() == [1 - epoch % 2, 0]  # the epoch flipped by the last program, arrivals back to 0
        assert _all_sentinel(buf)  # every row read was reset: the buffers are ready for their next epoch
