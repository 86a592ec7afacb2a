"""Plain-torch reference of the steered norm: the spec the Triton kernel is tested against, and the
implementation on CPU (and for full SAE packs on CUDA). Mirrors vLLM's native ``fused_add_rms_norm`` /
``rms_norm`` (vllm/ir/ops) on the steered stream.

One function, ``steered_norm_naive``, composes every feature a norm's two slots may have, each given by its
descriptor (a few tensors; empty / None: the feature is off), in the order written once in ``_staged``:
per slot, capture -> gate (at a row's probe site) -> SAE clamps -> projections -> vectors; then the norm; then a
transcoder's clamps (``transcoder_step``: encoded from the norm's output, added to the residual only)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A conditional row's ``cond_site`` word: its probe site's order in the low 16 bits, plus what its gate
# does not / does scale (``applies_to``); -1: no condition (runtime.condition_tables writes it)
SITE_MASK, VECTORS_UNGATED, SAE_GATED, PROJ_GATED = 0xFFFF, 1 << 16, 1 << 17, 1 << 18


def _normalize(s: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
               dtype: torch.dtype) -> torch.Tensor:
    """vLLM's RMSNorm on the float32 stream: ``x * rsqrt(mean(x^2) + eps)``, then the weight.

    ``weight_offset`` 0: ``(x.to(w.dtype) * w).to(dtype)`` (RMSNorm); 1: ``x * (w.float() + 1)``
    in float32, then ``.to(dtype)`` (GemmaRMSNorm, which hands vLLM a float32 ``w + 1``)."""
    normed = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight_offset:
        return (normed * (weight.float() + weight_offset)).to(dtype)
    return (normed.to(weight.dtype) * weight).to(dtype)


def probe_gate(s: torch.Tensor, rows: torch.Tensor, probe: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Per token, the gate of its row's condition from the stream ``s`` [N, D] (float32):
    ``sigmoid(sharpness * (s . probe - threshold))``, or the step ``s . probe > threshold`` when the
    row's condition is hard. ``params`` [R, 4] float32: threshold, sharpness, hard (0/1), unused."""
    p = params.index_select(0, rows)
    z = (s * probe.index_select(0, rows).float()).sum(dim=-1) - p[:, 0]
    g = torch.where(p[:, 2] > 0, (z > 0).float(), torch.sigmoid(p[:, 1] * z))
    return torch.nan_to_num(g, nan=0.0)  # a NaN stream never leaves a NaN gate for a later add


def project_naive(s: torch.Tensor, rows: torch.Tensor, proj: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float32 stream ``s`` [N, D] after its rows' directional projections, one direction after another:
    ``p = s . v``, ``s += (clamp(p, lo, hi) - p) * v`` (v a unit direction; ablation: lo = hi = 0, the
    component along v removed). ``proj``: (count [R] int32: the row's live directions, dirs [R, K, D] float32,
    bounds [R, K, 2] float32: lo, hi). ``count[0]`` (row 0's, the unsteered row's) is the site's idle mark: < 0, no
    token is projected here, whatever its row's count (``runtime.projection_tables``: no live row projects here)."""
    count, dirs, bounds = proj
    live = torch.where(count[:1] >= 0, count.index_select(0, rows), 0)  # a tensor test: no host sync on CUDA
    for k in range(dirs.shape[1]):
        v = dirs[:, k].index_select(0, rows).float()
        lo, hi = bounds[:, k].index_select(0, rows).unbind(-1)
        p = (s * v).sum(dim=-1)
        moved = s + (torch.minimum(torch.maximum(p, lo), hi) - p)[:, None] * v
        s = torch.where((live > k)[:, None], moved, s)
    return s


def steered_norm_naive(
    x: torch.Tensor,  # [N, D]
    residual: torch.Tensor | None,  # [N, D], or None (the stream is x)
    weight: torch.Tensor,  # [D]
    eps: float,
    weight_offset: float,
    index: torch.Tensor,  # [>= N] int32: table row of each token (0 = unsteered)
    vec_a: Sequence[torch.Tensor] = (),  # (table [R, D], flag [1] uint8) of slot A, () for none
    vec_b: Sequence[torch.Tensor] = (),
    sae_a: Sequence[torch.Tensor] = (),  # slot A's SAE pack (kernels/sae_clamp/packed.py), () for none
    sae_b: Sequence[torch.Tensor] = (),
    topk_a: int = 0,
    topk_b: int = 0,
    cond: Sequence[torch.Tensor] = (),  # (cond_site [R] int32, cond_params [R, 4], probe [R, D], site_ids [2])
    gate: torch.Tensor | None = None,  # [>= N] float32, updated in place at a probe site (with ``cond``)
    plan_a: torch.Tensor | None = None,  # [>= N] int32: pool row of each token's slot-A stream, -1: none
    plan_b: torch.Tensor | None = None,
    pool: torch.Tensor | None = None,  # [P, D], rows written in place (with a plan)
    proj_a: Sequence[torch.Tensor] = (),  # slot A's projections (project_naive), () for none
    proj_b: Sequence[torch.Tensor] = (),
    tc: Sequence[torch.Tensor] = (),  # a transcoder's pack (reads the output, moves the residual), ()
    topk_tc: int = 0,  # a full transcoder pack's TopK k
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized output, new residual) of ``x + residual`` with every feature of both slots applied in
    ``_staged``'s order, then the norm, then the transcoder (``transcoder_step``). Without SAE, condition,
    capture or transcoder: ``((x + residual) + A[index]) + B[index]``."""
    slots = ((sae_a, topk_a, proj_a, vec_a, plan_a), (sae_b, topk_b, proj_b, vec_b, plan_b))
    s = _staged(x, residual, index, slots, (*cond, gate) if cond else None, pool)
    out = _normalize(s, weight, eps, weight_offset, x.dtype)
    if tc:
        s = transcoder_step(s, out, index, tc, cond, gate, topk_tc)
    return out, s.to(x.dtype)


def transcoder_step(s: torch.Tensor, out: torch.Tensor, index: torch.Tensor, tc: Sequence[torch.Tensor],
                    cond: Sequence[torch.Tensor] = (), gate: torch.Tensor | None = None, topk: int = 0) -> torch.Tensor:
    """The float32 stream ``s`` [N, D] after a transcoder's clamps at this norm: ``s + w * sum_c (f'_c - f_c)
    dec[c]``, f encoded from the norm's output ``out`` (the MLP's input, in its dtype; a full pack's every
    feature, TopK of ``topk`` for a TopK transcoder, as a residual full pack's). The stream after the MLP
    is ``s + mlp(out)``, so adding the delta here edits the MLP's output exactly, whatever the MLP is. ``w``: the
    gate for a row whose condition gates SAE clamps (``SAE_GATED``; a transcoder's norm only reads the gate),
    else 1. Tokens whose row mode is OFF keep ``s`` bit for bit."""
    from vllm_steer.kernels.sae_clamp.packed import clamp_delta_naive

    n = s.shape[0]
    rows = index[:n].long()
    on = (tc[0].index_select(0, rows) != 0)[:, None]
    if not on.is_cuda and not bool(on.any()):
        return s
    delta = clamp_delta_naive(out.float(), rows, list(tc), topk)
    if cond:
        word = cond[0].index_select(0, rows)
        gated = (word >= 0) & ((word & SAE_GATED) != 0) & (cond[1][0, 3] != 0)
        delta = delta * torch.where(gated, gate[:n], torch.ones_like(gate[:n]))[:, None]
    return torch.where(on, s + delta, s)


def _staged(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    slots: tuple,  # per slot (SAE pack or (), topk, projections or (), (table, flag) or (), plan or None), A then B
    cond: tuple | None,  # (cond_site, cond_params, probe, site_ids, gate), or None: no conditions
    pool: torch.Tensor | None,
) -> torch.Tensor:
    """The float32 stream after every slot. The order of effects, per slot: its capture (the stream as it
    reaches the slot), the gate (at a row's probe site), the SAE clamps (their move scaled by the gate for
    a row whose condition gates SAE clamps: ``s + g * (clamped(s) - s)``), the directional projections
    (likewise ``s + g * (projected(s) - s)`` for a row whose condition gates them), then the vectors (scaled for a row whose condition gates vectors). Without a live condition every row adds as the plain op, bit for
    bit. ``cond_params[0, 3]`` (row 0 never has a condition) is 0 while no live row has one: then every row
    adds as the plain op (the kernel's fast path; ``runtime.condition_tables`` keeps it)."""
    from vllm_steer.kernels.capture_rows.op import capture_rows
    from vllm_steer.kernels.sae_clamp.packed import apply_site_naive

    n = x.shape[0]
    rows = index[:n].long()
    s = x.float()
    if residual is not None:
        s = s + residual.float()
    gating = False
    if cond is not None:
        cond_site, cond_params, probe, site_ids, gate = cond
        word = cond_site.index_select(0, rows)
        on = word >= 0
        host = not word.is_cuda  # host tensors are free to read: skip what no token needs
        gating = bool(cond_params[0, 3]) and (not host or bool(on.any()))
    if gating:
        site = torch.where(on, word & SITE_MASK, -1)  # the probe site of each token's row
        vectors_gated = on & ((word & VECTORS_UNGATED) == 0)
        sae_gated = (on & ((word & SAE_GATED) != 0))[:, None]
        proj_gated = (on & ((word & PROJ_GATED) != 0))[:, None]
        g = gate[:n]
    for slot, (pack, topk, proj, vec, plan) in enumerate(slots):
        if plan is not None:  # capture: the stream as it reaches the slot
            capture_rows(pool, s, plan)
        if gating:
            here = site == site_ids[slot]
            if not host or bool(here.any()):
                g = torch.where(here, probe_gate(s, rows, probe, cond_params), g)
        if pack:
            clamped = apply_site_naive(s, rows, list(pack), topk)
            s = torch.where(sae_gated, s + g[:, None] * (clamped - s), clamped) if gating else clamped
        if proj:
            projected = project_naive(s, rows, proj)
            s = torch.where(proj_gated, s + g[:, None] * (projected - s), projected) if gating else projected
        if vec:
            table, flag = vec
            if not flag.is_cuda and not bool(flag[0]):
                continue  # a host flag is free to read; on a GPU the zero rows make the add exact anyway
            if gating:
                w = torch.where(vectors_gated, g, torch.ones_like(g))
                s = s + table.index_select(0, rows).float() * w[:, None]
            else:
                s = s + table.index_select(0, rows).float()
    if gating:
        gate[:n] = g
    return s


# float8_e4m3fn's range and vLLM's smallest dynamic scale (vllm/model_executor/layers/quantization/input_quant_fp8.py)
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quant_fp8_naive(out: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 output, scale) of the norm's output ``out`` [N, D] as vLLM's ``QuantFP8.forward_native`` computes them
    for the FP8 linear after the norm: ``scale`` [1] float32 given (static per-tensor) is returned as is; None
    (dynamic per-token): ``max(|row|) / 448`` per row, at least ``FP8_MIN_SCALE``, [N, 1] float32. The value
    quantized is ``out`` in its own dtype (the norm's rounded output), times the scale's float32 reciprocal."""
    if scale is None:
        scale = (out.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (out.float() * scale.float().reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quant_fp8_group_naive(out: torch.Tensor, group: int, eps: float = 1e-10,
                          ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 output, scales [N, D // group] float32) of the norm's output ``out`` [N, D] as vLLM's CUDA op
    ``_C.per_token_group_fp8_quant`` computes them for a block-FP8 linear (csrc/quantization/w8a8/fp8/
    per_token_group_quant.cu): per token and group of ``group`` columns, ``scale = max(max|group|, eps) / 448``,
    rounded up to a power of two when ``ue8m0``; ``q = clamp(out / scale, ±448)``, a true division. vLLM's native
    ``QuantFP8._quantize_group_native`` differs only where a group's max is below 1/512 (it clamps the scale at
    ``FP8_MIN_SCALE`` instead of the max at ``eps``). The caller writes the scales in the layout its linear reads."""
    n, d = out.shape
    y = out.float().view(n, d // group, group)
    scale = y.abs().amax(dim=-1, keepdim=True).clamp(min=eps) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale.clamp(min=1e-10))))
    q = (y / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, d), scale.view(n, d // group)
