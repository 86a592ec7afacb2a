"""Registers ``torch.ops.vllm_steer.capture_rows_`` (opaque; mutates ``pool``).

CUDA tensors run the Triton kernel (no host sync); CPU runs the plain-torch reference
(``capture_rows``, also called by the steered norm's reference for its captured slots). The op
is installed only before the first layer's norm of a server with capture consumers (every other
steered norm captures in its own launch).
"""

import torch

from vllm_steer.kernels.capture_rows import live
from vllm_steer.kernels.capture_rows.naive import capture_rows_naive
from vllm_steer.kernels.library import LIB

_registered = False


def capture_rows(pool: torch.Tensor, a: torch.Tensor, plan: torch.Tensor) -> None:
    """``pool[plan[t]] = a[t]`` for every token with ``plan[t] >= 0``, on the tensors' device."""
    if a.is_cuda:
        from vllm_steer.kernels.capture_rows.triton import capture_rows_triton

        capture_rows_triton(pool, a, plan)
    else:
        capture_rows_naive(pool, a, plan)


def _impl(pool: torch.Tensor, a: torch.Tensor, plan: torch.Tensor) -> None:
    live.ready(plan)  # an eager step's capture plan, left to its first capturing op
    if not live.may_skip(a.is_cuda, plan):
        capture_rows(pool, a, plan)


def _fake(pool: torch.Tensor, a: torch.Tensor, plan: torch.Tensor) -> None:
    return None


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("capture_rows_", _impl, mutates_args=["pool"], fake_impl=_fake, target_lib=LIB)
    _registered = True
