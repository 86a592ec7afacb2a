"""Triton capture_rows: one program per token; tokens with no pool row return at once."""

import torch
import triton
import triton.language as tl

from vllm_steer.kernels.host_math import cdiv, next_power_of_2


@triton.jit
def _capture_rows_kernel(
    p_pool,  # [P, D]
    p_a,  # [N, D]
    p_plan,  # [>= N] int32
    D: tl.constexpr,
    stride_pool,
    stride_a,
    BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1)
    i_row = tl.load(p_plan + i_n)
    if i_row < 0:
        return
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_a + i_n * stride_a + o_d, mask=m_d)  # [BLOCK_D]
    tl.store(p_pool + i_row.to(tl.int64) * stride_pool + o_d, b_x.to(p_pool.dtype.element_ty), mask=m_d)


def capture_rows_triton(pool: torch.Tensor, a: torch.Tensor, plan: torch.Tensor) -> None:
    n, d = a.shape
    if n == 0:
        return
    block_d = min(1024, next_power_of_2(d))
    grid = (n, cdiv(d, block_d))
    _capture_rows_kernel[grid](pool, a, plan, D=d, stride_pool=pool.stride(0), stride_a=a.stride(0),
                               BLOCK_D=block_d, num_warps=4 if block_d >= 512 else 2)
