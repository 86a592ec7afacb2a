"""Fused Triton gather-add: one read of hidden, one of the table row, one write; idle tokens untouched."""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_tokens"])
def _apply_steering_kernel(
    p_hidden,  # [N, D]
    p_table,  # [R, D]
    p_index,  # [>= N] int32
    p_active,  # [1] uint8
    n_tokens,
    D: tl.constexpr,
    stride_h,
    stride_t,
    BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    # Why: an idle table (no live non-zero row) or an unsteered token (row 0) must not touch memory.
    b_active = tl.load(p_active)
    if b_active == 0:
        return
    if i_n >= n_tokens:
        return
    i_row = tl.load(p_index + i_n)
    if i_row == 0:
        return
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_h = p_hidden + i_n.to(tl.int64) * stride_h + o_d
    b_h = tl.load(p_h, mask=m_d)  # [BLOCK_D]
    b_t = tl.load(p_table + i_row.to(tl.int64) * stride_t + o_d, mask=m_d)  # [BLOCK_D]
    tl.store(p_h, b_h + b_t.to(b_h.dtype), mask=m_d)


def apply_steering_triton(
    hidden: torch.Tensor,  # [N, D], contiguous rows, modified in place
    table: torch.Tensor,  # [R, D]
    index: torch.Tensor,  # [>= N] int32
    active: torch.Tensor,  # [1] uint8
) -> None:
    n, d = hidden.shape
    if n == 0:
        return
    block_d = min(1024, triton.next_power_of_2(d))
    grid = (n, triton.cdiv(d, block_d))
    _apply_steering_kernel[grid](
        hidden,
        table,
        index,
        active,
        n,
        D=d,
        stride_h=hidden.stride(0),
        stride_t=table.stride(0),
        BLOCK_D=block_d,
        num_warps=4 if block_d >= 512 else 2,
    )
