"""Registers ``torch.ops.vllm_steer.capture_rows_`` (opaque; mutates ``pool``).

CUDA tensors run the Triton kernel (no host sync); CPU runs the plain-torch reference.
"""

import torch

from vllm_steer.kernels.apply_steering import live
from vllm_steer.kernels.apply_steering.op import _LIB
from vllm_steer.kernels.capture_rows.naive import capture_rows_naive

_registered = False


def _impl(pool: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, plan: torch.Tensor) -> None:
    if live.may_skip(live.capture_live):
        return
    if a.is_cuda:
        from vllm_steer.kernels.capture_rows.triton import capture_rows_triton

        capture_rows_triton(pool, a, b, plan)
    else:
        capture_rows_naive(pool, a, b, plan)


def _fake(pool: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, plan: torch.Tensor) -> None:
    return None


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("capture_rows_", _impl, mutates_args=["pool"], fake_impl=_fake, target_lib=_LIB)
    _registered = True


def capture_rows_(pool: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, plan: torch.Tensor) -> None:
    torch.ops.vllm_steer.capture_rows_(pool, a, b, plan)
