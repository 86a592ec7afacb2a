"""``step_index(...)``: the Triton kernel for CUDA tensors, the plain-torch reference otherwise.

Not a torch op: the runner calls it eagerly before the forward (outside the compiled graph).
"""

import torch

from vllm_steer.kernels.step_index.naive import step_index_naive


def step_index(index: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
               positions: torch.Tensor, slot_rows: torch.Tensor, num_reqs: int, pad_end: int) -> None:
    if index.is_cuda:
        from vllm_steer.kernels.step_index.triton import step_index_triton

        step_index_triton(index, idx_mapping, query_start_loc, positions, slot_rows, num_reqs, pad_end)
    else:
        step_index_naive(index, idx_mapping, query_start_loc, positions, slot_rows, num_reqs, pad_end)
