"""The steered norm's full SAE slots on CUDA: turns a slot's full pack into the edit descriptor the norm kernel adds
(``FULL_A`` / ``FULL_B`` / ``FULL_TC``), computing the edit with ``full_triton.site_edit``. Slot B's edit is encoded
from the stream after slot A's features, which ``site_edit`` re-applies to the on tokens (as the norm kernel would);
a full transcoder pack's (TopK, at a post_attn norm, which has slot A only) from that stream's norm, the MLP's input;
a clamp-only slot A at prefill sizes gets its tiled edit first (``tiled_triton``), which both read."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_steer.kernels.sae_clamp.full_triton import site_edit
from vllm_steer.kernels.sae_clamp.packed import N_FULL


def _prefix(x: torch.Tensor, residual: torch.Tensor | None, index: torch.Tensor, vec_a: Sequence[torch.Tensor],
            sae_a: Sequence[torch.Tensor], full_a: tuple, cond: Sequence[torch.Tensor], gate: torch.Tensor | None,
            proj_a: Sequence[torch.Tensor]) -> tuple[dict, Sequence[torch.Tensor], tuple]:
    """(slot A's descriptors for ``site_edit``'s gather, sae_a, full_a): a clamp-only slot A at prefill sizes has
    its tiled edit computed first (FULL_A), which the gather and the norm then read."""
    from vllm_steer.kernels.steered_rms_norm.triton import _proj_desc, _sae_desc, tiled_of

    d = x.shape[1]
    if sae_a and tiled_of(x.shape[0]):
        from vllm_steer.kernels.sae_clamp.tiled_triton import slot_edit

        full_a, sae_a = (slot_edit(x, residual, index, sae_a), sae_a[0]), []
    prefix = {}
    if vec_a:
        prefix["vec"] = (vec_a[0], vec_a[1], vec_a[0].stride(0))
    if sae_a:
        prefix["sae"] = _sae_desc(sae_a, d)
    if proj_a:
        prefix["proj"] = _proj_desc(proj_a, d)
    if full_a:
        prefix["full"] = (full_a[0], full_a[1], full_a[0].stride(0))
    if cond:
        prefix["cond"] = (cond[0], cond[1], cond[2], gate, cond[3], cond[2].stride(0))
    return prefix, sae_a, full_a


def full_slots(x: torch.Tensor, residual: torch.Tensor | None, index: torch.Tensor, vec_a: Sequence[torch.Tensor],
               sae_a: Sequence[torch.Tensor], topk_a: int, sae_b: Sequence[torch.Tensor], topk_b: int,
               cond: Sequence[torch.Tensor], gate: torch.Tensor | None, proj_a: Sequence[torch.Tensor],
               tc: Sequence[torch.Tensor] = (), topk_tc: int = 0, norm: tuple | None = None) -> tuple:
    """(sae_a, full_a, sae_b, full_b, tc, full_tc) for the Triton norm: a full slot's clamp-only descriptor emptied
    and its ``(edit, mode)`` given instead; a clamp-only slot passes through. ``norm`` (weight, eps, weight_offset):
    the norm's, for a full transcoder pack ``tc``."""
    full_a = full_b = full_tc = ()
    if len(sae_a) == N_FULL:
        full_a = (site_edit(x, residual, index, sae_a, topk_a), sae_a[0])
        sae_a = []
    if len(sae_b) == N_FULL:
        prefix, sae_a, full_a = _prefix(x, residual, index, vec_a, sae_a, full_a, cond, gate, proj_a)
        full_b = (site_edit(x, residual, index, sae_b, topk_b, prefix), sae_b[0])
        sae_b = []
    if len(tc) == N_FULL:
        if sae_b or full_b:
            raise ValueError("a full transcoder pack sits at a post_attn norm, whose only slot is A")
        prefix, sae_a, full_a = _prefix(x, residual, index, vec_a, sae_a, full_a, cond, gate, proj_a)
        full_tc = (site_edit(x, residual, index, tc, topk_tc, {**prefix, "norm": norm}), tc[0])
        tc = []
    return sae_a, full_a, sae_b, full_b, tc, full_tc
