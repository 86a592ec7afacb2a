"""The one-shot all-reduce + add + RMSNorm kernel (``kernels/allreduce_norm``) run by Triton's CPU interpreter as a
TP group of one rank (its push, its barrier on its own signal pad, the sum, the norm) against the reference; the
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


def _launch(world: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, programs: int):
    """The kernel on host memory: one rank's buffer and pad, their addresses as the symmetric handle gives them."""
    from vllm_steer.kernels.allreduce_norm.triton import _ar_norm_kernel

    buf = torch.zeros(world, MAX_T, D, dtype=x.dtype)
    pads = torch.zeros(programs * world, dtype=torch.int32)  # uint32 slots: 0 between launches
    ptrs = torch.tensor([buf.data_ptr()] * world, dtype=torch.int64)
    pad_ptrs = torch.tensor([pads.data_ptr()] * world, dtype=torch.int64)
    out = torch.empty_like(residual)
    _ar_norm_kernel[(programs,)](ptrs, pad_ptrs, x, residual, weight, out, x.shape[0],
                                 x.stride(0), residual.stride(0), out.stride(0), EPS, D=D, BLOCK_D=128, RANK=0,
                                 WORLD=world, MAX_T=MAX_T)
    return out, pads, (ptrs, pad_ptrs, buf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_group_of_one_normalizes_its_own_partial_and_leaves_the_pads_zero(dtype):
    if not knobs.runtime.interpret:  # compile_sm90 (tests/test_kernels_compile.py): the group of two compiled too
        _launch(2, torch.zeros(4, D, dtype=dtype), torch.zeros(4, D, dtype=dtype), torch.ones(D, dtype=dtype), 4)
    g = torch.Generator().manual_seed(0)
    t = 5
    x = torch.randn(t, D, generator=g).to(dtype)
    residual = torch.randn(t, D, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    want_out, want_res = naive.add_rms_norm(naive.partials_sum([x]), residual, weight, EPS)
    out, pads, _ = _launch(1, x, residual, weight, programs=2)  # two programs: rows 0, 2, 4 and 1, 3
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(residual, want_res, **tol)
    assert not pads.any()  # signalled and consumed twice a row: ready for the next launch (a CUDA graph's replay)
