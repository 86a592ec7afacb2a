"""Full SAE packs (TopK, or a site that allows reconstruct) on CUDA: each on token's move at one slot,
``edit[t] = clamped(s)[t] - s[t]`` (``packed.apply_site_naive``), computed with tensor cores for the tokens whose
row is on and for no other; the steered norm adds ``w * edit[t]`` where the slot's clamps go (``FULL_A`` /
``FULL_B`` in ``../steered_rms_norm/triton.py``). ``site_edit`` launches it.

Launches per full slot and step, each a few µs and nothing more when no token's row is on (no host sync, no
data-dependent shape: CUDA graphs replay them with rows changed after capture): 3 at slot A (up to ``_COMPACT_N``
tokens, else 4), 5 at slot B.

1. ``_compact`` (one program): the ids of the on tokens (row != 0, mode != 0) in order, and their count. The
   count is the only write of an idle step. At slot A with up to ``_COMPACT_N`` tokens every ``_encode`` program
   lists them itself instead (``_compact_tile``), and its first stores the list (s30: one launch fewer).
2. per round of ``ROUND`` listed tokens (``ceil(N / ROUND)`` rounds, fixed by N; a tile past the count exits):
   - ``_gather`` (slot B only): the slot's float32 stream of each listed token: x + residual plus slot A's
     features (clamp-only walk or full edit, projections, vectors, with the gate's weights), as the norm has it;
     at slot A the GEMMs read x + residual of the listed tokens themselves. A full transcoder pack (``norm``): the
     stream after slot A, normalized as the norm kernel stores its output (the MLP's input), in float32;
   - ``_encode``: ``pre = s @ W_enc + b_enc`` (``tl.dot``, a program per token tile x feature tile; the stream split
     into bf16 hi + lo, both against the bf16 weights, float32 accumulation per K tile: ``_tile_dot``);
   - ``_select``: per token the activation (TopK: the k-th largest ``relu(pre)`` found exactly by a bitwise search
     on its int32 bits, stopping once exactly k reach the threshold; else ``pre > thr``), the row's clamps, and the
     decode coefficients: a RECONSTRUCT row's ``f'`` (every feature) over ``pre``, a DELTA row's ``f' - f``
     (clamped features) in ``cv`` (its pre is not written back);
   - ``_decode``: a program per token tile x column tile x split of d_sae (``_splits``: enough programs to fill
     the GPU at decode sizes): RECONSTRUCT rows' ``coef @ W_dec`` (at most ``_SKIP_TOKENS`` tokens a round: a W_dec
     tile masked off, no bytes moved, when every coefficient of the tile's tokens is 0; more: every tile streamed;
     no branch in the K loop either way, so its loads pipeline) plus DELTA rows'
     ``(f' - f) @ W_dec[feats]`` over the clampable features' W_dec rows gathered by id (a delta-only step reads
     C rows of W_dec, not d_sae); both on tensor cores (``_tile_dot``); one split writes the edit itself
     (``_finish``: + ``b_dec - s`` for RECONSTRUCT rows), else each split stores its partial sum and the tile's
     last program to arrive adds them in split order, then ``_finish`` (s30: was a fifth launch, ``_reduce``).

Tiles and splits are fixed by N (``_TILES``; no autotuning). The per-launch roofline is in README.md. ``Tuning``:
the encoder's launch variants that ``bench/sae_kernel_bench.py --topk-sweep`` times (issue 39; README "Third pass");
its defaults are the launches above.

TopK ties: every feature whose pre equals the k-th largest is kept (torch.topk keeps exactly k); with float
activations a tie at the boundary is a measure-zero event.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_steer.kernels.host_math import cdiv, next_power_of_2
from vllm_steer.kernels.launch_cache import CachedLauncher
from vllm_steer.kernels.sae_clamp.naive import RECONSTRUCT
from vllm_steer.kernels.steered_rms_norm.triton import (_gate_weights, _normalized, _num_warps, _sae_clamp_row,
                                                         _slot_rest)

_UPCAST = os.environ.get("TRITON_INTERPRET") == "1"
ROUND = 1024  # listed tokens per round: bounds the per-round scratch (pre: ROUND x d_sae float32)
_SELECT_MAX = 16384  # d_sae up to this: a token's pre-activations stay in registers through the TopK search
_SELECT_CHUNK = 4096  # larger d_sae: read in chunks of this many, once per bit of the search
_GROUPS = 64  # TopK's lower bound: the smallest of this many groups' largest keys (valid for k <= 64)
_SELECT_C = 1024  # clampable features a step of _select's clamp loops (one step for C <= 1024: fewer round trips)
_RECON = tl.constexpr(RECONSTRUCT)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b (a, b in the weights' dtype). UPCAST (Triton's interpreter, whose dot mishandles bfloat16):
    the same products in float32 (a product of two bf16 values is exact in float32). Float32 weights (tests):
    IEEE float32, not TF32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif b.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile_dot(a, w, PRECISE: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """a @ w of one K tile (a float32, w in the weights' dtype) in a fresh float32 accumulator: a split into bf16
    hi + lo (lo first: PRECISE), both against w. The caller adds the tile to its running sum (IEEE float32
    addition), so the tensor cores' own accumulation (its rounding, toward zero on NVIDIA's) spans one tile's
    products only: the error stays within ~(2^-16 + 2 * BLOCK_K * 2^-23 + tiles * 2^-24) * sum |a| |w| whatever
    the MMA's internal order (README, Precision), where one accumulator across all of K drifts by a rounding
    per MMA step relative to the whole running sum."""
    a_hi = a.to(w.dtype)
    t = tl.zeros((BM, BN), dtype=tl.float32)
    if PRECISE:
        t = _dot((a - a_hi.to(tl.float32)).to(w.dtype), w, t, UPCAST)
    return _dot(a_hi, w, t, UPCAST)


@triton.jit
def _compact(p_index, p_mode, p_tok, p_count, N, BLOCK: tl.constexpr):
    """tok[0:count] = the tokens t < N whose row is on, in order; count[0] = how many."""
    base = 0
    for t0 in range(0, N, BLOCK):
        o_t = t0 + tl.arange(0, BLOCK)
        m_t = o_t < N
        row = tl.load(p_index + o_t, mask=m_t, other=0)
        on = (tl.load(p_mode + row, mask=m_t & (row != 0), other=0) != 0).to(tl.int32)
        tl.store(p_tok + base + tl.cumsum(on, axis=0) - 1, o_t.to(tl.int32), mask=on != 0)
        base += tl.sum(on, axis=0)
    tl.store(p_count, base)


_COMPACT_N = 256  # tokens ``_encode`` lists itself (one chunk a program); more: the ``_compact`` launch
_COMPACT_T = tl.constexpr(_COMPACT_N)


@triton.jit
def _compact_tile(p_index, p_mode, p_tok, p_count, N, m0, BLOCK_M: tl.constexpr, STORE):
    """(the count of on tokens t < N, the ids of those listed m0 .. m0 + BLOCK_M - 1): ``_compact`` for one encoder
    program, N <= ``_COMPACT_N`` (one chunk); STORE (one program of the launch): also writes tok[0:count] and the
    count."""
    o_t = tl.arange(0, _COMPACT_T)
    m_t = o_t < N
    row = tl.load(p_index + o_t, mask=m_t, other=0)
    on = (tl.load(p_mode + row, mask=m_t & (row != 0), other=0) != 0).to(tl.int32)
    pos = tl.cumsum(on, axis=0) - 1
    hit = (on[None, :] != 0) & (pos[None, :] == (m0 + tl.arange(0, BLOCK_M))[:, None])
    i_t = tl.sum(tl.where(hit, o_t[None, :], 0), axis=1).to(tl.int64)
    count = tl.sum(on, axis=0)
    if STORE:
        tl.store(p_tok + pos, o_t.to(tl.int32), mask=on != 0)
        tl.store(p_count, count)
    return count, i_t


@triton.jit
def _slot_stream(p_x, p_res, p_index, i_t, stride_x, stride_res, vec_a, sae_a, proj_a, full_a, cond, o_d, m_d,
                 HAS_RES: tl.constexpr, PRE_VEC: tl.constexpr, PRE_SAE: tl.constexpr, PRE_PROJ: tl.constexpr,
                 PRE_FULL: tl.constexpr, COND: tl.constexpr):
    """Token i_t's float32 stream at slot B: x + residual, then slot A's features in the norm kernel's order and
    weights (so it equals the kernel's stream there, bit for bit). Also ``tiled_triton``'s slot-B gather."""
    b_s = tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    if HAS_RES:
        b_s += tl.load(p_res + i_t * stride_res + o_d, mask=m_d, other=0.0).to(tl.float32)
    if PRE_VEC or PRE_SAE or PRE_PROJ or PRE_FULL:
        i_row = tl.load(p_index + i_t)
        w_sae, w_vec, proj_gated, g = _gate_weights(cond, i_row, i_t, COND)  # an SAE norm only reads the gate
        if PRE_SAE:
            b_s = _sae_clamp_row(b_s, b_s, i_row, sae_a, o_d, m_d, 32, w_sae)
        b_s = _slot_rest(b_s, i_t, i_row, full_a, proj_a, vec_a, o_d, m_d, w_sae, w_vec, proj_gated, g, PRE_FULL,
                         PRE_PROJ, PRE_VEC, COND)
    return b_s


@triton.jit
def _gather(p_x, p_res, p_index, p_tok, p_count, p_s, r0, stride_x, stride_res, stride_s,
            vec_a, sae_a, proj_a, full_a, cond, norm,
            D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, PRE_VEC: tl.constexpr,
            PRE_SAE: tl.constexpr, PRE_PROJ: tl.constexpr, PRE_FULL: tl.constexpr, COND: tl.constexpr,
            NORM: tl.constexpr, OFFSET_WEIGHT: tl.constexpr):
    """S[j] = the stream at the slot of listed token r0 + j (``_slot_stream``); NORM (a full transcoder's input):
    that stream after slot A normalized as the norm kernel stores its output (``_normalized``, rounded to x's
    dtype), in float32. ``norm``: (weight [D], eps, weight_offset)."""
    j = tl.program_id(0)
    if r0 + j < tl.load(p_count):
        i_t = tl.load(p_tok + r0 + j).to(tl.int64)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_s = _slot_stream(p_x, p_res, p_index, i_t, stride_x, stride_res, vec_a, sae_a, proj_a, full_a, cond, o_d,
                           m_d, HAS_RES, PRE_VEC, PRE_SAE, PRE_PROJ, PRE_FULL, COND)
        if NORM:
            p_w, eps, weight_offset = norm
            b_w = tl.load(p_w + o_d, mask=m_d, other=0.0)
            b_s = _normalized(b_s, b_w, eps, weight_offset, D, OFFSET_WEIGHT).to(p_x.dtype.element_ty).to(tl.float32)
        tl.store(p_s + j * stride_s + o_d, b_s, mask=m_d)


@triton.jit
def _stream(src, o_m, m_m, o_k, m_k, DIRECT: tl.constexpr, HAS_RES: tl.constexpr):
    """The float32 stream of listed rows ``o_m`` (of this round), columns ``o_k``: DIRECT (slot A, nothing before
    it) x[t] + residual[t] of their tokens, else the gathered S rows. ``src``: (S, S stride, x, residual, x stride,
    residual stride, tok + r0)."""
    return _stream_at(src, _listed_tokens(src, o_m, m_m, DIRECT), o_m, m_m, o_k, m_k, DIRECT, HAS_RES)


@triton.jit
def _listed_tokens(src, o_m, m_m, DIRECT: tl.constexpr):
    """The token ids of listed rows ``o_m`` (int64) for DIRECT, whose stream is read at them; zeros otherwise."""
    i_t = tl.zeros_like(o_m).to(tl.int64)
    if DIRECT:
        i_t = tl.load(src[6] + o_m, mask=m_m, other=0).to(tl.int64)
    return i_t


@triton.jit
def _stream_at(src, i_t, o_m, m_m, o_k, m_k, DIRECT: tl.constexpr, HAS_RES: tl.constexpr):
    """``_stream`` with the listed rows' token ids ``i_t`` given (DIRECT reads x and residual at them)."""
    p_s, stride_s, p_x, p_res, stride_x, stride_res, p_tok = src
    m = m_m[:, None] & m_k[None, :]
    if DIRECT:
        a = tl.load(p_x + i_t[:, None] * stride_x + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            a += tl.load(p_res + i_t[:, None] * stride_res + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        a = tl.load(p_s + o_m[:, None] * stride_s + o_k[None, :], mask=m, other=0.0)
    return a


@triton.jit
def _hilo(src, p_count, p_hl, r0, stride_hl, stride_plane, D: tl.constexpr, BLOCK_D: tl.constexpr,
          ROUND_N: tl.constexpr, DIRECT: tl.constexpr, HAS_RES: tl.constexpr):
    """``Tuning.hilo``: listed token r0 + j's float32 stream split once into the weights' dtype, hi (plane 0) and lo
    (plane 1), as ``_tile_dot`` splits each tile: the encoder then reads both as plain dot operands (its loads
    pipeline like W_enc's; the split's arithmetic moved out of its K loop, the products the same)."""
    j = tl.program_id(0)
    if j < tl.minimum(tl.load(p_count) - r0, ROUND_N):
        o_m = j + tl.arange(0, 1)
        o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        a = _stream(src, o_m, o_m >= 0, o_d, m_d, DIRECT, HAS_RES)  # [1, BLOCK_D]
        a_hi = a.to(p_hl.dtype.element_ty)
        p = p_hl + o_m[:, None].to(tl.int64) * stride_hl + o_d[None, :]
        tl.store(p, a_hi, mask=m_d[None, :])
        tl.store(p + stride_plane, (a - a_hi.to(tl.float32)).to(p_hl.dtype.element_ty), mask=m_d[None, :])


@triton.jit
def _w_tile(p_wenc, o_k, m_k, o_f, m_f, stride_w):
    """W_enc[o_k, o_f] ([BLOCK_K, BLOCK_F])."""
    return tl.load(p_wenc + o_k[:, None].to(tl.int64) * stride_w + o_f[None, :], mask=m_k[:, None] & m_f[None, :],
                   other=0.0)


@triton.jit
def _encode_step(acc, src, i_t, hl, p_wenc, o_m, m_m, o_f, m_f, k0, k_hi, stride_w, BLOCK_M: tl.constexpr,
                 BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE: tl.constexpr, UPCAST: tl.constexpr,
                 DIRECT: tl.constexpr, HAS_RES: tl.constexpr, UNROLL: tl.constexpr, HILO: tl.constexpr):
    """acc + the UNROLL K tiles from k0, each its own ``_tile_dot`` added in K order. HILO: the stream's hi / lo
    planes (``_hilo``) read as they are, multiplied in ``_tile_dot``'s order (lo first): the same sums."""
    for u in tl.static_range(UNROLL):
        o_k = k0 + u * BLOCK_K + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        if HILO:
            w = _w_tile(p_wenc, o_k, m_k, o_f, m_f, stride_w)
            p_hl, stride_hl, stride_plane = hl
            p_a = p_hl + o_m[:, None].to(tl.int64) * stride_hl + o_k[None, :]
            m_a = m_m[:, None] & m_k[None, :]
            t = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
            if PRECISE:
                t = _dot(tl.load(p_a + stride_plane, mask=m_a, other=0.0), w, t, UPCAST)
            acc += _dot(tl.load(p_a, mask=m_a, other=0.0), w, t, UPCAST)
        else:
            a = _stream_at(src, i_t, o_m, m_m, o_k, m_k, DIRECT, HAS_RES)  # issued before W_enc's tile
            w = _w_tile(p_wenc, o_k, m_k, o_f, m_f, stride_w)
            acc += _tile_dot(a, w, PRECISE, UPCAST, BLOCK_M, BLOCK_F)
    return acc


@triton.jit
def _encode_loop(acc, src, i_t, hl, p_wenc, o_m, m_m, o_f, m_f, k_lo, k_hi, stride_w, BLOCK_M: tl.constexpr,
                 BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE: tl.constexpr, UPCAST: tl.constexpr,
                 DIRECT: tl.constexpr, HAS_RES: tl.constexpr, UNROLL: tl.constexpr, HILO: tl.constexpr):
    """acc + S[o_m, k_lo:k_hi] @ W_enc[k_lo:k_hi, o_f], K tile by K tile in order."""
    for k0 in range(k_lo, k_hi, BLOCK_K * UNROLL):
        acc = _encode_step(acc, src, i_t, hl, p_wenc, o_m, m_m, o_f, m_f, k0, k_hi, stride_w, BLOCK_M, BLOCK_F, BLOCK_K,
                           PRECISE, UPCAST, DIRECT, HAS_RES, UNROLL, HILO)
    return acc


@triton.jit
def _encode(src, p_count, p_wenc, p_benc, p_pre, r0, stride_w, stride_pre, F, stride_split, hl, p_index, p_mode, N,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
            ROUND_N: tl.constexpr, PRECISE: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr,
            HAS_RES: tl.constexpr, UNROLL: tl.constexpr, SPLIT_K: tl.constexpr = 1, K_SPLIT: tl.constexpr = 0,
            HILO: tl.constexpr = False, COMPACT: tl.constexpr = False):
    """pre[j, f] = S[j] . W_enc[:, f] + b_enc[f] for the round's listed tokens; a program per tile of BLOCK_M listed
    tokens x BLOCK_F features (token tiles on grid axis 0, launched first: the tiles sharing W_enc's columns run
    together, so W_enc leaves HBM about once per round). A tile past the count returns at once. UNROLL K tiles a
    loop step (a small grid: twice the W_enc bytes in flight a program), each still its own ``_tile_dot`` added in
    K order: the same arithmetic as one a step.

    Variants (``Tuning``; the defaults are the engine's): HILO (``_encode_step``), SPLIT_K (grid axis 2: split s sums
    K in [s K_SPLIT, (s + 1) K_SPLIT); its partial goes to ``pre + s stride_split`` and ``_select`` adds the splits in
    order and the bias). ``hl``: (hi / lo planes, row stride, plane stride) for HILO.

    COMPACT (slot A, one round of at most ``_COMPACT_N`` tokens, not HILO): no ``_compact`` launch before it;
    every program lists the on tokens of index[0:N] itself (``_compact_tile``) and the first stores the list and the
    count for the kernels after it: one launch fewer a site, idle or not."""
    m0 = tl.program_id(0) * BLOCK_M
    if COMPACT:
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
        n, i_t = _compact_tile(p_index, p_mode, src[6], p_count, N, m0, BLOCK_M, first)
        n = tl.minimum(n, ROUND_N)
    else:
        n = tl.minimum(tl.load(p_count) - r0, ROUND_N)
    if m0 < n:
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < n
        if not COMPACT:
            i_t = _listed_tokens(src, o_m, m_m, DIRECT)
        o_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        m_f = o_f < F
        acc = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        if SPLIT_K == 1:
            acc = _encode_loop(acc, src, i_t, hl, p_wenc, o_m, m_m, o_f, m_f, 0, D, stride_w, BLOCK_M, BLOCK_F, BLOCK_K,
                               PRECISE, UPCAST, DIRECT, HAS_RES, UNROLL, HILO)
            b_bias = tl.load(p_benc + o_f, mask=m_f, other=0.0)
            tl.store(p_pre + o_m[:, None].to(tl.int64) * stride_pre + o_f[None, :], acc + b_bias[None, :],
                     mask=m_m[:, None] & m_f[None, :])
        else:
            i_s = tl.program_id(2)
            k_lo = i_s * K_SPLIT
            acc = _encode_loop(acc, src, i_t, hl, p_wenc, o_m, m_m, o_f, m_f, k_lo, tl.minimum(k_lo + K_SPLIT, D),
                               stride_w, BLOCK_M, BLOCK_F, BLOCK_K, PRECISE, UPCAST, DIRECT, HAS_RES, UNROLL, HILO)
            p_out = p_pre + o_m[:, None].to(tl.int64) * stride_pre + o_f[None, :]
            tl.store(p_out + i_s.to(tl.int64) * stride_split, acc, mask=m_m[:, None] & m_f[None, :])


@triton.jit
def _key(v):
    """An int32 that orders as ``relu(v)`` (float32): the bits of v where v > 0 (positive floats order as their bits),
    else 0. TopK's activation is relu of the k largest, so ranking relu(pre) keeps the same activations: a feature
    that ties at 0 or sits below it activates to 0 either way."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.maximum(bits, 0)


@triton.jit
def _act(v, thr_key, thr, TOPK: tl.constexpr):
    """The activation of pre ``v``: TopK: relu(v) if its key is among the k largest (>= thr_key); else
    v * (v > thr)."""
    if TOPK:
        return tl.where(_key(v) >= thr_key, tl.maximum(v, 0.0), 0.0)
    else:
        return tl.where(v > thr, v, 0.0)


@triton.jit
def _search_step(thr_key, b, cnt, K):
    """One bit of the K-th largest key's search: keep bit b if at least K keys reach ``thr_key | 1 << b`` (their
    count ``cnt``); done (b = -1) when exactly K do, as no lower bit can change which keys reach the threshold."""
    thr_key = tl.where(cnt >= K, thr_key | (1 << b), thr_key)
    return thr_key, tl.where(cnt == K, -1, b - 1)


@triton.jit
def _sum_partials(p_row, p_benc, o, m, stride_split, SPLIT: tl.constexpr):
    """pre at offsets ``o`` (mask ``m``): its SPLIT partial sums (``stride_split`` apart) added in split order, then
    b_enc, written over the first; returned."""
    b_v = tl.load(p_row + o, mask=m, other=0.0)
    for i_s in tl.static_range(1, SPLIT):
        b_v += tl.load(p_row + i_s * stride_split + o, mask=m, other=0.0)
    b_v += tl.load(p_benc + o, mask=m, other=0.0)
    tl.store(p_row + o, b_v, mask=m)
    return b_v


@triton.jit
def _activate(p_row, p_thr, o, m, thr_key, TOPK: tl.constexpr):
    """pre at offsets ``o`` (mask ``m``) replaced by its activations (``_act``)."""
    b_f = _act(tl.load(p_row + o, mask=m, other=0.0), thr_key, tl.load(p_thr + o, mask=m, other=0.0), TOPK)
    tl.store(p_row + o, b_f, mask=m)


@triton.jit
def _select(p_pre, p_tok, p_count, p_index, p_mode, p_code, p_value, p_feat, p_thr, p_cv, r0,
            stride_pre, stride_code, stride_value, stride_cv, F, C, K, p_benc, stride_split,
            TOPK: tl.constexpr, SINGLE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
            GROUPS: tl.constexpr, SPLIT: tl.constexpr = 1):
    """Listed token r0 + j: its activations from pre, its row's clamps, and the decode coefficients: RECONSTRUCT
    rows' written over pre (f with clamped features f'); a DELTA row's coefficients (f' - f at the clamped features)
    go to ``cv`` only (``_decode`` multiplies them with the clampable features' W_dec rows and reads no DELTA row's
    pre). ``cv``: the clamped features' coefficients, staged while pre is still whole. SINGLE: F <= BLOCK, the row
    in registers (as GROUPS groups of BLOCK / GROUPS features).

    TopK: the K-th largest key T (``_key``: relu's order, int32), bit by bit from bit 30 (the sign bit of every key
    is 0), stopping once exactly K keys reach the threshold. SINGLE: T lies in [lo, hi], hi the largest key and lo
    the smallest of the groups' largest (K or more groups: K distinct keys reach it), so a candidate <= lo is kept
    and one > hi dropped without counting; only the bits that split [lo, hi] cost a pass over the row (with
    continuous activations ~10 of the 31). One int32 count a pass: the passes are latency-bound, so two bits a step
    (three counts in one int64 reduction, 6.0 passes instead of 10.3 on a numpy model) was slower on an H200 (s31,
    ``_select`` 16.3 -> 22.3 µs at N 16).

    SPLIT (``Tuning.split_k``: ``_encode`` split over K): pre is the first of SPLIT partial sums ``stride_split``
    apart; they are added in split order with b_enc and written to pre before anything reads it."""
    j = tl.program_id(0)
    if r0 + j < tl.load(p_count):
        p_row = p_pre + j.to(tl.int64) * stride_pre
        o = tl.arange(0, GROUPS)[:, None] * (BLOCK // GROUPS) + tl.arange(0, BLOCK // GROUPS)[None, :]
        if SPLIT > 1:
            if SINGLE:
                b_v = _sum_partials(p_row, p_benc, o, o < F, stride_split, SPLIT)
            else:
                o_1 = tl.arange(0, BLOCK)
                for f0 in range(0, F, BLOCK):
                    _sum_partials(p_row, p_benc, f0 + o_1, f0 + o_1 < F, stride_split, SPLIT)
            tl.debug_barrier()  # the whole row is summed before any program thread reads it back
            if TOPK and SINGLE:
                b_key = tl.where(o < F, _key(b_v), -1)
        elif TOPK and SINGLE:  # issued before the token's row lookups (a chain of three dependent loads)
            b_key = tl.where(o < F, _key(tl.load(p_row + o, mask=o < F, other=0.0)), -1)
        i_t = tl.load(p_tok + r0 + j).to(tl.int64)
        i_r = tl.load(p_index + i_t).to(tl.int64)
        recon = tl.load(p_mode + i_r) == _RECON
        thr_key = tl.zeros((), dtype=tl.int32)
        if TOPK:  # the largest key T with #(key >= T) >= K: the K-th largest
            b = tl.full((), 30, tl.int32)
            if SINGLE:
                hi = tl.max(tl.max(b_key, axis=1), axis=0)
                g_max = tl.max(b_key, axis=1)  # a group past F: -1
                lo = tl.min(tl.where(g_max >= 0, g_max, hi), axis=0)
                lo = tl.where(tl.sum((g_max >= 0).to(tl.int32), axis=0) >= K, lo, 0)
                while b >= 0:
                    cand = thr_key | (1 << b)
                    cnt = tl.where(cand <= lo, K + 1, 0)  # <= lo: reached by >= K keys (K + 1: not exactly K)
                    if cand > lo:
                        if cand <= hi:
                            cnt = tl.sum(tl.sum((b_key >= cand).to(tl.int32), axis=1), axis=0)
                    thr_key, b = _search_step(thr_key, b, cnt, K)
            else:
                o_1 = tl.arange(0, BLOCK)
                while b >= 0:
                    cand = thr_key | (1 << b)
                    cnt = 0
                    for f0 in range(0, F, BLOCK):
                        v = tl.load(p_row + f0 + o_1, mask=f0 + o_1 < F, other=0.0)
                        cnt += tl.sum(((_key(v) >= cand) & (f0 + o_1 < F)).to(tl.int32), axis=0)
                    thr_key, b = _search_step(thr_key, b, cnt, K)
        o_c = tl.arange(0, BLOCK_C)
        for c0 in range(0, C, BLOCK_C):  # the row's clamped features, from pre as it is
            m_c = c0 + o_c < C
            code = tl.load(p_code + i_r * stride_code + c0 + o_c, mask=m_c, other=0)
            feat = tl.load(p_feat + c0 + o_c, mask=m_c, other=0)
            v = tl.load(p_row + feat, mask=m_c, other=0.0)
            f = _act(v, thr_key, tl.load(p_thr + feat, mask=m_c, other=0.0), TOPK)
            val = tl.load(p_value + i_r * stride_value + c0 + o_c, mask=m_c, other=0.0)
            kind = code & 3
            new = tl.where(kind == 1, val, tl.where(kind == 2, f + val, tl.where(kind == 3, f * val, f)))
            f_new = tl.where((kind != 0) & (((code & 4) == 0) | (f > 0)), new, f)
            tl.store(p_cv + j.to(tl.int64) * stride_cv + c0 + o_c, tl.where(recon, f_new, f_new - f), mask=m_c)
        if recon:  # a DELTA row's pre is not read again: left as it is
            tl.debug_barrier()  # every clamped feature's pre is read before the coefficients overwrite it
            if SINGLE and TOPK:  # relu(pre) of the K largest: the key's own bits
                tl.store(p_row + o, tl.where(b_key >= thr_key, b_key.to(tl.float32, bitcast=True), 0.0), mask=o < F)
            elif SINGLE:
                _activate(p_row, p_thr, o, o < F, thr_key, TOPK)
            else:
                o_1 = tl.arange(0, BLOCK)
                for f0 in range(0, F, BLOCK):
                    _activate(p_row, p_thr, f0 + o_1, f0 + o_1 < F, thr_key, TOPK)
            tl.debug_barrier()
            for c0 in range(0, C, BLOCK_C):
                m_c = c0 + o_c < C
                code = tl.load(p_code + i_r * stride_code + c0 + o_c, mask=m_c, other=0)
                feat = tl.load(p_feat + c0 + o_c, mask=m_c, other=0)
                cv = tl.load(p_cv + j.to(tl.int64) * stride_cv + c0 + o_c, mask=m_c, other=0.0)
                tl.store(p_row + feat, cv, mask=m_c & ((code & 3) != 0))


@triton.jit
def _decode_span(acc, p_c, stride_c, rows, lo, hi, p_w, stride_w, p_feat, o_m, o_d, m_d, BLOCK_F: tl.constexpr,
                 GATHER: tl.constexpr, SKIP: tl.constexpr, PRECISE: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """acc + ``c[rows, lo:hi] @ w[feature lo:hi, o_d]``, BLOCK_F features (a K tile) at a time, each tile's product
    in a fresh float32 accumulator (``_tile_dot``: the float32 coefficients' bf16 hi + lo against the weights) added
    to ``acc`` in IEEE float32. GATHER: feature i's row of ``w`` is ``feat[i]`` (the clamped features' W_dec rows),
    else i. SKIP (a few tokens a round, whose coefficient tiles are mostly 0 with sparse activations): a ``w`` tile
    whose coefficients are all 0 for the tile's rows is masked off (its load moves no bytes, its product adds 0);
    else every tile is read (no reduction between a coefficient load and the weights' load: a plain GEMM loop that
    Triton's pipeliner streams). No branch in the loop either way."""
    for f0 in range(lo, hi, BLOCK_F):
        o_f = f0 + tl.arange(0, BLOCK_F)
        m_f = o_f < hi
        c = tl.load(p_c + o_m[:, None].to(tl.int64) * stride_c + o_f[None, :],
                    mask=rows[:, None] & m_f[None, :], other=0.0)
        if GATHER:
            i_w = tl.load(p_feat + o_f, mask=m_f, other=0)
        else:
            i_w = o_f
        m_w = m_f[:, None] & m_d[None, :]
        if SKIP:
            m_w = tl.where(tl.max(tl.max(tl.abs(c), axis=1), axis=0) != 0.0, m_w, False)
        w = tl.load(p_w + i_w[:, None].to(tl.int64) * stride_w + o_d[None, :], mask=m_w, other=0.0)
        acc += _tile_dot(c, w, PRECISE, UPCAST, BLOCK_M, BLOCK_D)
    return acc


@triton.jit
def _decode(p_coef, src, p_tok, p_count, p_index, p_mode, p_wdec, p_bdec, p_out, r0,
            stride_coef, stride_w, stride_out, stride_split, F, F_SPLIT, p_cv, p_feat, stride_cv, C, C_SPLIT,
            p_part, stride_part, p_arrived,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
            ROUND_N: tl.constexpr, PRECISE: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr,
            HAS_RES: tl.constexpr, SPLIT: tl.constexpr, SKIP: tl.constexpr):
    """A tile of BLOCK_M listed tokens x BLOCK_D columns, split s = program_id(2) of the features: RECONSTRUCT rows'
    ``coef @ W_dec`` over features [s F_SPLIT, (s + 1) F_SPLIT) (only if the tile has such a row; a W_dec tile
    whose coefficients are all 0 for the tile's tokens is not read), plus DELTA rows' ``cv @ W_dec[feat]`` over
    clamped features [s C_SPLIT, (s + 1) C_SPLIT): the clampable features' rows of W_dec, gathered by feature id
    (``dec`` holds the same values in float32: the pack derives it from the rounded W_dec), on tensor cores as
    RECONSTRUCT's. One split: the edit itself (``_finish``). SPLIT > 1: split s's partial sum to ``part``
    [SPLIT, ROUND, D]; the tile's programs count themselves in ``arrived`` (one int32 a tile, 0 between launches)
    and the last to arrive adds the SPLIT partials in split order (the same sum whichever is last), finishes the
    edit and sets the count back to 0 (the steered norm's split SAE walk does the same)."""
    m0 = tl.program_id(0) * BLOCK_M
    n = tl.minimum(tl.load(p_count) - r0, ROUND_N)
    if m0 < n:
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < n
        o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        i_t = tl.load(p_tok + r0 + o_m, mask=m_m, other=0).to(tl.int64)
        row_mode = tl.load(p_mode + tl.load(p_index + i_t, mask=m_m, other=0), mask=m_m, other=0)
        recon = m_m & (row_mode == _RECON)
        delta = m_m & (row_mode != _RECON)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        if tl.max(recon.to(tl.int32), axis=0) != 0:
            f_lo = tl.program_id(2) * F_SPLIT
            acc = _decode_span(acc, p_coef, stride_coef, recon, f_lo, tl.minimum(F, f_lo + F_SPLIT), p_wdec, stride_w,
                               p_feat, o_m, o_d, m_d, BLOCK_F, False, SKIP, PRECISE, UPCAST, BLOCK_M, BLOCK_D)
        if tl.max(delta.to(tl.int32), axis=0) != 0:
            c_lo = tl.program_id(2) * C_SPLIT
            acc = _decode_span(acc, p_cv, stride_cv, delta, c_lo, tl.minimum(C, c_lo + C_SPLIT), p_wdec, stride_w,
                               p_feat, o_m, o_d, m_d, BLOCK_F, True, SKIP, PRECISE, UPCAST, BLOCK_M, BLOCK_D)
        if SPLIT == 1:
            _finish(acc, src, p_tok, p_index, p_mode, p_bdec, p_out, r0, stride_out, o_m, m_m, o_d, m_d, DIRECT,
                    HAS_RES)
        else:
            p_tile = p_part + o_m[:, None].to(tl.int64) * stride_part + o_d[None, :]
            m_t = m_m[:, None] & m_d[None, :]
            tl.store(p_tile + tl.program_id(2).to(tl.int64) * stride_split, acc, mask=m_t)
            tl.debug_barrier()  # every thread's part is stored before the count says so
            p_mine = p_arrived + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(p_mine, 1, sem="acq_rel") == SPLIT - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
                for i in tl.static_range(SPLIT):
                    acc += tl.load(p_tile + i * stride_split, mask=m_t, other=0.0, cache_modifier=".cg")
                _finish(acc, src, p_tok, p_index, p_mode, p_bdec, p_out, r0, stride_out, o_m, m_m, o_d, m_d, DIRECT,
                        HAS_RES)
                tl.atomic_xchg(p_mine, 0)  # ready for the next launch (graph replays included)


@triton.jit
def _finish(acc, src, p_tok, p_index, p_mode, p_bdec, p_edit, r0, stride_edit, o_m, m_m, o_d, m_d,
            DIRECT: tl.constexpr, HAS_RES: tl.constexpr):
    """edit[t] = acc (+ b_dec - S[j] for a RECONSTRUCT row) for listed tokens ``o_m`` of the round."""
    i_t = tl.load(p_tok + r0 + o_m, mask=m_m, other=0).to(tl.int64)
    i_r = tl.load(p_index + i_t, mask=m_m, other=0)
    recon = tl.load(p_mode + i_r, mask=m_m, other=0) == _RECON
    b_s = _stream(src, o_m, m_m, o_d, m_d, DIRECT, HAS_RES)
    b_dec = tl.load(p_bdec + o_d, mask=m_d, other=0.0)
    e = tl.where(recon[:, None], acc + b_dec[None, :] - b_s, acc)
    tl.store(p_edit + i_t[:, None] * stride_edit + o_d[None, :], e, mask=m_m[:, None] & m_d[None, :])


# Tiles by N (the step's token count: fixed per CUDA graph): (BLOCK_M, BLOCK_F / BLOCK_D, BLOCK_K / BLOCK_F, warps)
# for the encoder and the decoder. Decode sizes stream the weights (bandwidth-bound: many small programs); prefill
# sizes are tensor-core bound (128 x 128 tiles).
_TILES = ((64, (16, 64, 64, 4)), (512, (64, 128, 64, 4)), (None, (128, 128, 64, 8)))
_PROGRAMS = 528  # programs the decoder aims at (4 per SM of an H100's 132): splits over d_sae fill the GPU at decode
_SPLIT_MAX = 16
# the encoder's warps at the 16-token tile (N <= 64): s29's H100 sweep (bench/results/2026-11-28-s29, topk_sweep) timed
# the TopK site at N 1 / 16 / 64: 74.5 / 81.3 / 179.8 µs with 4 warps, 71.1 / 77.6 / 126.2 with 2 (W_enc's read 40 µs)
_ENC_WARPS_SMALL = 2
# _select's warps at every d_sae: s31's H200 sweep (bench/results/2026-11-28-s31/fin, topk_sweep; d_sae 16384, k 64)
# timed _select at N 1 / 16 / 64: 10.69 / 16.36 / 16.68 µs with 16 warps (the choice from d_sae 8192 until s31),
# 9.61 / 14.84 / 15.02 with 8
_SELECT_WARPS = 8
_ENC_UNROLL = 2  # K tiles a step of the encoder's loop when its grid is under _PROGRAMS (N 16: 256 programs)
_SKIP_TOKENS = 4  # rounds of up to this many tokens: the decoder skips W_dec tiles whose coefficients are all 0
_ARRIVED = 1 << 16  # decoder tiles a launch can count in (``arrival_counts``): 64 token tiles x 1024 column tiles


def _tiles(n: int, wide: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) for N tokens; ``wide``: a float32 stream (a float32 model), whose 128-token
    tiles' pipelined stages need more shared memory than an H100 / H200 has (360 KB of 227): the 64-token tile."""
    t = next(t for limit, t in _TILES if limit is None or n <= limit)
    return _TILES[1][1] if wide and t[0] > _TILES[1][1][0] else t


def _splits(rn: int, d: int, f: int, c: int, bm: int, bd: int, bf: int,
            most: int = _SPLIT_MAX) -> tuple[int, int, int]:
    """(splits, features per split, clamped features per split) of the decoder for rounds of ``rn`` listed tokens:
    enough programs to fill the GPU (``_PROGRAMS``), at most ``most``, each split a multiple of BLOCK_F features (of
    d_sae, and of the ``c`` clampable ones)."""
    tiles = cdiv(rn, bm) * cdiv(d, bd)
    split = max(1, min(most, _PROGRAMS // tiles, cdiv(f, bf)))
    per = cdiv(cdiv(f, split), bf) * bf
    split = cdiv(f, per)
    return split, per, cdiv(cdiv(c, split), bf) * bf


@dataclass(frozen=True)
class Tuning:
    """The encoder's launch variants, for ``bench/sae_kernel_bench.py --topk-sweep`` (issue 39: TopK k 64 at N 16 is
    bound by W_enc's read); the defaults (0 / 1 / False) are the engine's choices.

    block_f / block_k / warps: the encoder's tile and warps (0: ``_tiles``'); unroll: K tiles a loop step (0:
    ``_ENC_UNROLL`` under ``_PROGRAMS`` programs, else 1); split_k: the encoder's K split over that many programs
    (float32 partial sums, added by ``_select`` in split order); stages: the encoder launch's ``num_stages`` (0:
    Triton's default); hilo: the stream split into hi / lo planes once (``_hilo``, one launch more), read by the
    encoder as dot operands; select_warps: ``_select``'s warps (0: ``_SELECT_WARPS``)."""

    block_f: int = 0
    block_k: int = 0
    warps: int = 0
    unroll: int = 0
    split_k: int = 1
    stages: int = 0
    hilo: bool = False
    select_warps: int = 0


DEFAULT = Tuning()


def site_edit(
    x: torch.Tensor,  # [N, D]
    residual: torch.Tensor | None,  # [N, D]
    index: torch.Tensor,  # [>= N] int32
    pack: Sequence[torch.Tensor],  # a full pack (packed.py, N_FULL tensors; w_enc / w_dec bf16)
    topk: int,  # TopK's k, 0: the pack's thresholds
    prefix: dict | None = None,  # slot B / a transcoder: slot A's descriptors as the norm kernel takes them
    precise: bool = True,
    tuning: Tuning = DEFAULT,  # the bench's launch variants
) -> torch.Tensor:
    """The on tokens' move at a full slot, ``edit`` [N, D] float32: row t holds ``clamped(s)[t] - s[t]`` for a
    token whose row is on and is not written for any other (the norm reads it only for those). ``prefix`` (slot
    B): ``vec`` (table, flag, stride), ``sae`` (a clamp-only descriptor), ``proj``, ``full`` (slot A's edit
    descriptor), ``cond`` (the norm's condition descriptor): slot A's features, applied before the encoder;
    ``norm`` (weight, eps, weight_offset): a full transcoder pack, its input the norm's output of that stream (every
    row DELTA: the edit is ``sum (f' - f) W_dec``, the MLP output's, which the norm adds to the residual)."""
    n, d = x.shape
    mode, code, value = pack[0], pack[1], pack[2]
    feats, w_enc, b_enc, thr_f, w_dec, b_dec = pack[7], pack[8], pack[9], pack[10], pack[11], pack[12]
    f_all, c = w_enc.shape[1], code.shape[1]
    assert w_enc.stride(-1) == 1 and w_dec.stride(-1) == 1 and code.stride(-1) == 1 and value.stride(-1) == 1
    dev = x.device
    edit = torch.empty(n, d, dtype=torch.float32, device=dev)
    if n == 0:
        return edit
    rn = min(n, ROUND)
    tok = torch.empty(n, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    p = prefix or {}
    pre_flags = tuple(bool(p.get(k)) for k in ("vec", "sae", "proj", "full", "cond"))
    norm = p.get("norm", ())
    direct = not any(pre_flags) and not norm  # slot A: the stream is x + residual, read by the GEMMs themselves
    s = torch.empty(1 if direct else rn, d, dtype=torch.float32, device=dev)  # gathered streams
    bm, bn, bk, warps = _tiles(n, x.element_size() > 2)
    t = tuning
    e_bn, e_bk = t.block_f or bn, t.block_k or bk
    e_warps = t.warps or (_ENC_WARPS_SMALL if bm == _TILES[0][1][0] else warps)
    m_tiles, e_tiles = cdiv(rn, bm), cdiv(f_all, e_bn)
    unroll = t.unroll or (_ENC_UNROLL if m_tiles * e_tiles * t.split_k < _PROGRAMS else 1)
    k_split = cdiv(cdiv(d, t.split_k), e_bk * unroll) * e_bk * unroll
    split_k = cdiv(d, k_split)  # 1 unless tuned
    # split over K: [split_k, rn, F] partial sums (pre the first), summed by _select
    pre_all = torch.empty(split_k, rn, f_all, dtype=torch.float32, device=dev)
    pre = pre_all[0]
    hl = torch.empty(2, rn, d, dtype=w_enc.dtype, device=dev) if t.hilo else pre
    cv = torch.empty(rn, max(c, 1), dtype=torch.float32, device=dev)
    # the splits' arrival counts (None while a graph is captured before they were made): else one split
    arrived = arrival_counts(dev)
    split, f_split, c_split = _splits(rn, d, f_all, c, bm, bn, bk, _SPLIT_MAX if arrived is not None else 1)
    part = torch.empty(split, rn, d, dtype=torch.float32, device=dev) if split > 1 else edit
    # slot A's one round of few tokens: the encoder lists the on tokens itself (COMPACT), else a _compact launch
    # (HILO's split launch before the encoder reads the list)
    fused = direct and n <= _COMPACT_N and not t.hilo
    if not fused:
        _COMPACT((1,), (index, mode, tok, count, n), (1024,), 4)
    block_d = next_power_of_2(d)
    single = f_all <= _SELECT_MAX
    block_sel = next_power_of_2(f_all) if single else _SELECT_CHUNK
    res = residual if residual is not None else x
    res_stride = residual.stride(0) if residual is not None else 0
    for r0 in range(0, n, ROUND):
        if not direct:
            _GATHER((rn,), (x, res, index, tok, count, s, r0, x.stride(0), res_stride, s.stride(0),
                            *(p.get(k, ()) for k in ("vec", "sae", "proj", "full", "cond")), tuple(norm)),
                    (d, block_d, residual is not None, *pre_flags, bool(norm), bool(norm) and norm[2] != 0.0),
                    # NORM: the norm kernel's warps, so the sum of squares reduces in its order (the same output)
                    _num_warps(block_d) if norm else 4 if block_d <= 1024 else 8)
        src = (s, s.stride(0), x, res, x.stride(0), res_stride, tok[r0:])
        flags = (ROUND, precise, _UPCAST, direct, residual is not None)
        enc_flags = (d, bm, e_bn, e_bk, *flags, unroll)
        if t != DEFAULT or fused:
            enc_flags += (split_k, k_split, t.hilo, fused)
        if t.hilo:
            _HILO((rn, cdiv(d, 1024)), (src, count, hl, r0, hl.stride(1), hl.stride(0)),
                  (d, 1024, ROUND, direct, residual is not None), 4)
        _ENCODE((m_tiles, e_tiles, split_k), (src, count, w_enc, b_enc, pre, r0, w_enc.stride(0),
                                              pre.stride(0), f_all, pre_all.stride(0),
                                              (hl, hl.stride(-2), hl.stride(0) if t.hilo else 0), index, mode, n),
                enc_flags, e_warps, t.stages or None)
        sel_flags = (topk > 0, single, block_sel, min(next_power_of_2(max(c, 1)), _SELECT_C),
                     min(_GROUPS, block_sel))
        if t != DEFAULT:
            sel_flags += (split_k,)
        _SELECT((rn,), (pre, tok, count, index, mode, code, value, feats, thr_f, cv, r0, pre.stride(0), code.stride(0),
                        value.stride(0), cv.stride(0), f_all, c, topk, b_enc, pre_all.stride(0)),
                sel_flags, t.select_warps or _SELECT_WARPS)
        d_tiles = cdiv(d, bn)
        assert m_tiles * d_tiles <= _ARRIVED, (m_tiles, d_tiles)
        _DECODE((m_tiles, d_tiles, split),
                (pre, src, tok, count, index, mode, w_dec, b_dec, edit, r0, pre.stride(0), w_dec.stride(0),
                 edit.stride(0), part.stride(0) if split > 1 else 0, f_all, f_split, cv, feats, cv.stride(0), c,
                 c_split, part, part.stride(1) if split > 1 else 0, arrived if split > 1 else count),
                (d, bm, bk, bn, *flags, split, rn <= _SKIP_TOKENS), warps)
    return edit


_ARRIVED_BY_DEVICE: dict = {}


def arrival_counts(device: torch.device) -> torch.Tensor | None:
    """The decoder's per-tile arrival counts on ``device`` (zeros between launches: the last program of a tile resets
    its own), made on first use outside a CUDA-graph capture (``runtime.sae_tables`` makes them when it stages a
    pack, as the norm's ``split_buffers``); None while capturing before that (the decoder then runs unsplit)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t = _ARRIVED_BY_DEVICE.get(device)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        t = _ARRIVED_BY_DEVICE[device] = torch.zeros(_ARRIVED, dtype=torch.int32, device=device)
    return t


# launched without Triton's per-call binding (steps above the CUDA-graph sizes launch from Python: ../launch_cache.py)
_COMPACT, _GATHER, _HILO, _ENCODE, _SELECT, _DECODE = (
    CachedLauncher(k) for k in (_compact, _gather, _hilo, _encode, _select, _decode))
