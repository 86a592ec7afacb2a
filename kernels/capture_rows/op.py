"""Registers ``torch.ops.vllm_steer.capture_rows_`` (opaque; mutates ``pool``).

CUDA tensors run the Triton kernel (no host sync); CPU runs the plain-torch reference. Installed
only when capture consumers are configured, before the steered norm of each hooked site.
"""

import torch

from vllm_steer.kernels.capture_rows import live
from vllm_steer.kernels.capture_rows.naive import capture_rows_naive
from vllm_steer.kernels.library import LIB

_registered = False


def _impl(pool: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, plan: torch.Tensor,
          table: torch.Tensor | None = None, flag: torch.Tensor | None = None,
          index: torch.Tensor | None = None) -> None:
    if live.may_skip():
        return
    if a.is_cuda:
        from vllm_steer.kernels.capture_rows.triton import capture_rows_triton

        capture_rows_triton(pool, a, b, plan, table, flag, index)
    else:
        capture_rows_naive(pool, a, b, plan, table, flag, index)


def _fake(pool: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, plan: torch.Tensor,
          table: torch.Tensor | None = None, flag: torch.Tensor | None = None,
          index: torch.Tensor | None = None) -> None:
    return None


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("capture_rows_", _impl, mutates_args=["pool"], fake_impl=_fake, target_lib=LIB)
    _registered = True
