"""Triton steered norm: one kernel body (``_steered_norm_kernel``), one program per token, the whole hidden row
in registers. Each feature (vectors per slot, SAE clamps per slot, conditions, capture per slot) is a constexpr
flag chosen per installed site and reads its own descriptor (a tuple of tensors and strides, empty while the
flag is off); the launcher is ``steered_norm_triton``.

Reads x (and the residual) once, adds the token's rows of up to two steering tables (skipped for
unsteered tokens and idle tables), writes the new residual and the normalized row. Same traffic as
vLLM's fused add + RMSNorm when nothing is steered: the index and the flags are a few bytes.

With SAE_A / SAE_B (clamp-only packs: ReLU / JumpReLU without
reconstruct, kernels/sae_clamp/packed.py) each slot first applies its SAE clamps to the float32
stream, then adds its table: ``s = x + residual; s = SAE_A(s); s += A[row]; s = SAE_B(s); s += B[row]``.
A token whose row is 0 or whose row mode is OFF reads one int32 (the mode) and is otherwise the plain
kernel, bit for bit. A clamping token scans its row's codes (a block of BLOCK_C at a time, skipping
blocks with no clamp) and, for each clamped slot only, reads that slot's encoder and decoder rows
(float32): ``f = pre * (pre > thr)``, ``pre = s . enc[c] + bias[c]``; the clamp gives ``f'``; the
stream moves by ``sum_c (f'_c - f_c) dec[c]``, every ``f`` taken from the stream before this site's
clamps. Its cost scales with the clamp set, not d_sae. No host sync: the packs' row tables may change
under a captured CUDA graph.

The walk is latency-bound (a D-long dot, then an axpy, per clamp, one after another), so at decode sizes
(``split_of(N)``: up to 64 tokens) each token gets SPLIT programs (grid [N, SPLIT]) that share its row's
clamps by blocks of codes; each stores its partial sum in a persistent scratch and counts itself in a
per-token count (atomic); the last to arrive adds the partials in program order, resets the count and
finishes the token (no program waits for another, so no deadlock whatever the scheduling). Unclamped
tokens are finished by program 0 as before, bit for bit. One launch either way. Past those sizes (``tiled_of(N)``)
the SAE slots' clamps run before the norm over tiles of tokens that share a row (``../sae_clamp/tiled_triton.py``:
each clamped row read once per tile, not once per token), and the norm adds their edit as a full pack's
(``FULL_A`` / ``FULL_B``): one or two launches more per slot.

With TC (a transcoder at the norm that makes the MLP's input) the same clamp walk runs after the norm, its
features encoded from the output as stored; its delta goes to the residual only (the MLP's output edit). It is
split like the first SAE slot's when no SAE slot is (else the program that finishes the token walks it). A full
transcoder pack (TopK, sparsify's) has its edit computed before this launch from the norm's output
(``../sae_clamp/full_triton.py``, whose gather recomputes the output with ``_normalized``) and added to the residual
after the norm (``FULL_TC``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4: programmatic dependent launch (PDL)
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    gdc_wait = None

from vllm_steer.kernels.allreduce_norm.lamport import epoch_base, flip_epoch, pull_sum, push_row
from vllm_steer.kernels.host_math import next_power_of_2
from vllm_steer.kernels.launch_cache import CachedLauncher, spec_of
from vllm_steer.kernels.sae_clamp.packed import N_CLAMP_ONLY
from vllm_steer.kernels.steered_rms_norm import naive

MAX_HIDDEN = 16384  # one row in registers; every supported family is far below
# the bits of a conditional row's site word (naive.py defines them; runtime.condition_tables writes them)
_SITE_MASK = tl.constexpr(naive.SITE_MASK)
_VECTORS_UNGATED = tl.constexpr(naive.VECTORS_UNGATED)
_SAE_GATED = tl.constexpr(naive.SAE_GATED)
_PROJ_GATED = tl.constexpr(naive.PROJ_GATED)
_FP8_MAX = tl.constexpr(naive.FP8_MAX)
_FP8_MIN_SCALE = tl.constexpr(naive.FP8_MIN_SCALE)


@triton.jit
def _add_row(b_s, vec, i_row, o_d, m_d, w):
    """b_s + w * table[i_row] when the table is active and the token steered (row 0 is the no-op); ``vec``:
    (table, flag, stride); w 1.0 but for a gated row."""
    p_table, p_flag, stride_t = vec
    if (tl.load(p_flag) != 0) & (i_row != 0):
        b_s += w * tl.load(p_table + i_row.to(tl.int64) * stride_t + o_d, mask=m_d, other=0.0).to(tl.float32)
    return b_s


@triton.jit
def _row_of(vec, i_row, o_d, m_d):
    """(on, table[i_row] as float32): ``on`` when the table is active and the token steered; the row is loaded
    masked by ``on`` (zeros otherwise), with no branch, so the load is in flight beside every other."""
    p_table, p_flag, stride_t = vec
    on = (tl.load(p_flag) != 0) & (i_row != 0)
    b_t = tl.load(p_table + i_row.to(tl.int64) * stride_t + o_d, mask=m_d & on, other=0.0).to(tl.float32)
    return on, b_t


@triton.jit
def _probe_gate(b_s, i_row, p_probe, p_cparams, stride_probe, o_d, m_d):
    """The gate of row ``i_row``'s condition from the stream b_s: sigmoid(sharpness * (s . probe -
    threshold)), or the step s . probe > threshold for a hard condition (naive.probe_gate)."""
    i_r = i_row.to(tl.int64)
    b_p = tl.load(p_probe + i_r * stride_probe + o_d, mask=m_d, other=0.0)
    z = tl.sum(b_s * b_p, axis=0) - tl.load(p_cparams + i_r * 4)
    soft = 1.0 / (1.0 + tl.exp(-tl.load(p_cparams + i_r * 4 + 1) * z))
    g = tl.where(tl.load(p_cparams + i_r * 4 + 2) > 0, tl.where(z > 0, 1.0, 0.0), soft)
    return tl.where(g == g, g, 0.0)  # a NaN stream never leaves a NaN gate


@triton.jit
def _add_gated_row(b_s, vec, i_row, o_d, m_d, g, i_gsite, i_site, p_gate_t, p_probe, p_cparams, stride_probe, proj,
                   PROJ: tl.constexpr):
    """(b_s + w * table[i_row], gate): at the row's probe site (its site word ``i_gsite`` under
    _SITE_MASK) the gate is computed from b_s first and stored; w is the gate for a row
    whose condition gates its vectors, 1 for any other (then the plain add, bit for bit). Branch-free but
    for the probe: the table row is loaded as soon as the row is known, in parallel with the row's probe
    site, so the add waits on no more loads than the plain kernel's."""
    on, b_t = _row_of(vec, i_row, o_d, m_d)
    if (i_gsite & _SITE_MASK) == i_site:
        g = _probe_gate(b_s, i_row, p_probe, p_cparams, stride_probe, o_d, m_d)
        tl.store(p_gate_t, g)
    if PROJ:  # the row's projections come after the gate, before the vectors
        b_s = _project_gated(b_s, i_row, proj, o_d, m_d, (i_gsite >= 0) & ((i_gsite & _PROJ_GATED) != 0), g)
    return tl.where(on, b_s + tl.where((i_gsite >= 0) & ((i_gsite & _VECTORS_UNGATED) == 0), g, 1.0) * b_t, b_s), g


@triton.jit
def _proj_first(i_row, proj, o_d, m_d):
    """(n, v, lo, hi) of row ``i_row`` at a slot: its live count, first direction (float32) and bounds, loaded
    together (none waits on the count), and not at all for row 0 (unsteered tokens) nor at a site marked idle
    (``count[0] < 0``: no live row projects here, ``runtime/projection_tables.py``; the mark is loaded with the
    token's row, so the loads wait on nothing more than before): then n = 0. ``proj``: (count [R] int32,
    dirs [R, K, D] (float32, or the model's dtype), bounds [R, K, 2] fp32, K, dirs' row stride, direction stride)."""
    p_count, p_dirs, p_bounds, K, stride_row, stride_k = proj
    i_r = i_row.to(tl.int64)
    live = (i_row != 0) & (tl.load(p_count) >= 0)
    n = tl.load(p_count + i_r, mask=live, other=0)
    b_v = tl.load(p_dirs + i_r * stride_row + o_d, mask=m_d & live, other=0.0).to(tl.float32)
    lo = tl.load(p_bounds + i_r * K * 2, mask=live, other=0.0)
    hi = tl.load(p_bounds + i_r * K * 2 + 1, mask=live, other=0.0)
    return n, b_v, lo, hi


@triton.jit
def _project_from(b_s, i_row, proj, o_d, m_d, first):
    """b_s after row ``i_row``'s directional projections, one after another (naive.project_naive):
    ``p = s . v``, ``s += (clamp(p, lo, hi) - p) * v``, the first direction's loads given (``_proj_first``)."""
    n, b_v, lo, hi = first
    p_count, p_dirs, p_bounds, K, stride_row, stride_k = proj
    i_r = i_row.to(tl.int64)
    if n > 0:
        p = tl.sum(b_s * b_v, axis=0)
        b_s += (tl.minimum(tl.maximum(p, lo), hi) - p) * b_v
        for k in range(1, n):
            b_v = tl.load(p_dirs + i_r * stride_row + k * stride_k + o_d, mask=m_d, other=0.0).to(tl.float32)
            p = tl.sum(b_s * b_v, axis=0)
            lo = tl.load(p_bounds + (i_r * K + k) * 2)
            hi = tl.load(p_bounds + (i_r * K + k) * 2 + 1)
            b_s += (tl.minimum(tl.maximum(p, lo), hi) - p) * b_v
    return b_s


@triton.jit
def _project(b_s, i_row, proj, o_d, m_d):
    """b_s after row ``i_row``'s directional projections (``_proj_first``'s loads, then ``_project_from``)."""
    return _project_from(b_s, i_row, proj, o_d, m_d, _proj_first(i_row, proj, o_d, m_d))


@triton.jit
def _project_gated(b_s, i_row, proj, o_d, m_d, gated, g, COND: tl.constexpr = True):
    """``_project``, or for a row whose condition gates its projections ``s + g * (projected(s) - s)``
    (COND False: a site without conditions, ``gated`` and ``g`` unused: ``_project`` alone)."""
    b_p = _project(b_s, i_row, proj, o_d, m_d)
    if COND:
        b_p = tl.where(gated, b_s + g * (b_p - b_s), b_p)
    return b_p


@triton.jit
def _slot_rest(b_s, i_t, i_row, full, proj, vec, o_d, m_d, w_sae, w_vec, proj_gated, g, FULL: tl.constexpr,
               PROJ: tl.constexpr, HAS: tl.constexpr, COND: tl.constexpr):
    """A slot's edits after its clamps, in the site's order: a full pack's edit, the projections, the vectors (each
    where its flag is set); the gate weights of ``_gate_weights``."""
    if FULL:
        b_s = _add_edit(b_s, i_t, i_row, full, o_d, m_d, w_sae)
    if PROJ:
        b_s = _project_gated(b_s, i_row, proj, o_d, m_d, proj_gated, g, COND)
    if HAS:
        b_s = _add_row(b_s, vec, i_row, o_d, m_d, w_vec)
    return b_s


@triton.jit
def _gate_weights(cond, i_row, i_t, COND: tl.constexpr):
    """(w_sae, w_vec, proj_gated, g) of token ``i_t`` (row ``i_row``) at a norm that only reads the gate (no probe
    sits there): the gate ``g`` weighs the row's SAE edit, vectors and projections as its site word's bits say,
    1 / ungated for a row without a condition. Without conditions (COND False) the weights are 1 and ``g`` unused."""
    if COND:
        i_gsite = tl.load(cond[0] + i_row)
        g = tl.load(cond[3] + i_t)
        w_sae = tl.where((i_gsite >= 0) & ((i_gsite & _SAE_GATED) != 0), g, 1.0)
        w_vec = tl.where((i_gsite >= 0) & ((i_gsite & _VECTORS_UNGATED) == 0), g, 1.0)
        proj_gated = (i_gsite >= 0) & ((i_gsite & _PROJ_GATED) != 0)
    else:
        w_sae = 1.0
        w_vec = 1.0
        proj_gated = False
        g = 1.0
    return w_sae, w_vec, proj_gated, g


@triton.jit
def _plan_of(i_t, cap):
    """Token ``i_t``'s pool row in a slot's capture plan (-1: not captured), loaded at the top of the kernel
    with the stream: a load issued where the store needs it would put its latency on the launch's path."""
    return tl.load(cap[2] + i_t)


@triton.jit
def _capture(b_s, i_p, cap, o_d, m_d, mine):
    """pool[i_p] = b_s (in the pool's dtype) when this program is ``mine`` and the token is planned
    (i_p >= 0, from ``_plan_of``). ``cap``: (pool, pool stride, plan)."""
    p_pool, stride_pool, _ = cap
    if mine & (i_p >= 0):
        tl.store(p_pool + i_p.to(tl.int64) * stride_pool + o_d, b_s.to(p_pool.dtype.element_ty), mask=m_d)


@triton.jit
def _sae_walk(b_s, i_r, c_first, c_step, sae, o_d, m_d, BLOCK_C: tl.constexpr):
    """Sum of (f'_c - f_c) * dec[c] over the clamped slots c of row ``i_r`` in the blocks of codes that
    start at c_first, c_first + c_step, ... (f from b_s)."""
    _, p_code, p_value, p_enc, p_dec, p_bias, p_thr, C, stride_code, stride_value, stride_enc, stride_dec = sae
    b_acc = tl.zeros_like(b_s)
    p_code_row = p_code + i_r * stride_code
    p_value_row = p_value + i_r * stride_value
    o_c = tl.arange(0, BLOCK_C)
    for c0 in range(c_first, C, c_step):
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
    return b_acc


@triton.jit
def _sae_clamp_row(b_s, b_x, i_row, sae, o_d, m_d, BLOCK_C: tl.constexpr, w):
    """b_s after the row's SAE clamps (delta mode): b_s + w * sum over clamped slots c of
    (f'_c - f_c) * dec[c], each f_c encoded from b_x (the unclamped b_s for an SAE; the norm's output for a
    transcoder) (w: the gate of a gated row, else 1.0). Row 0 and OFF rows: b_s untouched."""
    if i_row != 0:
        i_r = i_row.to(tl.int64)
        if tl.load(sae[0] + i_r) != 0:  # the row's mode: OFF rows skip the walk
            b_s += w * _sae_walk(b_x, i_r, 0, BLOCK_C, sae, o_d, m_d, BLOCK_C)
    return b_s


@triton.jit
def _sae_clamp_split(b_s, b_x, i_t, i_row, i_k, split, sae, o_d, m_d, D: tl.constexpr, BLOCK_C: tl.constexpr,
                     SPLIT: tl.constexpr, w):
    """The row's clamps shared by the token's SPLIT programs (program ``i_k`` takes the blocks of codes
    i_k, i_k + SPLIT, ...): each writes its partial sum to ``scratch[i_t * SPLIT + i_k]`` and counts
    itself in ``count[i_t]``; the last to arrive adds the partials (in program order: the result does not
    depend on which is last), resets the count and finishes the token. Returns (b_s, whether this
    program finishes the token): for row 0 and OFF rows program 0, b_s untouched. The sum is scaled by
    ``w`` (the gate of a gated row, else 1.0); the features are encoded from ``b_x`` (``_sae_clamp_row``)."""
    p_scratch, p_count = split
    go = i_k == 0
    if i_row != 0:
        i_r = i_row.to(tl.int64)
        if tl.load(sae[0] + i_r) != 0:
            b_acc = _sae_walk(b_x, i_r, i_k * BLOCK_C, SPLIT * BLOCK_C, sae, o_d, m_d, BLOCK_C)
            p_mine = p_scratch + (i_t * SPLIT) * D
            tl.store(p_mine + i_k * D + o_d, b_acc, mask=m_d)
            tl.debug_barrier()  # every thread's part is stored before the count says so
            arrived = tl.atomic_add(p_count + i_t, 1, sem="acq_rel")
            go = arrived == SPLIT - 1
            if go:
                b_sum = tl.zeros_like(b_s)
                for j in tl.static_range(SPLIT):
                    b_sum += tl.load(p_mine + j * D + o_d, mask=m_d, other=0.0, cache_modifier=".cg")
                b_s += w * b_sum
                tl.atomic_xchg(p_count + i_t, 0)  # ready for the next launch (graph replays included)
    return b_s, go


@triton.jit
def _add_edit(b_s, i_t, i_row, full, o_d, m_d, w):
    """b_s + w * edit[t] for a token whose row is on at a full SAE slot (the edit, ``clamped(s) - s``, computed
    before this launch by ``kernels/sae_clamp/full_triton.py``); row 0 and OFF rows: b_s untouched, the edit
    unread. ``full``: (edit [N, D] fp32, mode [R] int32, edit stride)."""
    p_edit, p_mode, stride_e = full
    if i_row != 0:
        if tl.load(p_mode + i_row) != 0:
            b_s += w * tl.load(p_edit + i_t * stride_e + o_d, mask=m_d, other=0.0)
    return b_s


@triton.jit
def _normalized(b_s, b_w, eps, weight_offset, D: tl.constexpr, OFFSET_WEIGHT: tl.constexpr):
    """vLLM's RMSNorm of the float32 stream ``b_s`` (``naive._normalize``), before the cast to the output's dtype:
    also ``full_triton``'s gather of a full transcoder's input, so both compute it alike."""
    b_var = tl.sum(b_s * b_s, axis=0) / D
    b_n = b_s * (1.0 / tl.sqrt_rn(b_var + eps))
    if OFFSET_WEIGHT:
        b_o = b_n * (b_w.to(tl.float32) + weight_offset)
    else:
        # vLLM's RMSNorm: normalized.to(w.dtype) * w, rounded in w's dtype
        b_o = (b_n.to(b_w.dtype).to(tl.float32) * b_w.to(tl.float32)).to(b_w.dtype)
    return b_o


@triton.jit
def _quant_fp8(b_y, i_t, quant, o_d, m_d, QUANT: tl.constexpr):
    """Store the row ``b_y`` [BLOCK_D] fp32 as FP8 (``naive.quant_fp8_naive``): QUANT 1 by the given scale, 2 by
    ``max(|row|) / FP8_MAX`` (at least FP8_MIN_SCALE), stored per token."""
    p_q, stride_q, p_scale = quant
    if QUANT == 2:
        b_scale = tl.maximum(tl.max(tl.where(m_d, tl.abs(b_y), 0.0), axis=0) / _FP8_MAX, _FP8_MIN_SCALE)
        tl.store(p_scale + i_t, b_scale)
    else:
        b_scale = tl.load(p_scale)
    b_q = tl.clamp(b_y * (1.0 / b_scale), -_FP8_MAX, _FP8_MAX)
    tl.store(p_q + i_t * stride_q + o_d, b_q.to(p_q.dtype.element_ty), mask=m_d)


@triton.jit
def _quant_fp8_group(b_y, i_t, quant, D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                     UE8M0: tl.constexpr):
    """QUANT 3: store the row ``b_y`` [BLOCK_D] fp32 as FP8 with a scale per group of GROUP columns
    (``naive.quant_fp8_group_naive``, vLLM's ``_C.per_token_group_fp8_quant``): ``max(max|group|, eps) / FP8_MAX``
    (UE8M0: rounded up to a power of two, as the op's register path does it, on the bits), the quotient a true
    division; scale [t, g] written through the given strides (row-major, column-major or TMA-aligned: the layout the
    linear reads). Lanes past D are whole groups (D % GROUP == 0): nothing of theirs is stored. Plain sites only,
    where every program finishes its token."""
    p_q, stride_q, p_scale, stride_st, stride_sg, eps = quant
    b_y2 = tl.reshape(b_y, (BLOCK_D // GROUP, GROUP))  # [NG, GROUP]
    b_amax = tl.maximum(tl.max(tl.abs(b_y2), axis=1), eps)  # [NG]
    b_scale = tl.math.div_rn(b_amax, tl.full(b_amax.shape, _FP8_MAX, tl.float32))
    if UE8M0:  # the exponent bumped where the mantissa is not zero, the mantissa cleared
        b_bits = tl.maximum(b_scale, 1e-10).to(tl.uint32, bitcast=True)
        b_bits = ((b_bits >> 23) + ((b_bits & 0x7FFFFF) != 0).to(tl.uint32)) << 23
        b_scale = b_bits.to(tl.float32, bitcast=True)
    o_g = tl.arange(0, BLOCK_D // GROUP)
    o_c = tl.arange(0, GROUP)
    m_g = o_g * GROUP < D
    tl.store(p_scale + i_t * stride_st + o_g * stride_sg, b_scale, mask=m_g)
    b_q = tl.clamp(tl.math.div_rn(b_y2, tl.broadcast_to(b_scale[:, None], (BLOCK_D // GROUP, GROUP))),
                   -_FP8_MAX, _FP8_MAX)
    o_2 = o_g[:, None] * GROUP + o_c[None, :]  # [NG, GROUP]
    tl.store(p_q + i_t * stride_q + o_2, b_q.to(p_q.dtype.element_ty), mask=o_2 < D)


@triton.jit
def _steered_norm_kernel(
    p_x,  # [N, D]
    p_res,  # [N, D] (ignored unless HAS_RES)
    p_w,  # [D]
    p_out,  # [N, D] normalized output
    p_res_out,  # [N, D] new residual
    p_index,  # [>= N] int32
    stride_x, stride_res, stride_out, stride_res_out,
    eps,
    weight_offset,
    # Each feature's descriptor: a tuple, () while its flag is off (kernel arguments the feature reads)
    vec_a,  # HAS_A: (table [R, D], flag [1] uint8, table stride)
    vec_b,  # HAS_B: the same for slot B
    sae_a,  # SAE_A: (mode [R] int32, code [R, C] int32, value [R, C] fp32, enc [C, D] fp32, dec [C, D] fp32,
    #         bias [C] fp32, thr [C] fp32, C, code / value / enc / dec strides)
    sae_b,  # SAE_B: the same for slot B
    split,  # SPLIT > 1: (scratch [N * SPLIT, D] fp32: partial sums, count [>= N] int32: zeros between launches)
    cond,  # COND: (cond_site [R] int32, cond_params [R, 4] fp32 ([0, 3]: a live row has a condition; 0: the
    #        plain adds), probe [R, D] fp32, gate [>= N] fp32 (read and written), site_ids [2] int32 (the site
    #        order of slot A, of slot B), probe stride)
    cap_a,  # CAP_A: (pool [P, D] (written), pool stride, plan [>= N] int32 (-1: none)): slot A is captured
    cap_b,  # CAP_B: the same for slot B
    proj_a,  # PROJ_A: (count [R] int32, dirs [R, K, D] fp32 / model dtype, bounds [R, K, 2] fp32, K, dirs strides)
    proj_b,  # PROJ_B: the same for slot B
    tc,  # TC: a transcoder's clamp-only pack, as sae_a: encodes the normalized output, moves the residual only
    full_a,  # FULL_A: (edit [N, D] fp32, mode [R] int32, edit stride): a full SAE pack's move at slot A
    full_b,  # FULL_B: the same for slot B
    full_tc,  # FULL_TC: the same for a full transcoder pack (its edit of the MLP's output, added to the residual)
    quant,  # QUANT: (q [N, D] fp8 (written), q stride, scale: [1] fp32 read (static) / [N] fp32 written (dynamic));
    #         QUANT 3: (q, q stride, scale [N, D // GROUP] fp32 (written), its token / group strides, eps)
    ar,  # AR: (bufs [AR] int64: each TP rank's symmetric buffer address, flags [2] int32, this rank, the buffers'
    #      tokens): x is this rank's partial sum, all-reduced inside the launch (kernels/allreduce_norm/lamport.py)
    D: tl.constexpr,
    HAS_RES: tl.constexpr,
    OFFSET_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_B: tl.constexpr,
    SAE_A: tl.constexpr,
    SAE_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT: tl.constexpr,  # > 1: the first SAE slot's (else the transcoder's) clamps are shared by SPLIT programs
    COND: tl.constexpr,  # rows may carry a condition (with SAE_A / SAE_B: the gate is only read)
    CAP_A: tl.constexpr,  # slot A is captured: the stream as it reaches slot A goes to the pool
    CAP_B: tl.constexpr,  # slot B is captured: the stream after slot A's clamps and (gated) rows
    PROJ_A: tl.constexpr = False,  # slot A's rows may project the stream onto directions (ablate / cap)
    PROJ_B: tl.constexpr = False,
    TC: tl.constexpr = False,  # a transcoder's clamps after the norm (naive.transcoder_step)
    FULL_A: tl.constexpr = False,  # slot A's SAE is a full pack: its edit is added where its clamps would be
    FULL_B: tl.constexpr = False,
    FULL_TC: tl.constexpr = False,  # a full transcoder pack's edit, added to the residual after the norm
    EARLY: tl.constexpr = False,  # plain sites (no SAE, condition): every slot's loads before the first branch
    QUANT: tl.constexpr = 0,  # the output goes out in FP8 for the linear after the norm, instead of in the model
    # dtype: 1 static per-tensor (scale given), 2 dynamic per-token (naive.quant_fp8_naive), 3 per token and group
    # of GROUP columns (naive.quant_fp8_group_naive, a block-FP8 linear's input); plain sites only
    GROUP: tl.constexpr = 0,  # QUANT 3: columns per scale (a power of two dividing D)
    UE8M0: tl.constexpr = False,  # QUANT 3: scales rounded up to powers of two (DeepGEMM's UE8M0 on Hopper)
    AR: tl.constexpr = 0,  # > 0: the TP group's size; x is this rank's partial (vLLM's all-reduce is in the launch:
    # each token's row pushed to every rank, the ranks' rows summed in rank order in float32; one program a token)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent launch (``PDL``): the programs start while the
    # kernel before (the GEMM that makes x) drains, and wait for it (griddepcontrol.wait) before their first read of
    # what it or any later launch wrote (the stream, the residual, the gate, the exchange); what they read first
    # (the weight, the capture plans) no kernel of the step writes after the step's first kernels
):
    """The steered norm of one site: the features its flags turn on, in the order of ``naive._staged``
    (per slot: capture, gate, SAE clamps, projections, vectors), then vLLM's RMSNorm, then a transcoder's
    clamps (encoded from the output as stored, added to the residual only)."""
    i_t = tl.program_id(0).to(tl.int64)
    go = True  # this program writes the token (with SPLIT > 1: the one that finishes it)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    if CAP_A:  # the capture plans first: their loads overlap the stream's
        i_pa = _plan_of(i_t, cap_a)
    if CAP_B:
        i_pb = _plan_of(i_t, cap_b)
    # Every load the plain path needs is issued here, the weight's too (as Inductor's fused add +
    # RMSNorm does): issued after the reduction, its latency would add to every launch.
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0, eviction_policy="evict_last")
    if PDL:
        gdc_wait()
    if AR > 0:  # this rank's partial row out to every rank first, the residual's load in flight while the peers' land
        p_bufs, p_flags, ar_rank, ar_max_t = ar
        ar_epoch, ar_base = epoch_base(p_flags, ar_max_t, AR, D)
        push_row(p_bufs, tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0), ar_base, ar_rank, i_t, ar_max_t,
                 o_d, m_d, AR, D)
        if HAS_RES:
            b_r = tl.load(p_res + i_t * stride_res + o_d, mask=m_d, other=0.0, eviction_policy="evict_first")
        b_s = pull_sum(p_bufs, ar_base, ar_rank, i_t, ar_max_t, o_d, m_d, p_x.dtype.element_ty, AR, D, BLOCK_D)
        if HAS_RES:
            b_s += b_r.to(tl.float32)
    else:
        b_s = tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_RES:
            b_s += tl.load(p_res + i_t * stride_res + o_d, mask=m_d, other=0.0,
                           eviction_policy="evict_first").to(tl.float32)
    if CAP_A:  # every program of the token has the pristine stream: the first stores it
        _capture(b_s, i_pa, cap_a, o_d, m_d, tl.program_id(1) == 0)
    # the gate changes only at a probe site, where it is stored
    if COND and not (SAE_A or SAE_B or TC or FULL_A or FULL_B or FULL_TC):
        p_csite, p_cparams, p_probe, p_gate, p_site_ids, stride_probe = cond
        i_row = tl.load(p_index + i_t)
        if tl.load(p_cparams + 3) != 0:  # params[0, 3]: a live row has a condition (else the plain adds)
            g = tl.load(p_gate + i_t)
            i_gsite = tl.load(p_csite + i_row)
            if HAS_A:
                b_s, g = _add_gated_row(b_s, vec_a, i_row, o_d, m_d, g, i_gsite, tl.load(p_site_ids), p_gate + i_t,
                                        p_probe, p_cparams, stride_probe, proj_a, PROJ_A)
            elif PROJ_A:
                b_s = _project_gated(b_s, i_row, proj_a, o_d, m_d, (i_gsite >= 0) & ((i_gsite & _PROJ_GATED) != 0), g)
            if CAP_B:
                _capture(b_s, i_pb, cap_b, o_d, m_d, True)
            if HAS_B:
                b_s, g = _add_gated_row(b_s, vec_b, i_row, o_d, m_d, g, i_gsite, tl.load(p_site_ids + 1),
                                        p_gate + i_t, p_probe, p_cparams, stride_probe, proj_b, PROJ_B)
            elif PROJ_B:
                b_s = _project_gated(b_s, i_row, proj_b, o_d, m_d, (i_gsite >= 0) & ((i_gsite & _PROJ_GATED) != 0), g)
        else:
            if PROJ_A:
                b_s = _project(b_s, i_row, proj_a, o_d, m_d)
            if HAS_A:
                b_s = _add_row(b_s, vec_a, i_row, o_d, m_d, 1.0)
            if CAP_B:
                _capture(b_s, i_pb, cap_b, o_d, m_d, True)
            if PROJ_B:
                b_s = _project(b_s, i_row, proj_b, o_d, m_d)
            if HAS_B:
                b_s = _add_row(b_s, vec_b, i_row, o_d, m_d, 1.0)
    elif EARLY and not (SAE_A or SAE_B or TC or FULL_A or FULL_B or FULL_TC or COND) and (
            HAS_A or HAS_B or CAP_B or PROJ_A or PROJ_B):
        # EARLY (VLLM_STEER_NORM_EARLY, on by default): both slots' vector rows, counts, first directions and
        # bounds issued at once, before any branch (the late path below waits on slot A's projection branch before
        # it asks for A's row, on A's flag before B's mark...). Not branched on the token's row: s30 tried
        # `if i_row != 0` around them (H200 kernels_bench, 64 launches): idle 134.3 -> 127.9 µs, steered 163.8 -> 195.8
        # (the branch waits on the loads in flight), so an idle site keeps ~0.1 µs a launch (~0.14% of an 8b TPOT)
        i_row = tl.load(p_index + i_t)
        b_ta = tl.zeros_like(b_s)
        b_tb = tl.zeros_like(b_s)
        if HAS_A:
            on_a, b_ta = _row_of(vec_a, i_row, o_d, m_d)
        if HAS_B:
            on_b, b_tb = _row_of(vec_b, i_row, o_d, m_d)
        if PROJ_A:
            first_a = _proj_first(i_row, proj_a, o_d, m_d)
        if PROJ_B:
            first_b = _proj_first(i_row, proj_b, o_d, m_d)
        if PROJ_A:
            b_s = _project_from(b_s, i_row, proj_a, o_d, m_d, first_a)
        if HAS_A:
            b_s = tl.where(on_a, b_s + b_ta, b_s)
        if CAP_B:
            _capture(b_s, i_pb, cap_b, o_d, m_d, tl.program_id(1) == 0)
        if PROJ_B:
            b_s = _project_from(b_s, i_row, proj_b, o_d, m_d, first_b)
        if HAS_B:
            b_s = tl.where(on_b, b_s + b_tb, b_s)
    elif HAS_A or HAS_B or SAE_A or SAE_B or CAP_B or PROJ_A or PROJ_B or TC or FULL_A or FULL_B or FULL_TC:
        i_row = tl.load(p_index + i_t)
        # an SAE norm of a server with conditions reads the gate (no probe is here: refused)
        w_sae, w_vec, proj_gated, g = _gate_weights(cond, i_row, i_t, COND)
        if SAE_A:
            if SPLIT > 1:
                b_s, go = _sae_clamp_split(b_s, b_s, i_t, i_row, tl.program_id(1), split, sae_a, o_d, m_d, D,
                                           BLOCK_C, SPLIT, w_sae)
            else:
                b_s = _sae_clamp_row(b_s, b_s, i_row, sae_a, o_d, m_d, BLOCK_C, w_sae)
        b_s = _slot_rest(b_s, i_t, i_row, full_a, proj_a, vec_a, o_d, m_d, w_sae, w_vec, proj_gated, g, FULL_A, PROJ_A,
                         HAS_A, COND)
        if CAP_B:
            if SAE_A and SPLIT > 1:  # only the program that finished A's split walk has the whole stream
                _capture(b_s, i_pb, cap_b, o_d, m_d, go)
            else:
                _capture(b_s, i_pb, cap_b, o_d, m_d, tl.program_id(1) == 0)
        if SAE_B:
            if SPLIT > 1 and not SAE_A:  # B's stream (s + A[row]) is known to every program
                b_s, go = _sae_clamp_split(b_s, b_s, i_t, i_row, tl.program_id(1), split, sae_b, o_d, m_d, D,
                                           BLOCK_C, SPLIT, w_sae)
            else:  # after a split A only the finishing program has the whole stream: it walks B alone
                i_row_b = i_row
                if SPLIT > 1:  # row 0 for the programs that do not finish the token: they skip B
                    i_row_b = tl.where(go, i_row, 0)
                b_s = _sae_clamp_row(b_s, b_s, i_row_b, sae_b, o_d, m_d, BLOCK_C, w_sae)
        b_s = _slot_rest(b_s, i_t, i_row, full_b, proj_b, vec_b, o_d, m_d, w_sae, w_vec, proj_gated, g, FULL_B, PROJ_B,
                         HAS_B, COND)
    m_w = m_d & go
    if not (TC or FULL_TC):
        tl.store(p_res_out + i_t * stride_res_out + o_d, b_s.to(p_res_out.dtype.element_ty), mask=m_w)
    b_o = _normalized(b_s, b_w, eps, weight_offset, D, OFFSET_WEIGHT).to(p_out.dtype.element_ty)
    if QUANT == 3:  # vLLM's group quant of the output as rounded to the model dtype: what its block-FP8 linear reads
        _quant_fp8_group(b_o.to(tl.float32), i_t, quant, D, BLOCK_D, GROUP, UE8M0)
    elif QUANT != 0:  # vLLM's QuantFP8 of the output as rounded to the model dtype: what its own linear would read
        _quant_fp8(b_o.to(tl.float32), i_t, quant, o_d, m_w, QUANT)
    elif TC and SPLIT > 1 and not (SAE_A or SAE_B):  # every program has the output: the first stores it
        tl.store(p_out + i_t * stride_out + o_d, b_o, mask=m_d & (tl.program_id(1) == 0))
    else:
        tl.store(p_out + i_t * stride_out + o_d, b_o, mask=m_w)
    if TC:  # the MLP's input is b_o: its clamps' delta goes to the residual
        if SPLIT > 1 and not (SAE_A or SAE_B):  # the token's programs share the walk, the last finishes it
            b_s, go = _sae_clamp_split(b_s, b_o.to(tl.float32), i_t, i_row, tl.program_id(1), split, tc, o_d, m_d,
                                       D, BLOCK_C, SPLIT, w_sae)
        else:  # after a split SAE walk, the program that finished the token walks it alone
            i_row_t = i_row
            if SPLIT > 1:
                i_row_t = tl.where(go, i_row, 0)
            b_s = _sae_clamp_row(b_s, b_o.to(tl.float32), i_row_t, tc, o_d, m_d, BLOCK_C, w_sae)
        tl.store(p_res_out + i_t * stride_res_out + o_d, b_s.to(p_res_out.dtype.element_ty), mask=m_d & go)
    elif FULL_TC:  # the edit was encoded from this output (full_triton's gather): it goes to the residual
        b_s = _add_edit(b_s, i_t, i_row, full_tc, o_d, m_d, w_sae)
        tl.store(p_res_out + i_t * stride_res_out + o_d, b_s.to(p_res_out.dtype.element_ty), mask=m_w)
    if AR > 0:  # the launch's last program switches the exchange's epoch for the next launch
        flip_epoch(p_flags, ar_epoch, tl.num_programs(0) * tl.num_programs(1))


def _num_warps(block_d: int) -> int:
    return 4 if block_d <= 1024 else 8 if block_d <= 8192 else 16


def _sae_desc(pack, d: int) -> tuple:
    """The kernel's descriptor of one slot's clamp-only SAE pack (() for none)."""
    if not pack:
        return ()
    if len(pack) != N_CLAMP_ONLY:
        raise ValueError(f"the Triton SAE path takes clamp-only packs ({N_CLAMP_ONLY} tensors), got {len(pack)}")
    mode, code, value, enc, dec, bias, thr = pack[:7]
    assert enc.shape[-1] == d and dec.shape[-1] == d and enc.stride(-1) == 1 and dec.stride(-1) == 1
    assert code.stride(-1) == 1 and value.stride(-1) == 1
    return (mode, code, value, enc, dec, bias, thr, code.shape[1],
            code.stride(0), value.stride(0), enc.stride(0), dec.stride(0))


def _proj_desc(proj, d: int) -> tuple:
    """The kernel's descriptor of one slot's projections (() for none)."""
    if not proj:
        return ()
    count, dirs, bounds = proj
    assert dirs.shape[-1] == d and dirs.stride(-1) == 1 and bounds.is_contiguous() and bounds.shape[-1] == 2
    return (count, dirs, bounds, dirs.shape[1], dirs.stride(0), dirs.stride(1))


# The split clamp walk (decode sizes): SPLIT programs per token share a row's clamps. At most
# SPLIT_PROGRAMS programs in all (about two per SM of an H100), none past SPLIT_MAX_TOKENS tokens (there the
# tokens alone fill the GPU), at most SPLIT_MAX per token: VLLM_STEER_SAE_SPLIT_MAX (8; 16 at most),
# 1 = the serial walk. Measured on an H100 (bench/RESULTS.md, 2026-11-24 s12), 16 tokens x 64 clamps, D 4096:
# serial 72.4 µs, split 4 27.1, split 8 17.5, split 16 19.5; idle 2.03 / 2.32 (split 8) / 2.53 (split 16).
SPLIT_PROGRAMS, SPLIT_MAX_TOKENS = 256, 64
SPLIT_MAX = max(1, min(16, int(os.environ.get("VLLM_STEER_SAE_SPLIT_MAX", "8"))))
_SPLIT_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_of(n: int) -> int:
    """Programs per token for ``n`` tokens (1: the serial walk, one program per token)."""
    if n > SPLIT_MAX_TOKENS:
        return 1
    return max(1, min(SPLIT_MAX, SPLIT_PROGRAMS // max(n, 1)))


# The tiled prefill clamps (../sae_clamp/tiled_triton.py) are tested under Triton's interpreter and compiled for sm_90
# offline only: until tests/gpu/test_sae_norm_gpu.py's prefill cases pass on a GPU, steps take the walk unless
# VLLM_STEER_SAE_TILED=1 (the tests and sae_kernel_bench set TILED themselves).
TILED = os.environ.get("VLLM_STEER_SAE_TILED", "0") == "1"


def tiled_of(n: int) -> bool:
    """Whether a step of ``n`` tokens applies its SAE slots' clamps over token tiles
    (``../sae_clamp/tiled_triton.py``, two or three launches before the norm's) instead of the walk in the
    norm: with TILED, past SPLIT_MAX_TOKENS, where the split walk stops (up to there it fills the GPU with programs
    that share each token's clamps; past it every token would walk its clamps alone, reading their rows again)."""
    return TILED and n > SPLIT_MAX_TOKENS


def split_buffers(device: torch.device, d: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scratch [SPLIT_PROGRAMS, d] float32, count [SPLIT_MAX_TOKENS] int32 zeros) for ``device``; made
    on first use outside a CUDA-graph capture (``runtime.sae_tables`` makes them when it stages a
    pack), None while capturing before that (the launch then walks the clamps serially)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, d)
    bufs = _SPLIT_BUFFERS.get(key)
    if bufs is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        bufs = _SPLIT_BUFFERS[key] = (torch.zeros(SPLIT_PROGRAMS, d, dtype=torch.float32, device=device),
                                      torch.zeros(SPLIT_MAX_TOKENS, dtype=torch.int32, device=device))
    return bufs


# EARLY (issue 38, read once at import; the launcher's ``early`` overrides it per call): at sites without SAE or
# conditions, every vector row, projection count, first direction and bounds of both slots is loaded before the
# first branch (the late path waits on slot A's mark, then A's flag and B's mark, then B's flag: a dependent round
# of loads more than the kernel without projections, README "EARLY loads"). On by default since s29's H100 bench
# (bench/kernels_bench.py, the default rows against ``*_late``: 64 launches a step, steered 191.6 -> 168.2 µs at
# N16, projections idle 161.9 -> 153.8); VLLM_STEER_NORM_EARLY=0 takes the late path, for A/B runs.
EARLY = os.environ.get("VLLM_STEER_NORM_EARLY", "1") != "0"
def _interpreted() -> bool:
    """Triton runs its interpreter (its knob, which a test process may set apart from ``TRITON_INTERPRET``)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


# PDL (VLLM_STEER_NORM_PDL=1, off by default, not yet measured; s41): every launch a programmatic dependent launch,
# as FlashInfer's fused all-reduce + norm (stock's at TP >= 2) is launched: its start-up overlaps the end of the
# kernel before it. Never under Triton's interpreter (it cannot run griddepcontrol); both read once, not per launch.
_PDL_OK = gdc_wait is not None and not _interpreted()
PDL = os.environ.get("VLLM_STEER_NORM_PDL", "0") == "1" and _PDL_OK
_KERNEL = CachedLauncher(_steered_norm_kernel)


def steered_norm_triton(
    x: torch.Tensor,  # [N, D], rows contiguous
    residual: torch.Tensor | None,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    weight_offset: float,
    index: torch.Tensor,  # [>= N] int32
    vec_a: Sequence[torch.Tensor] = (),  # (table [R, D], flag [1] uint8), () for none
    vec_b: Sequence[torch.Tensor] = (),
    sae_a: Sequence[torch.Tensor] = (),  # a clamp-only SAE pack (kernels/sae_clamp/packed.py), () for none
    sae_b: Sequence[torch.Tensor] = (),
    cond: Sequence[torch.Tensor] = (),  # (cond_site [R] int32, cond_params [R, 4], probe [R, D], site_ids [2])
    gate: torch.Tensor | None = None,  # [>= N] float32, updated in place (with cond)
    plan_a: torch.Tensor | None = None,  # [>= N] int32, -1: not captured; None: slot A not captured
    plan_b: torch.Tensor | None = None,
    pool: torch.Tensor | None = None,  # [P, D], written (with a plan)
    proj_a: Sequence[torch.Tensor] = (),  # (count [R] int32, dirs [R, K, D] fp32, bounds [R, K, 2] fp32), () for none
    proj_b: Sequence[torch.Tensor] = (),
    split: int | None = None,  # programs per token sharing the clamps (None: ``split_of(N)``; 1: serial)
    tiled: bool | None = None,  # SAE slots' clamps over token tiles first (None: ``tiled_of(N)``)
    tc: Sequence[torch.Tensor] = (),  # a transcoder's clamp-only pack (reads the output, moves the residual), ()
    full_a: Sequence[torch.Tensor] = (),  # a full SAE pack's move at slot A: (edit [N, D] fp32, mode [R] int32), ()
    full_b: Sequence[torch.Tensor] = (),
    full_tc: Sequence[torch.Tensor] = (),  # a full transcoder pack's edit: (edit [N, D] fp32, mode [R] int32), ()
    early: bool | None = None,  # every slot's loads before the first branch (None: VLLM_STEER_NORM_EARLY; False: late)
    quant: tuple = (),  # steered_norm_fp8_triton's (q [N, D] fp8, scale, QUANT[, GROUP, eps, UE8M0]): the output as FP8
    # into q, not out
    ar=None,  # an allreduce_norm.ArNormWorkspace: x is this TP rank's partial, all-reduced in the launch (every rank
    # of the group calls it alike); one program a token (no split SAE walk), no full packs or tiled clamps (they
    # read x before the launch)
    pdl: bool | None = None,  # a programmatic dependent launch (None: VLLM_STEER_NORM_PDL; never interpreted)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``naive.steered_norm_naive`` for clamp-only SAE packs, one launch: each feature's descriptor is
    passed to the kernel as a tuple (empty while its constexpr flag is off, so the compiled kernel takes
    nothing it does not read)."""
    n, d = x.shape
    out = x if quant else torch.empty_like(x)  # FP8 out: the kernel writes q, never out
    res_out = torch.empty_like(x)
    if n == 0:
        return out, res_out
    shape = _SHAPES.get(d) or _shape(d)
    # Every launch of a step above the graph sizes runs this from Python (64 a step at the 8b shape): features off
    # cost a test each, and the launcher's key (``spec``) is built here, flat, beside the arguments (``spec_of``
    # walks every argument, recursively: ~4 µs a call on the CPU box): the dtype of every tensor, the raw ints, the
    # OR of the tensors' addresses (all 16-byte aligned, or ``spec_of`` decides); out and res_out, fresh, are aligned
    # and like x. The rarer features' descriptors are keyed by ``spec_of``, as one element.
    res = x if residual is None else residual
    stride_o = out.stride(0)
    args = (x, res, weight, out, res_out, index, x.stride(0), 0 if residual is None else res.stride(0), stride_o,
            stride_o, eps, weight_offset)
    ptrs = x.data_ptr() | res.data_ptr() | weight.data_ptr() | index.data_ptr()
    spec = (x.dtype, res.dtype, weight.dtype, index.dtype, args[6], args[7], stride_o, type(eps), type(weight_offset))
    va = vb = ca = cb = ard = ()
    has_a = has_b = cap_a = cap_b = False
    world = 0
    if ar is not None:
        if n > ar.max_tokens or x.dtype != ar.buf.dtype or d != ar.hidden or full_a or full_b or full_tc:
            raise ValueError(f"the all-reduce in the norm takes up to {ar.max_tokens} tokens of [{ar.hidden}] "
                             f"{ar.buf.dtype} and no full SAE pack, got {n} x {d} {x.dtype}")
        ard, world, split, tiled = (ar.buf_ptrs, ar.flags, ar.rank, ar.max_tokens), ar.world, 1, False
        ptrs |= ar.buf_ptrs.data_ptr() | ar.flags.data_ptr()
        spec += (spec_of(ard), world)
    if vec_a:
        table, flag = vec_a[0], vec_a[1]
        va, has_a = (table, flag, table.stride(0)), True
        ptrs |= table.data_ptr() | flag.data_ptr()
        spec += (table.dtype, flag.dtype, va[2])
    if vec_b:
        table, flag = vec_b[0], vec_b[1]
        vb, has_b = (table, flag, table.stride(0)), True
        ptrs |= table.data_ptr() | flag.data_ptr()
        spec += (table.dtype, flag.dtype, vb[2])
    if pool is not None:
        assert pool.stride(-1) == 1 and pool.shape[-1] == d
        stride_p = pool.stride(0)
        ptrs |= pool.data_ptr()
        spec += (pool.dtype, stride_p)
        if plan_a is not None:
            ca, cap_a = (pool, stride_p, plan_a), True
            ptrs |= plan_a.data_ptr()
            spec += (plan_a.dtype,)
        if plan_b is not None:
            cb, cap_b = (pool, stride_p, plan_b), True
            ptrs |= plan_b.data_ptr()
            spec += (plan_b.dtype,)
    if sae_a or sae_b or tc or cond or proj_a or proj_b or full_a or full_b or full_tc:
        sa = sb = bufs = cond_desc = pa = pb = ()
        if (sae_a or sae_b) and (tiled_of(n) if tiled is None else tiled):  # prefill: the edits first (FULL_A / B)
            _sae_desc(sae_a, d), _sae_desc(sae_b, d)  # clamp-only packs only, as below
            from vllm_steer.kernels.sae_clamp.tiled_triton import tiled_slots

            sae_a, full_a, sae_b, full_b = tiled_slots(x, residual, index, vec_a, sae_a, sae_b, cond, gate, proj_a,
                                                       full_a)
        if sae_a or sae_b or tc:
            sa, sb = _sae_desc(sae_a, d), _sae_desc(sae_b, d)
            split = split_of(n) if split is None else split
            bufs = (split_buffers(x.device, d) or ()) if split > 1 else ()
            if not bufs:
                split = 1
        else:
            split = 1
        if cond:
            cond_site, cond_params, probe, site_ids = cond
            assert probe.stride(-1) == 1 and cond_params.is_contiguous() and probe.shape[-1] == d
            cond_desc = (cond_site, cond_params, probe, gate, site_ids, probe.stride(0))
        if proj_a or proj_b:
            pa, pb = _proj_desc(proj_a, d), _proj_desc(proj_b, d)
        tcd = _sae_desc(tc, d) if tc else ()
        fa = (full_a[0], full_a[1], full_a[0].stride(0)) if full_a else ()
        fb = (full_b[0], full_b[1], full_b[0].stride(0)) if full_b else ()
        ftc = (full_tc[0], full_tc[1], full_tc[0].stride(0)) if full_tc else ()
        assert not quant, "FP8 output: plain sites only (vectors, capture)"
        spec += (spec_of((sa, sb, bufs, cond_desc, pa, pb, tcd, fa, fb, ftc)),)
        args += (va, vb, sa, sb, bufs, cond_desc, ca, cb, pa, pb, tcd, fa, fb, ftc, (), ard)
        flags = shape[0] + (residual is not None, weight_offset != 0.0, shape[1], has_a, has_b, bool(sa), bool(sb),
                            32, split, bool(cond_desc), cap_a, cap_b, bool(pa), bool(pb), bool(tcd), bool(fa),
                            bool(fb), bool(ftc), EARLY if early is None else early)
        tail = (0, 0, False, world)  # QUANT, GROUP, UE8M0, AR
    else:  # vectors and capture only (the other descriptors empty, their flags off)
        qd = qflags = ()
        if quant:
            q, scale, mode = quant[:3]
            qd = (q, q.stride(0), scale)
            ptrs |= q.data_ptr() | scale.data_ptr()
            spec += (q.dtype, qd[1], scale.dtype)
            qflags = (mode,)
            if mode == 3:  # (.., group, eps, ue8m0): the scales' strides change with N (TMA-aligned): keyed by class
                group, quant_eps, ue8m0 = quant[3:]
                st, sg = scale.stride()
                qd += (st, sg, quant_eps)
                spec += (st == 1, st % 16 == 0, sg == 1, sg % 16 == 0)
                qflags = (mode, group, ue8m0)
        args += (va, vb, (), (), (), (), ca, cb, (), (), (), (), (), (), qd, ard)
        flags = shape[0] + (residual is not None, weight_offset != 0.0, shape[1], has_a, has_b, False, False, 32, 1,
                            False, cap_a, cap_b, False, False, False, False, False, False,
                            EARLY if early is None else early) + qflags
        tail = (0, 0, False)[len(qflags):] + (world,)  # the rest of QUANT, GROUP, UE8M0, then AR
        split = 1
    pdl = (PDL if pdl is None else pdl) and _PDL_OK
    if world or pdl:  # the constexprs are passed by position: those before AR / PDL too
        flags += tail + ((True,) if pdl else ())
    _KERNEL((n, split), args, flags, shape[2], None, None if ptrs & 15 else spec, launch_pdl=pdl)
    return out, res_out


def steered_norm_fp8_triton(x, residual, weight, eps, weight_offset, index, vec_a=(), vec_b=(), plan_a=None,
                            plan_b=None, pool=None, quant_scale: torch.Tensor | None = None,
                            group_scale: torch.Tensor | None = None, group_size: int = 0, group_eps: float = 1e-10,
                            ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain site's steered norm whose output goes out as FP8 (``naive.quant_fp8_naive``; the op
    ``steered_norm_plain_fp8``): (q [N, D] float8_e4m3fn, scale [N, 1] float32 when dynamic (``quant_scale`` None) or
    empty when static, new residual). ``group_scale`` [N, D // group_size] float32 given (any strides: the layout the
    block-FP8 linear reads): per token and group instead (``naive.quant_fp8_group_naive``), the scales written into
    it; the returned scale is empty."""
    n = x.shape[0]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if group_scale is not None:
        d = x.shape[1]
        if group_size <= 0 or group_size & (group_size - 1) or d % group_size or group_scale.shape != (
                n, d // group_size):
            raise ValueError(f"group quant: group_size {group_size} must be a power of two dividing {d}, scales "
                             f"[{n}, {d // max(group_size, 1)}], got {tuple(group_scale.shape)}")
        _, res_out = steered_norm_triton(x, residual, weight, eps, weight_offset, index, vec_a, vec_b, plan_a=plan_a,
                                         plan_b=plan_b, pool=pool,
                                         quant=(q, group_scale, 3, group_size, float(group_eps), bool(ue8m0)))
        return q, torch.empty(0, dtype=torch.float32, device=x.device), res_out
    if quant_scale is None:
        scale, mode, ret = torch.empty((n, 1), dtype=torch.float32, device=x.device), 2, None
    else:
        scale, mode, ret = quant_scale, 1, torch.empty(0, dtype=torch.float32, device=x.device)
    _, res_out = steered_norm_triton(x, residual, weight, eps, weight_offset, index, vec_a, vec_b, plan_a=plan_a,
                                     plan_b=plan_b, pool=pool, quant=(q, scale, mode))
    return q, scale if ret is None else ret, res_out


_SHAPES: dict[int, tuple] = {}


def _shape(d: int) -> tuple:
    """((D,), BLOCK_D, num_warps) of hidden size ``d``, computed once per size."""
    if d > MAX_HIDDEN:
        raise ValueError(f"steered_rms_norm supports hidden sizes up to {MAX_HIDDEN}, got {d}")
    block_d = next_power_of_2(d)
    shape = _SHAPES[d] = ((d,), block_d, _num_warps(block_d))
    return shape
