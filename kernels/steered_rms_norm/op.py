"""Registers ``torch.ops.vllm_steer.steered_rms_norm`` and ``steered_rms_norm_first_``.

Both are opaque to Inductor (so zero tables are never folded away) and take the place of vLLM's
fused add + RMSNorm at hooked sites: the steering add costs no launch of its own. CUDA tensors run
the Triton kernel, other devices the plain-torch reference. ``steered_rms_norm`` is functional;
``steered_rms_norm_first_`` (the first layer, called without a residual) steers ``x`` in place,
because the caller keeps ``x`` itself as the residual stream.
"""

from __future__ import annotations

import torch

from vllm_steer.kernels.library import LIB
from vllm_steer.kernels.steered_rms_norm.naive import steered_rms_norm_first_naive, steered_rms_norm_naive

_registered = False


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
    if x.is_cuda:
        from vllm_steer.kernels.steered_rms_norm.triton import steered_rms_norm_triton

        return steered_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a,
                                       table_b, flag_b)
    return steered_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b)


def _fake(
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
    return torch.empty_like(x), torch.empty_like(x)


def _first_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_b: torch.Tensor | None = None,
    flag_b: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.is_cuda:
        from vllm_steer.kernels.steered_rms_norm.triton import steered_rms_norm_first_triton

        return steered_rms_norm_first_triton(x, weight, eps, weight_offset, index, table_b, flag_b)
    return steered_rms_norm_first_naive(x, weight, eps, weight_offset, index, table_b, flag_b)


def _first_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_b: torch.Tensor | None = None,
    flag_b: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(x)


def register() -> None:
    """Define both ops once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("steered_rms_norm", _impl, mutates_args=[], fake_impl=_fake, target_lib=LIB)
    direct_register_custom_op("steered_rms_norm_first_", _first_impl, mutates_args=["x"], fake_impl=_first_fake,
                              target_lib=LIB)
    _registered = True
