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


class _GroupOfOne:
    """An ``ArNormWorkspace`` as a group of one holds it, on host memory (no process group): the steered norm's
    ``ar`` argument."""

    def __init__(self, dtype: torch.dtype, hidden: int) -> None:
        self.world, self.rank, self.max_tokens, self.hidden = 1, 0, MAX_T, hidden
        self.buf = torch.full((2, 1, MAX_T, hidden), -0.0, dtype=dtype)
        self.buf_ptrs = torch.tensor([self.buf.data_ptr()], dtype=torch.int64)
        self.flags = torch.zeros(2, dtype=torch.int32)


@pytest.mark.parametrize("features", ["vectors", "vectors+capture+projection"])
def test_the_steered_norm_with_the_all_reduce_inside_equals_it_on_the_reduced_stream(features):
    """The steered norm's AR feature as a TP group of one, two launches (both epochs): the same residual and output as
    the same norm given the reduced stream itself (vectors at both slots, with slot A's stream captured and a
    direction ablated at slot A), every row of the exchange's buffers back to the sentinel, the epoch flipped each
    launch. (A group of two is compiled for sm_90 here and run on two GPUs by ``tests/gpu``.)"""
    from tests.test_steered_norm import _case, _on
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    dtype, d = torch.bfloat16, D
    ws = _GroupOfOne(dtype, d)
    if not knobs.runtime.interpret:  # compile_sm90: the group of two compiled too
        ws.world, ws.buf_ptrs = 2, torch.tensor([ws.buf.data_ptr()] * 2, dtype=torch.int64)
    for launch, n in enumerate((5, 3)):
        x, r, (ta, tb), index = _case(n, d, dtype, seed=launch)
        x[0, :3] = -0.0
        kw = dict(vec_a=(ta, _on()), vec_b=(tb, _on()))
        if features != "vectors":
            pool, plan = torch.zeros(16, d, dtype=dtype), torch.tensor([3, -1, 7, 0, 1][:n], dtype=torch.int32)
            dirs = torch.nn.functional.normalize(torch.randn(ta.shape[0], 1, d), dim=-1)
            proj = (torch.ones(ta.shape[0], dtype=torch.int32), dirs, torch.zeros(ta.shape[0], 1, 2))
            kw |= dict(plan_a=plan, pool=pool, proj_a=proj)
        want_out, want_res = steered_norm_triton(x, r, torch.ones(d, dtype=dtype), EPS, 0.0, index, **kw)
        if features != "vectors":
            want_pool, kw["pool"] = pool.clone(), torch.zeros(16, d, dtype=dtype)
        out, res = steered_norm_triton(x, r, torch.ones(d, dtype=dtype), EPS, 0.0, index, ar=ws, **kw)
        assert torch.equal(out, want_out) and torch.equal(res, want_res)
        if features != "vectors":
            assert torch.equal(kw["pool"], want_pool)
        assert ws.flags.tolist() == [1 - launch % 2, 0]
        assert _all_sentinel(ws.buf)
