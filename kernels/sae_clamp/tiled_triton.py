"""Clamp-only SAE packs (ReLU / JumpReLU, delta) at prefill sizes on CUDA: each on token's move at one slot,
``edit[t] = sum_c (f'_c - f_c) dec[c]`` (``packed.clamp_delta_naive``), computed per tile of tokens that share a
row, so the row's clamped encoder columns and decoder rows are read once per tile (the norm's walk,
``../steered_rms_norm/triton.py``, reads them once per token: it keeps decode sizes). The steered norm adds
``w * edit[t]`` where the slot's clamps go, as it adds a full pack's edit (``FULL_A`` / ``FULL_B``, ``_add_edit``);
``tiled_slots`` turns a norm's clamp-only slots into those edits.

Launches (no host sync, no data-dependent shape: a CUDA graph replays them with rows changed after capture):

- ``_gather_on`` (slot B when anything comes before it): the float32 stream at slot B of each on token (x +
  residual, then slot A's edit, projections and vectors with the gate's weights: ``full_triton._slot_stream``);
- ``_tile_clamps``: grid (blocks of T tokens, T), fixed by N. A tile is a run of consecutive tokens with one row
  inside a block (tokens of one prompt are contiguous; blocks cut a long prompt into tiles of T): program (b, j)
  takes the j-th run of block b, found from the block's T rows (a cumsum of run starts); a program whose block
  has no j-th run exits after those loads, as does a tile whose row is 0 or OFF (its edit is not written: the
  norm does not read it). Blocks are grid axis 0, so every block's first run (a prefill step's work) is launched
  before the programs that exit. The working program walks the row's codes CB at a time and gathers the clamped
  slots' ids into a dense block of CB (a one-hot reduction in registers); each full block (and the last) is one
  step: ``pre [T, CB] = S [T, D] @ enc[ids].T`` (``tl.dot`` over D by BK), ``f = pre * (pre > thr)``, the clamp
  gives ``f'``, then per BK columns ``edit [T, BK] += (f' - f) [T, CB] @ dec[ids] [CB, BK]``. A row without codes
  writes zeros (its tokens come back bit for bit). Every f is taken from the stream before this slot's clamps, as
  in the walk.

Dots: ``PRECISION`` (float32 operands): "tf32x3" (three TF32 tensor-core products, ~float32 accuracy) on CUDA;
the interpreter computes float32 products.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vllm_steer.kernels.host_math import cdiv, next_power_of_2
from vllm_steer.kernels.launch_cache import CachedLauncher
from vllm_steer.kernels.sae_clamp.full_triton import _slot_stream
from vllm_steer.kernels.steered_rms_norm.triton import _proj_desc

PRECISION = "tf32x3"
CB = 64  # clamped slots a step (the dense block of ids; the dots' inner size for the decoder)
# hidden columns a step of both dots. Compiled for sm_90 (ptxas -v; tf32x3 runs as mma.sync): BK 64 spills 0.9-3.5
# KB a thread at 255 registers; BK 32 with 4 warps at T 16, 8 at T 32 / 64 spills 0 / 36 / 192 bytes
BK = 32


def tile_tokens(n: int) -> int:
    """Tokens a tile (T) for a step of ``n`` tokens: about 64 tiles per step (one wave on an H100's 132 SMs with
    the runs' partial tiles), at least 16 (``tl.dot``'s smallest M), at most 64."""
    return min(64, max(16, next_power_of_2(cdiv(n, 64))))


@triton.jit
def _tile_step(p_x, p_res, o_t, m_t, ids, cnt, first, p_code_row, p_value_row, p_enc, p_dec, p_bias, p_thr, p_edit,
               stride_x, stride_res, stride_enc, stride_dec, stride_edit, D: tl.constexpr, T: tl.constexpr,
               CB: tl.constexpr, BK: tl.constexpr, HAS_RES: tl.constexpr, PRECISION: tl.constexpr):
    """One dense block of ``cnt`` clamped slots ``ids`` for the tile's tokens ``o_t`` (``m_t``): their pre-
    activations from the stream, their clamps, and ``(f' - f) @ dec[ids]`` added to the tile's edit (``first``:
    written, not added; ``cnt`` 0: zeros)."""
    o_j = tl.arange(0, CB)
    m_j = o_j < cnt
    i_c = ids.to(tl.int64)
    acc = tl.zeros((T, CB), dtype=tl.float32)
    if cnt > 0:
        for k0 in range(0, D, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < D
            m_a = m_t[:, None] & m_k[None, :]
            a = tl.load(p_x + o_t[:, None] * stride_x + o_k[None, :], mask=m_a, other=0.0).to(tl.float32)
            if HAS_RES:
                a += tl.load(p_res + o_t[:, None] * stride_res + o_k[None, :], mask=m_a, other=0.0).to(tl.float32)
            e = tl.load(p_enc + i_c[None, :] * stride_enc + o_k[:, None], mask=m_k[:, None] & m_j[None, :], other=0.0)
            acc = tl.dot(a, e, acc, input_precision=PRECISION)
    pre = acc + tl.load(p_bias + ids, mask=m_j, other=0.0)[None, :]
    f = tl.where(pre > tl.load(p_thr + ids, mask=m_j, other=0.0)[None, :], pre, 0.0)
    code = tl.load(p_code_row + ids, mask=m_j, other=0)[None, :]
    v = tl.load(p_value_row + ids, mask=m_j, other=0.0)[None, :]
    kind = code & 3
    new = tl.where(kind == 1, v, tl.where(kind == 2, f + v, tl.where(kind == 3, f * v, f)))
    f_new = tl.where(((code & 4) == 0) | (f > 0), new, f)
    coef = tl.where(m_t[:, None] & m_j[None, :], f_new - f, 0.0)
    tl.debug_barrier()  # the previous block's edit, stored by any of the program's threads, is visible to all
    for d0 in range(0, D, BK):
        o_d = d0 + tl.arange(0, BK)
        m_d = o_d < D
        w = tl.load(p_dec + i_c[:, None] * stride_dec + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
        m_e = m_t[:, None] & m_d[None, :]
        p_e = p_edit + o_t[:, None] * stride_edit + o_d[None, :]
        e = tl.load(p_e, mask=m_e & (first == 0), other=0.0)
        tl.store(p_e, tl.dot(coef, w, e, input_precision=PRECISION), mask=m_e)


@triton.jit
def _tile_clamps(p_x, p_res, p_index, p_mode, p_code, p_value, p_enc, p_dec, p_bias, p_thr, p_edit, N, C,
                 stride_x, stride_res, stride_code, stride_value, stride_enc, stride_dec, stride_edit,
                 D: tl.constexpr, T: tl.constexpr, CB: tl.constexpr, BK: tl.constexpr, HAS_RES: tl.constexpr,
                 PRECISION: tl.constexpr):
    """edit[t] for the tokens of run j = program_id(1) of block b = program_id(0) (tokens [b T, b T + T)), if the
    block has a j-th run of one row (module docstring)."""
    o_t = tl.program_id(0) * T + tl.arange(0, T)
    m_b = o_t < N
    rows = tl.load(p_index + o_t, mask=m_b, other=0)
    prev = tl.load(p_index + tl.maximum(o_t - 1, 0), mask=m_b & (o_t % T != 0), other=-1)
    run = tl.cumsum(((rows != prev) & m_b).to(tl.int32), axis=0) - 1  # each token's run in the block
    m_t = m_b & (run == tl.program_id(1))
    i_row = tl.max(tl.where(m_t, rows, -1), axis=0)  # -1: the block has no such run
    if i_row > 0:
        i_r = i_row.to(tl.int64)
        if tl.load(p_mode + i_r) != 0:
            o_l = o_t.to(tl.int64)
            p_code_row = p_code + i_r * stride_code
            p_value_row = p_value + i_r * stride_value
            o_j = tl.arange(0, CB)
            ids = tl.zeros((CB,), dtype=tl.int32)
            k = 0  # ids gathered in the block so far
            first = 1
            for c0 in range(0, C + CB, CB):  # one step past C: the last block (or a row without codes) is done
                o_c = c0 + o_j
                nz = (tl.load(p_code_row + o_c, mask=o_c < C, other=0) != 0).to(tl.int32)
                m = tl.sum(nz, axis=0)
                pos = k + tl.cumsum(nz, axis=0) - 1  # each clamped slot's place among the row's gathered ids
                hit = (nz[None, :] != 0) & (pos[None, :] == o_j[:, None])
                ids = tl.where((o_j >= k) & (o_j < k + m), tl.sum(tl.where(hit, o_c[None, :], 0), axis=1), ids)
                k += m
                if (k >= CB) | ((c0 >= C) & ((k > 0) | (first != 0))):
                    _tile_step(p_x, p_res, o_l, m_t, ids, tl.minimum(k, CB), first, p_code_row, p_value_row, p_enc,
                               p_dec, p_bias, p_thr, p_edit, stride_x, stride_res, stride_enc, stride_dec,
                               stride_edit, D, T, CB, BK, HAS_RES, PRECISION)
                    first = 0
                    hit = (nz[None, :] != 0) & (pos[None, :] - CB == o_j[:, None])  # the block's overflow
                    ids = tl.sum(tl.where(hit, o_c[None, :], 0), axis=1)
                    k = tl.maximum(k - CB, 0)


@triton.jit
def _gather_on(p_x, p_res, p_index, p_mode, p_s, stride_x, stride_res, stride_s, vec_a, sae_a, proj_a, full_a, cond,
               D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, PRE_VEC: tl.constexpr,
               PRE_PROJ: tl.constexpr, PRE_FULL: tl.constexpr, COND: tl.constexpr):
    """S[t] = token t's stream at slot B (``full_triton._slot_stream``) where slot B's row is on (else unwritten)."""
    i_t = tl.program_id(0).to(tl.int64)
    i_row = tl.load(p_index + i_t)
    if i_row != 0:
        if tl.load(p_mode + i_row) != 0:
            o_d = tl.arange(0, BLOCK_D)
            m_d = o_d < D
            b_s = _slot_stream(p_x, p_res, p_index, i_t, stride_x, stride_res, vec_a, sae_a, proj_a, full_a, cond,
                               o_d, m_d, HAS_RES, PRE_VEC, False, PRE_PROJ, PRE_FULL, COND)
            tl.store(p_s + i_t * stride_s + o_d, b_s, mask=m_d)


_TILE, _GATHER_ON = CachedLauncher(_tile_clamps), CachedLauncher(_gather_on)


def slot_edit(src: torch.Tensor, residual: torch.Tensor | None, index: torch.Tensor,
              pack: Sequence[torch.Tensor]) -> torch.Tensor:
    """edit [N, D] float32 of a clamp-only pack: the move of each token whose row is on, its features encoded from
    ``src`` (+ ``residual``); not written for other tokens (the norm does not read them)."""
    n, d = src.shape
    mode, code, value, enc, dec, bias, thr = pack[:7]
    assert enc.stride(-1) == 1 and dec.stride(-1) == 1 and code.stride(-1) == 1 and value.stride(-1) == 1
    edit = torch.empty(n, d, dtype=torch.float32, device=src.device)
    if n == 0:
        return edit
    res = residual if residual is not None else src
    t = tile_tokens(n)
    _TILE((cdiv(n, t), t),
          (src, res, index, mode, code, value, enc, dec, bias, thr, edit, n, code.shape[1], src.stride(0),
           res.stride(0), code.stride(0), value.stride(0), enc.stride(0), dec.stride(0), edit.stride(0)),
          (d, t, CB, BK, residual is not None, PRECISION), 4 if t <= 16 else 8)
    return edit


def tiled_slots(x: torch.Tensor, residual: torch.Tensor | None, index: torch.Tensor, vec_a: Sequence[torch.Tensor],
                sae_a: Sequence[torch.Tensor], sae_b: Sequence[torch.Tensor], cond: Sequence[torch.Tensor],
                gate: torch.Tensor | None, proj_a: Sequence[torch.Tensor], full_a: Sequence[torch.Tensor]) -> tuple:
    """(sae_a, full_a, sae_b, full_b) for the norm: each clamp-only slot's pack emptied and its ``(edit, mode)``
    given instead (slot A first: slot B is encoded from the stream after slot A's edit); ``full_a`` (slot A's full
    pack's edit, ``full_slot``) passes through."""
    full_b: tuple = ()
    if sae_a:
        full_a, sae_a = (slot_edit(x, residual, index, sae_a), sae_a[0]), []
    if sae_b:
        n, d = x.shape
        pre = {"vec": (vec_a[0], vec_a[1], vec_a[0].stride(0)) if vec_a else (),
               "proj": _proj_desc(proj_a, d),
               "full": (full_a[0], full_a[1], full_a[0].stride(0)) if full_a else (),
               "cond": (cond[0], cond[1], cond[2], gate, cond[3], cond[2].stride(0)) if cond else ()}
        src, res = x, residual
        if pre["vec"] or pre["proj"] or pre["full"]:  # else slot B's stream is x + residual (the gate: read only)
            src, res = torch.empty(n, d, dtype=torch.float32, device=x.device), None
            block_d = next_power_of_2(d)
            _GATHER_ON((n,), (x, residual if residual is not None else x, index, sae_b[0], src, x.stride(0),
                              residual.stride(0) if residual is not None else 0, src.stride(0), pre["vec"], (),
                              pre["proj"], pre["full"], pre["cond"]),
                       (d, block_d, residual is not None, *(bool(pre[k]) for k in ("vec", "proj", "full", "cond"))),
                       4 if block_d <= 1024 else 8)
        full_b, sae_b = (slot_edit(src, res, index, sae_b), sae_b[0]), []
    return sae_a, full_a, sae_b, full_b
