"""Plain-torch reference of steered_rms_norm: the spec the Triton kernel is tested against, and the
implementation on CPU. Mirrors vLLM's native ``fused_add_rms_norm`` / ``rms_norm`` (vllm/ir/ops)."""

from __future__ import annotations

import torch


def _stream(
    x: torch.Tensor,  # [N, D]
    residual: torch.Tensor | None,  # [N, D] or None (first layer: the stream is x)
    index: torch.Tensor,  # [>= N] int32: table row of each token (0 = unsteered)
    tables: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...],  # (table [R, D], flag [1] uint8)
) -> torch.Tensor:
    """s = ((x + residual) + A[index]) + B[index] in float32; a table whose flag is 0 adds nothing."""
    n = x.shape[0]
    s = x.float()
    if residual is not None:
        s = s + residual.float()
    rows = None
    for table, flag in tables:
        if table is None or (flag is not None and not flag.is_cuda and not bool(flag[0])):
            continue  # a host flag is free to read; on a GPU the zero rows make the add exact anyway
        if rows is None:
            rows = index[:n].long()
        s = s + table.index_select(0, rows).float()
    return s


def _normalize(s: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
               dtype: torch.dtype) -> torch.Tensor:
    """vLLM's RMSNorm on the float32 stream: ``x * rsqrt(mean(x^2) + eps)``, then the weight.

    ``weight_offset`` 0: ``(x.to(w.dtype) * w).to(dtype)`` (RMSNorm); 1: ``x * (w.float() + 1)``
    in float32, then ``.to(dtype)`` (GemmaRMSNorm, which hands vLLM a float32 ``w + 1``)."""
    normed = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight_offset:
        return (normed * (weight.float() + weight_offset)).to(dtype)
    return (normed.to(weight.dtype) * weight).to(dtype)


def steered_rms_norm_naive(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,  # [D]
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_a: torch.Tensor | None = None,
    flag_a: torch.Tensor | None = None,
    table_b: torch.Tensor | None = None,
    flag_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized output, new residual) of ``x + residual`` steered by A then B."""
    s = _stream(x, residual, index, ((table_a, flag_a), (table_b, flag_b)))
    return _normalize(s, weight, eps, weight_offset, x.dtype), s.to(x.dtype)


def steered_sae_rms_norm_naive(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_a: torch.Tensor | None,
    flag_a: torch.Tensor | None,
    table_b: torch.Tensor | None,
    flag_b: torch.Tensor | None,
    sae_a: list[torch.Tensor],  # a site's SAE pack (kernels/sae_clamp/packed.py), or [] for none
    sae_b: list[torch.Tensor],
    topk_a: int,
    topk_b: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``steered_rms_norm_naive``, with each slot's SAE clamps applied before its vectors:
    ``s = x + residual``, then SAE A, + A, SAE B, + B, then the norm."""
    from vllm_steer.kernels.sae_clamp.packed import apply_site_naive

    s = _stream(x, residual, index, ())
    rows = index[: x.shape[0]].long()
    for pack, topk, table, flag in ((sae_a, topk_a, table_a, flag_a), (sae_b, topk_b, table_b, flag_b)):
        if pack:
            s = apply_site_naive(s, rows, pack, topk)
        s = _stream(s, None, index, ((table, flag),))
    return _normalize(s, weight, eps, weight_offset, x.dtype), s.to(x.dtype)


def probe_gate(s: torch.Tensor, rows: torch.Tensor, probe: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Per token, the gate of its row's condition from the stream ``s`` [N, D] (float32):
    ``sigmoid(sharpness * (s . probe - threshold))``, or the step ``s . probe > threshold`` when the
    row's condition is hard. ``params`` [R, 4] float32: threshold, sharpness, hard (0/1), unused."""
    p = params.index_select(0, rows)
    z = (s * probe.index_select(0, rows).float()).sum(dim=-1) - p[:, 0]
    g = torch.where(p[:, 2] > 0, (z > 0).float(), torch.sigmoid(p[:, 1] * z))
    return torch.nan_to_num(g, nan=0.0)  # a NaN stream never leaves a NaN gate for a later add


# A conditional row's ``cond_site`` word: its probe site's order in the low 16 bits, plus what its gate
# does not / does scale (``applies_to``); -1: no condition (runtime.condition_tables writes it)
SITE_MASK, VECTORS_UNGATED, SAE_GATED = 0xFFFF, 1 << 16, 1 << 17


def steered_cond_rms_norm_naive(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_a: torch.Tensor | None,
    flag_a: torch.Tensor | None,
    table_b: torch.Tensor | None,
    flag_b: torch.Tensor | None,
    cond_site: torch.Tensor,  # [R] int32: the row's probe site word (SITE_MASK, ...), -1: no condition
    cond_params: torch.Tensor,  # [R, 4] float32 (probe_gate); [0, 3]: 1 while a live row has a condition
    probe: torch.Tensor,  # [R, D] float32: the row's probe direction
    gate: torch.Tensor,  # [>= N] float32, updated in place: each token's gate in this forward pass
    site_ids: torch.Tensor,  # [2] int32: the site order of slot A and of slot B (-2: no such slot)
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``steered_rms_norm_naive``, with conditional rows: at the slot that is a row's probe site,
    the token's gate is computed from the stream before that slot's add (the pristine residual, as
    capture reads it) and stored in ``gate``; every add of a row whose condition gates its vectors is
    scaled by the token's gate (the front end refuses a gated vector before its probe site, so the
    gate read is always this pass's). Other rows add as in the plain op, bit for bit.
    ``cond_params[0, 3]`` (row 0 never has a condition) is 0 while no live row has one: then every row
    adds as in the plain op (the kernel's fast path; ``runtime.condition_tables`` keeps it)."""
    return steered_cond_sae_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b,
                                           flag_b, [], [], 0, 0, cond_site, cond_params, probe, gate, site_ids)


def steered_cond_sae_rms_norm_naive(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_a: torch.Tensor | None,
    flag_a: torch.Tensor | None,
    table_b: torch.Tensor | None,
    flag_b: torch.Tensor | None,
    sae_a: list[torch.Tensor],
    sae_b: list[torch.Tensor],
    topk_a: int,
    topk_b: int,
    cond_site: torch.Tensor,
    cond_params: torch.Tensor,
    probe: torch.Tensor,
    gate: torch.Tensor,
    site_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both of the above: per slot, the gate (at a row's probe site), then the SAE clamps, their move of
    the stream scaled by the gate for a row whose condition gates SAE clamps (``s + g * (clamped(s) - s)``;
    other rows get the clamped stream itself), then the vectors (scaled for a row whose condition gates
    vectors)."""
    slots = ((sae_a, topk_a, table_a, flag_a), (sae_b, topk_b, table_b, flag_b))
    s = _staged(x, residual, index, slots, (cond_site, cond_params, probe, gate, site_ids))
    return _normalize(s, weight, eps, weight_offset, x.dtype), s.to(x.dtype)


def _staged(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    slots: tuple,  # per slot (SAE pack or [], topk, table or None, flag or None), A then B
    cond: tuple | None,  # (cond_site, cond_params, probe, gate, site_ids), or None: no conditions
    capture: tuple | None = None,  # (pool, plan of slot A or None, plan of slot B or None)
) -> torch.Tensor:
    """The float32 stream after every slot: per slot, its capture (the stream as it reaches the slot),
    the gate (at a row's probe site), the SAE clamps (their move scaled by the gate for a row whose
    condition gates SAE clamps), then the vectors (scaled for a row whose condition gates vectors).
    Without a live condition every row adds as the plain and SAE ops do, bit for bit."""
    from vllm_steer.kernels.capture_rows.op import capture_rows
    from vllm_steer.kernels.sae_clamp.packed import apply_site_naive

    n = x.shape[0]
    rows = index[:n].long()
    s = _stream(x, residual, index, ())
    gating = False
    if cond is not None:
        cond_site, cond_params, probe, gate, site_ids = cond
        word = cond_site.index_select(0, rows)
        on = word >= 0
        host = not word.is_cuda  # host tensors are free to read: skip what no token needs
        gating = bool(cond_params[0, 3]) and (not host or bool(on.any()))
    if gating:
        site = torch.where(on, word & SITE_MASK, -1)  # the probe site of each token's row
        vectors_gated = on & ((word & VECTORS_UNGATED) == 0)
        sae_gated = (on & ((word & SAE_GATED) != 0))[:, None]
        g = gate[:n]
    for slot, (pack, topk, table, flag) in enumerate(slots):
        if capture is not None and capture[1 + slot] is not None:  # the stream as it reaches the slot
            capture_rows(capture[0], s, capture[1 + slot])
        if gating:
            here = site == site_ids[slot]
            if not host or bool(here.any()):
                g = torch.where(here, probe_gate(s, rows, probe, cond_params), g)
        if pack:
            clamped = apply_site_naive(s, rows, pack, topk)
            s = torch.where(sae_gated, s + g[:, None] * (clamped - s), clamped) if gating else clamped
        if table is not None and (flag is None or flag.is_cuda or bool(flag[0])):  # as _stream
            if gating:
                w = torch.where(vectors_gated, g, torch.ones_like(g))
                s = s + table.index_select(0, rows).float() * w[:, None]
            else:
                s = s + table.index_select(0, rows).float()
    if gating:
        gate[:n] = g
    return s


def steered_capture_rms_norm_naive(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_a: torch.Tensor | None,
    flag_a: torch.Tensor | None,
    table_b: torch.Tensor | None,
    flag_b: torch.Tensor | None,
    sae_a: list[torch.Tensor],  # SAE packs, or [] for none
    sae_b: list[torch.Tensor],
    topk_a: int,
    topk_b: int,
    cond: tuple | None,  # (cond_site, cond_params, probe, gate, site_ids), or None: no conditions
    pool: torch.Tensor,  # [P, D], rows written in place
    plan_a: torch.Tensor | None,  # [>= N] int32: pool row of each token's slot-A stream, or -1; None: not captured
    plan_b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any steered norm (plain, SAE, conditional, both) with capture folded in: a captured slot's stream is
    written to ``pool`` as it reaches the slot, after every earlier slot's steering (slot A's SAE clamps and
    its vectors, gated as the row's condition says) and before its own. So ``pre_attn.L`` (slot B) is
    captured after ``post_mlp.L-1``'s clamps and gated rows, as transformers' stream has them."""
    slots = ((sae_a, topk_a, table_a, flag_a), (sae_b, topk_b, table_b, flag_b))
    s = _staged(x, residual, index, slots, cond, (pool, plan_a, plan_b))
    return _normalize(s, weight, eps, weight_offset, x.dtype), s.to(x.dtype)
