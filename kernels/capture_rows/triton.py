"""Triton capture_rows: one program per token; tokens with no pool row return at once."""

import torch
import triton
import triton.language as tl


@triton.jit
def _capture_rows_kernel(
    p_pool,  # [P, D]
    p_a,  # [N, D]
    p_b,  # [N, D] (ignored unless HAS_B)
    p_plan,  # [>= N] int32
    p_table, p_flag, p_index,  # [R, D], [1] uint8, [>= N] int32 (ignored unless HAS_TABLE)
    D: tl.constexpr,
    stride_pool,
    stride_a,
    stride_b,
    stride_t,
    HAS_B: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1)
    i_row = tl.load(p_plan + i_n)
    if i_row < 0:
        return
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_a + i_n * stride_a + o_d, mask=m_d).to(tl.float32)  # [BLOCK_D]
    if HAS_B:
        b_x += tl.load(p_b + i_n * stride_b + o_d, mask=m_d).to(tl.float32)
    if HAS_TABLE:
        i_t = tl.load(p_index + i_n)
        if (tl.load(p_flag) != 0) & (i_t != 0):
            b_x += tl.load(p_table + i_t.to(tl.int64) * stride_t + o_d, mask=m_d).to(tl.float32)
    tl.store(p_pool + i_row.to(tl.int64) * stride_pool + o_d, b_x.to(p_pool.dtype.element_ty), mask=m_d)


def capture_rows_triton(pool: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, plan: torch.Tensor,
                        table: torch.Tensor | None = None, flag: torch.Tensor | None = None,
                        index: torch.Tensor | None = None) -> None:
    n, d = a.shape
    if n == 0:
        return
    block_d = min(1024, triton.next_power_of_2(d))
    grid = (n, triton.cdiv(d, block_d))
    has_table = table is not None
    _capture_rows_kernel[grid](
        pool, a, a if b is None else b, plan,
        table if has_table else a, flag if has_table else plan, index if has_table else plan,
        D=d, stride_pool=pool.stride(0), stride_a=a.stride(0), stride_b=(a if b is None else b).stride(0),
        stride_t=table.stride(0) if has_table else 0,
        HAS_B=b is not None, HAS_TABLE=has_table, BLOCK_D=block_d, num_warps=4 if block_d >= 512 else 2,
    )
