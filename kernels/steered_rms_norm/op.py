"""Registers ``torch.ops.vllm_steer.steered_rms_norm`` (functional).

Opaque to Inductor (so zero tables are never folded away), it takes the place of vLLM's fused
add + RMSNorm at hooked norms: the steering add costs no launch of its own. CUDA tensors run the
Triton kernel, other devices the plain-torch reference.

``steered_sae_rms_norm`` (norms with a site that has an SAE): on CUDA, when both slots' packs are
clamp-only or empty (ReLU / JumpReLU without reconstruct), the same single Triton launch with the
clamps fused in; a full pack (TopK, or a site that allows reconstruct) takes the dense plain-torch
path for the whole op (graph-safe, no host sync). Other devices: the reference.

``steered_cond_rms_norm`` (every steered norm of a server started with ``steer.conditions``): the
same with conditional rows (``naive.steered_cond_rms_norm_naive``), one Triton launch on CUDA.
``steered_cond_sae_rms_norm`` (the norms with an SAE site on such a server): both, the clamps and the
vectors of a row scaled by its token's gate as its condition says (the gate is only read there).

``steered_capture_rms_norm`` (every steered norm with a captured site, on a server with capture consumers):
any of the above with capture folded in (``naive.steered_capture_rms_norm_naive``): each captured slot's
stream goes to the capture pool as it reaches the slot, inside the same launch. Mutates ``gate`` (a dummy
without conditions) and ``pool``.
"""

from __future__ import annotations

import torch

from vllm_steer.kernels.library import LIB
from vllm_steer.kernels.sae_clamp.packed import N_CLAMP_ONLY
from vllm_steer.kernels.steered_rms_norm.naive import (
    steered_capture_rms_norm_naive,
    steered_cond_rms_norm_naive,
    steered_cond_sae_rms_norm_naive,
    steered_rms_norm_naive,
    steered_sae_rms_norm_naive,
)

_registered = False
_triton_norm = None  # kernels.steered_rms_norm.triton.steered_rms_norm_triton, imported on first CUDA call


def _impl(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_a: torch.Tensor | None = None,
    flag_a: torch.Tensor | None = None,
    table_b: torch.Tensor | None = None,
    flag_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    global _triton_norm
    if x.is_cuda:
        if _triton_norm is None:
            from vllm_steer.kernels.steered_rms_norm.triton import steered_rms_norm_triton as _triton_norm
        return _triton_norm(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b)
    return steered_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b)


def _sae_impl(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda and all(len(p) in (0, N_CLAMP_ONLY) for p in (sae_a, sae_b)):
        from vllm_steer.kernels.steered_rms_norm.triton import steered_sae_rms_norm_triton

        return steered_sae_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a,
                                           table_b, flag_b, sae_a, sae_b)
    # CPU, or a full pack (TopK / reconstruct): the dense torch path, in the reference's order
    return steered_sae_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b,
                                      flag_b, sae_a, sae_b, topk_a, topk_b)


def _cond_impl(
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
    cond_site: torch.Tensor,
    cond_params: torch.Tensor,
    probe: torch.Tensor,
    gate: torch.Tensor,
    site_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from vllm_steer.kernels.steered_rms_norm.triton import steered_cond_rms_norm_triton

        return steered_cond_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a,
                                            table_b, flag_b, cond_site, cond_params, probe, gate, site_ids)
    return steered_cond_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b,
                                       flag_b, cond_site, cond_params, probe, gate, site_ids)


def _cond_sae_impl(
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
    if x.is_cuda and all(len(p) in (0, N_CLAMP_ONLY) for p in (sae_a, sae_b)):
        from vllm_steer.kernels.steered_rms_norm.triton import steered_cond_sae_rms_norm_triton

        return steered_cond_sae_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a,
                                                table_b, flag_b, sae_a, sae_b, cond_site, cond_params, probe, gate,
                                                site_ids)
    return steered_cond_sae_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b,
                                           flag_b, sae_a, sae_b, topk_a, topk_b, cond_site, cond_params, probe, gate,
                                           site_ids)


def _capture_impl(
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
    cond_site: torch.Tensor | None,  # None: no conditions (then ``gate`` is a dummy, never touched)
    cond_params: torch.Tensor | None,
    probe: torch.Tensor | None,
    gate: torch.Tensor,
    site_ids: torch.Tensor | None,
    pool: torch.Tensor,
    plan_a: torch.Tensor | None,
    plan_b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cond = None if cond_site is None else (cond_site, cond_params, probe, gate, site_ids)
    if x.is_cuda and all(len(p) in (0, N_CLAMP_ONLY) for p in (sae_a, sae_b)):
        from vllm_steer.kernels.steered_rms_norm.triton import steered_capture_rms_norm_triton

        return steered_capture_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a,
                                               table_b, flag_b, sae_a, sae_b, cond, pool, plan_a, plan_b)
    return steered_capture_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b,
                                          flag_b, sae_a, sae_b, topk_a, topk_b, cond, pool, plan_a, plan_b)


def _fake(x: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """The shapes of every op here (compile tracing): the output and the new residual, like ``x``."""
    return torch.empty_like(x), torch.empty_like(x)


def register() -> None:
    """Define the op once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("steered_rms_norm", _impl, mutates_args=[], fake_impl=_fake, target_lib=LIB)
    # Norms that receive a site with an SAE (steer.sae): the same, with the SAE clamps first.
    direct_register_custom_op("steered_sae_rms_norm", _sae_impl, mutates_args=[], fake_impl=_fake,
                              target_lib=LIB)
    # Norms of a server with steer.conditions: the same, with conditional rows (the gate buffer is
    # written at a row's probe site and read by the later norms of the same forward pass).
    direct_register_custom_op("steered_cond_rms_norm", _cond_impl, mutates_args=["gate"], fake_impl=_fake,
                              target_lib=LIB)
    # SAE norms of a server with steer.conditions (the naive path may write the gate: declared mutated)
    direct_register_custom_op("steered_cond_sae_rms_norm", _cond_sae_impl, mutates_args=["gate"],
                              fake_impl=_fake, target_lib=LIB)
    # Steered norms with a captured site (steer.capture): any of the above, capture in the same launch
    direct_register_custom_op("steered_capture_rms_norm", _capture_impl, mutates_args=["gate", "pool"],
                              fake_impl=_fake, target_lib=LIB)
    _registered = True
