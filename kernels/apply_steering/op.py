"""Registers ``torch.ops.vllm_steer.apply_steering_`` (opaque to Inductor, so zero tables are never folded).

The op mutates ``hidden`` in place and returns nothing. CUDA tensors run the Triton kernel; other
devices run the plain-torch reference, skipping the work when the table is idle (no sync on CPU).
"""

import torch
from torch.library import Library

from vllm_steer.kernels.apply_steering import live
from vllm_steer.kernels.apply_steering.naive import apply_steering_naive

_LIB = Library("vllm_steer", "FRAGMENT")
_registered = False


def _apply_steering_impl(
    hidden: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    active: torch.Tensor,
) -> None:
    if live.may_skip(live.steering_live):
        return
    if hidden.is_cuda:
        from vllm_steer.kernels.apply_steering.triton import apply_steering_triton

        apply_steering_triton(hidden, table, index, active)
    elif bool(active[0]):  # a host tensor: reading it is not a device sync
        apply_steering_naive(hidden, table, index, active)


def _apply_steering_fake(
    hidden: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    active: torch.Tensor,
) -> None:
    return None


def register() -> None:
    """Define the op once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(
        op_name="apply_steering_",
        op_func=_apply_steering_impl,
        mutates_args=["hidden"],
        fake_impl=_apply_steering_fake,
        target_lib=_LIB,
    )
    _registered = True


def apply_steering_(
    hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor, active: torch.Tensor
) -> None:
    """``hidden[t] += table[index[t]]`` for every token t, in place."""
    torch.ops.vllm_steer.apply_steering_(hidden, table, index, active)
