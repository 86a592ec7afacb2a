"""Triton steered_rms_norm (and steered_sae_rms_norm): one program per token, the whole hidden row in
registers.

Reads x (and the residual) once, adds the token's rows of up to two steering tables (skipped for
unsteered tokens and idle tables), writes the new residual and the normalized row. Same traffic as
vLLM's fused add + RMSNorm when nothing is steered: the index and the flags are a few bytes.

With SAE_A / SAE_B (``steered_sae_rms_norm_triton``, clamp-only packs: ReLU / JumpReLU without
reconstruct, kernels/sae_clamp/packed.py) each slot first applies its SAE clamps to the float32
stream, then adds its table: ``s = x + residual; s = SAE_A(s); s += A[row]; s = SAE_B(s); s += B[row]``.
A token whose row is 0 or whose row mode is OFF reads one int32 (the mode) and is otherwise the plain
kernel, bit for bit. A clamping token scans its row's codes (a block of BLOCK_C at a time, skipping
blocks with no clamp) and, for each clamped slot only, reads that slot's encoder and decoder rows
(float32): ``f = pre * (pre > thr)``, ``pre = s . enc[c] + bias[c]``; the clamp gives ``f'``; the
stream moves by ``sum_c (f'_c - f_c) dec[c]``, every ``f`` taken from the stream before this site's
clamps. Its cost scales with the clamp set, not d_sae. No host sync: the packs' row tables may change
under a captured CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_steer.kernels.launch_cache import CachedLauncher
from vllm_steer.kernels.sae_clamp.packed import N_CLAMP_ONLY

MAX_HIDDEN = 16384  # one row in registers; every supported family is far below


@triton.jit
def _add_row(b_s, p_table, p_flag, i_row, stride_t, o_d, m_d):
    """b_s + table[i_row] when the table is active and the token steered (row 0 is the no-op)."""
    if (tl.load(p_flag) != 0) & (i_row != 0):
        b_s += tl.load(p_table + i_row.to(tl.int64) * stride_t + o_d, mask=m_d, other=0.0).to(tl.float32)
    return b_s


@triton.jit
def _sae_clamp_row(b_s, i_row, p_mode, p_code, p_value, p_enc, p_dec, p_bias, p_thr, C,
                   stride_code, stride_value, stride_enc, stride_dec, o_d, m_d, BLOCK_C: tl.constexpr):
    """b_s after the row's SAE clamps (delta mode): b_s + sum over clamped slots c of
    (f'_c - f_c) * dec[c], each f_c from the unclamped b_s. Row 0 and OFF rows: b_s untouched."""
    if i_row != 0:
        i_r = i_row.to(tl.int64)
        if tl.load(p_mode + i_r) != 0:
            b_acc = tl.zeros_like(b_s)
            p_code_row = p_code + i_r * stride_code
            p_value_row = p_value + i_r * stride_value
            o_c = tl.arange(0, BLOCK_C)
            for c0 in range(0, C, BLOCK_C):
                b_code = tl.load(p_code_row + c0 + o_c, mask=c0 + o_c < C, other=0)
                if tl.sum((b_code != 0).to(tl.int32), axis=0) != 0:  # a block with no clamp costs one load
                    for j in range(BLOCK_C):
                        c = c0 + j
                        code = tl.load(p_code_row + c, mask=c < C, other=0)
                        if code != 0:
                            c64 = c.to(tl.int64)
                            b_enc = tl.load(p_enc + c64 * stride_enc + o_d, mask=m_d, other=0.0).to(tl.float32)
                            pre = tl.sum(b_s * b_enc, axis=0) + tl.load(p_bias + c).to(tl.float32)
                            f = tl.where(pre > tl.load(p_thr + c).to(tl.float32), pre, 0.0)
                            v = tl.load(p_value_row + c).to(tl.float32)
                            kind = code & 3
                            new = tl.where(kind == 1, v, tl.where(kind == 2, f + v, tl.where(kind == 3, f * v, f)))
                            f_new = tl.where(((code & 4) == 0) | (f > 0), new, f)
                            b_dec = tl.load(p_dec + c64 * stride_dec + o_d, mask=m_d, other=0.0).to(tl.float32)
                            b_acc += (f_new - f) * b_dec
            b_s += b_acc
    return b_s


@triton.jit
def _steered_norm_body(
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
    # SAE pack of slot A (ignored unless SAE_A): mode [R] int32, code [R, C] int32, value [R, C] fp32,
    # enc [C, D] fp32, dec [C, D] fp32, bias [C] fp32, thr [C] fp32; then the same for slot B
    p_sa_mode, p_sa_code, p_sa_value, p_sa_enc, p_sa_dec, p_sa_bias, p_sa_thr, C_A,
    stride_sa_code, stride_sa_value, stride_sa_enc, stride_sa_dec,
    p_sb_mode, p_sb_code, p_sb_value, p_sb_enc, p_sb_dec, p_sb_bias, p_sb_thr, C_B,
    stride_sb_code, stride_sb_value, stride_sb_enc, stride_sb_dec,
    D: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_B: tl.constexpr,
    OFFSET_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SAE_A: tl.constexpr,
    SAE_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    # Every load the plain path needs is issued here, the weight's too (as Inductor's fused add +
    # RMSNorm does): issued after the reduction, its latency would add to every launch.
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0, eviction_policy="evict_last")
    b_s = tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if HAS_RES:
        b_s += tl.load(p_res + i_t * stride_res + o_d, mask=m_d, other=0.0,
                       eviction_policy="evict_first").to(tl.float32)
    if HAS_A or HAS_B or SAE_A or SAE_B:
        i_row = tl.load(p_index + i_t)
        if SAE_A:
            b_s = _sae_clamp_row(b_s, i_row, p_sa_mode, p_sa_code, p_sa_value, p_sa_enc, p_sa_dec, p_sa_bias,
                                 p_sa_thr, C_A, stride_sa_code, stride_sa_value, stride_sa_enc, stride_sa_dec,
                                 o_d, m_d, BLOCK_C)
        if HAS_A:
            b_s = _add_row(b_s, p_ta, p_fa, i_row, stride_ta, o_d, m_d)
        if SAE_B:
            b_s = _sae_clamp_row(b_s, i_row, p_sb_mode, p_sb_code, p_sb_value, p_sb_enc, p_sb_dec, p_sb_bias,
                                 p_sb_thr, C_B, stride_sb_code, stride_sb_value, stride_sb_enc, stride_sb_dec,
                                 o_d, m_d, BLOCK_C)
        if HAS_B:
            b_s = _add_row(b_s, p_tb, p_fb, i_row, stride_tb, o_d, m_d)
    tl.store(p_res_out + i_t * stride_res_out + o_d, b_s.to(p_res_out.dtype.element_ty), mask=m_d)
    b_var = tl.sum(b_s * b_s, axis=0) / D
    b_n = b_s * (1.0 / tl.sqrt_rn(b_var + eps))
    if OFFSET_WEIGHT:
        b_o = b_n * (b_w.to(tl.float32) + weight_offset)
    else:
        # vLLM's RMSNorm: normalized.to(w.dtype) * w, rounded in w's dtype
        b_o = (b_n.to(b_w.dtype).to(tl.float32) * b_w.to(tl.float32)).to(b_w.dtype)
    tl.store(p_out + i_t * stride_out + o_d, b_o.to(p_out.dtype.element_ty), mask=m_d)


@triton.jit
def _steered_rms_norm_kernel(
    p_x, p_res, p_w, p_out, p_res_out, p_index, p_ta, p_fa, p_tb, p_fb,
    stride_x, stride_res, stride_out, stride_res_out, stride_ta, stride_tb, eps, weight_offset,
    D: tl.constexpr, HAS_RES: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, OFFSET_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The plain steered norm: no SAE arguments at all (its launch costs what it cost before SAEs)."""
    _steered_norm_body(
        p_x, p_res, p_w, p_out, p_res_out, p_index, p_ta, p_fa, p_tb, p_fb,
        stride_x, stride_res, stride_out, stride_res_out, stride_ta, stride_tb, eps, weight_offset,
        p_index, p_index, p_index, p_index, p_index, p_index, p_index, 0, 0, 0, 0, 0,
        p_index, p_index, p_index, p_index, p_index, p_index, p_index, 0, 0, 0, 0, 0,
        D, HAS_RES, HAS_A, HAS_B, OFFSET_WEIGHT, BLOCK_D, False, False, 32)


@triton.jit
def _steered_sae_rms_norm_kernel(
    p_x, p_res, p_w, p_out, p_res_out, p_index, p_ta, p_fa, p_tb, p_fb,
    stride_x, stride_res, stride_out, stride_res_out, stride_ta, stride_tb, eps, weight_offset,
    p_sa_mode, p_sa_code, p_sa_value, p_sa_enc, p_sa_dec, p_sa_bias, p_sa_thr, C_A,
    stride_sa_code, stride_sa_value, stride_sa_enc, stride_sa_dec,
    p_sb_mode, p_sb_code, p_sb_value, p_sb_enc, p_sb_dec, p_sb_bias, p_sb_thr, C_B,
    stride_sb_code, stride_sb_value, stride_sb_enc, stride_sb_dec,
    D: tl.constexpr, HAS_RES: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, OFFSET_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr, SAE_A: tl.constexpr, SAE_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The steered norm of a norm that receives a site with an SAE."""
    _steered_norm_body(
        p_x, p_res, p_w, p_out, p_res_out, p_index, p_ta, p_fa, p_tb, p_fb,
        stride_x, stride_res, stride_out, stride_res_out, stride_ta, stride_tb, eps, weight_offset,
        p_sa_mode, p_sa_code, p_sa_value, p_sa_enc, p_sa_dec, p_sa_bias, p_sa_thr, C_A,
        stride_sa_code, stride_sa_value, stride_sa_enc, stride_sa_dec,
        p_sb_mode, p_sb_code, p_sb_value, p_sb_enc, p_sb_dec, p_sb_bias, p_sb_thr, C_B,
        stride_sb_code, stride_sb_value, stride_sb_enc, stride_sb_dec,
        D, HAS_RES, HAS_A, HAS_B, OFFSET_WEIGHT, BLOCK_D, SAE_A, SAE_B, BLOCK_C)


def _num_warps(block_d: int) -> int:
    return 4 if block_d <= 1024 else 8 if block_d <= 8192 else 16


def _sae_args(pack: list[torch.Tensor] | None, d: int, dummy: torch.Tensor) -> list:
    """The kernel's arguments for one slot's clamp-only SAE pack (dummies when there is none)."""
    if not pack:
        return [dummy] * 7 + [0] * 5
    if len(pack) != N_CLAMP_ONLY:
        raise ValueError(f"the Triton SAE path takes clamp-only packs ({N_CLAMP_ONLY} tensors), got {len(pack)}")
    mode, code, value, enc, dec, bias, thr = pack[:7]
    assert enc.shape[-1] == d and dec.shape[-1] == d and enc.stride(-1) == 1 and dec.stride(-1) == 1
    assert code.stride(-1) == 1 and value.stride(-1) == 1
    return [mode, code, value, enc, dec, bias, thr, code.shape[1],
            code.stride(0), value.stride(0), enc.stride(0), dec.stride(0)]


_PLAIN = CachedLauncher(_steered_rms_norm_kernel)
_SAE = CachedLauncher(_steered_sae_rms_norm_kernel)


def _launch(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, out, res_out,
            num_warps: int | None = None, sae_a: list[torch.Tensor] | None = None,
            sae_b: list[torch.Tensor] | None = None) -> None:
    n, d = x.shape
    if n == 0:
        return
    if d > MAX_HIDDEN:
        raise ValueError(f"steered_rms_norm supports hidden sizes up to {MAX_HIDDEN}, got {d}")
    block_d = triton.next_power_of_2(d)
    dummy = x  # never read: its constexpr flag is off
    common = (
        x, residual if residual is not None else dummy, weight, out, res_out, index,
        table_a if table_a is not None else dummy, flag_a if flag_a is not None else index,
        table_b if table_b is not None else dummy, flag_b if flag_b is not None else index,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
        table_a.stride(0) if table_a is not None else 0, table_b.stride(0) if table_b is not None else 0,
        eps, weight_offset,
    )
    flags = (d, residual is not None, table_a is not None, table_b is not None, weight_offset != 0.0, block_d)
    warps = num_warps or _num_warps(block_d)
    if not sae_a and not sae_b:
        _PLAIN((n,), common, flags, warps)
        return
    _SAE((n,), common + tuple(_sae_args(sae_a, d, index)) + tuple(_sae_args(sae_b, d, index)),
         flags + (bool(sae_a), bool(sae_b), 32), warps)


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


def steered_sae_rms_norm_triton(
    x: torch.Tensor,  # [N, D], rows contiguous
    residual: torch.Tensor | None,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    weight_offset: float,
    index: torch.Tensor,  # [>= N] int32
    table_a: torch.Tensor | None,  # [R, D]
    flag_a: torch.Tensor | None,  # [1] uint8
    table_b: torch.Tensor | None,
    flag_b: torch.Tensor | None,
    sae_a: list[torch.Tensor],  # a clamp-only SAE pack (kernels/sae_clamp/packed.py), or [] for none
    sae_b: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``steered_sae_rms_norm_naive`` for clamp-only packs (ReLU / JumpReLU, no reconstruct), one launch."""
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    _launch(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, out, res_out,
            sae_a=sae_a, sae_b=sae_b)
    return out, res_out
