"""Triton steered_rms_norm: one program per token, the whole hidden row in registers.

Reads x (and the residual) once, adds the token's rows of up to two steering tables (skipped for
unsteered tokens and idle tables), writes the new residual and the normalized row. Same traffic as
vLLM's fused add + RMSNorm when nothing is steered: the index and the flags are a few bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384  # one row in registers; every supported family is far below


@triton.jit
def _add_row(b_s, p_table, p_flag, i_row, stride_t, o_d, m_d):
    """b_s + table[i_row] when the table is active and the token steered (row 0 is the no-op)."""
    if (tl.load(p_flag) != 0) & (i_row != 0):
        b_s += tl.load(p_table + i_row.to(tl.int64) * stride_t + o_d, mask=m_d, other=0.0).to(tl.float32)
    return b_s


@triton.jit
def _steered_rms_norm_kernel(
    p_x,  # [N, D]
    p_res,  # [N, D] (ignored unless HAS_RES)
    p_w,  # [D]
    p_out,  # [N, D] normalized output
    p_res_out,  # [N, D] new residual
    p_index,  # [>= N] int32
    p_ta, p_fa,  # table A [R, D], flag A [1] uint8 (ignored unless HAS_A)
    p_tb, p_fb,  # table B, flag B (ignored unless HAS_B)
    stride_x, stride_res, stride_out, stride_res_out, stride_ta, stride_tb,
    eps,
    weight_offset,
    D: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_B: tl.constexpr,
    OFFSET_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_s = tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    if HAS_RES:
        b_s += tl.load(p_res + i_t * stride_res + o_d, mask=m_d, other=0.0).to(tl.float32)
    if HAS_A or HAS_B:
        i_row = tl.load(p_index + i_t)
        if HAS_A:
            b_s = _add_row(b_s, p_ta, p_fa, i_row, stride_ta, o_d, m_d)
        if HAS_B:
            b_s = _add_row(b_s, p_tb, p_fb, i_row, stride_tb, o_d, m_d)
    tl.store(p_res_out + i_t * stride_res_out + o_d, b_s.to(p_res_out.dtype.element_ty), mask=m_d)
    b_var = tl.sum(b_s * b_s, axis=0) / D
    b_n = b_s * (1.0 / tl.sqrt_rn(b_var + eps))
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0)
    if OFFSET_WEIGHT:
        b_o = b_n * (b_w.to(tl.float32) + weight_offset)
    else:
        # vLLM's RMSNorm: normalized.to(w.dtype) * w, rounded in w's dtype
        b_o = (b_n.to(b_w.dtype).to(tl.float32) * b_w.to(tl.float32)).to(b_w.dtype)
    tl.store(p_out + i_t * stride_out + o_d, b_o.to(p_out.dtype.element_ty), mask=m_d)


def _num_warps(block_d: int) -> int:
    return 4 if block_d <= 1024 else 8 if block_d <= 8192 else 16


def _launch(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, out, res_out,
            num_warps: int | None = None) -> None:
    n, d = x.shape
    if n == 0:
        return
    if d > MAX_HIDDEN:
        raise ValueError(f"steered_rms_norm supports hidden sizes up to {MAX_HIDDEN}, got {d}")
    block_d = triton.next_power_of_2(d)
    dummy = x  # never read: its constexpr flag is off
    _steered_rms_norm_kernel[(n,)](
        x, residual if residual is not None else dummy, weight, out, res_out, index,
        table_a if table_a is not None else dummy, flag_a if flag_a is not None else index,
        table_b if table_b is not None else dummy, flag_b if flag_b is not None else index,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
        table_a.stride(0) if table_a is not None else 0, table_b.stride(0) if table_b is not None else 0,
        eps, weight_offset,
        D=d, HAS_RES=residual is not None, HAS_A=table_a is not None, HAS_B=table_b is not None,
        OFFSET_WEIGHT=weight_offset != 0.0, BLOCK_D=block_d, num_warps=num_warps or _num_warps(block_d),
    )


def steered_rms_norm_triton(
    x: torch.Tensor,  # [N, D], rows contiguous
    residual: torch.Tensor,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    weight_offset: float,
    index: torch.Tensor,  # [>= N] int32
    table_a: torch.Tensor | None = None,  # [R, D]
    flag_a: torch.Tensor | None = None,  # [1] uint8
    table_b: torch.Tensor | None = None,
    flag_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    _launch(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, out, res_out)
    return out, res_out
