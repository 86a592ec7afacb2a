"""capture_reduce: ``acc[slot[s]] += sum(pool[src[off[s]:off[s + 1]]])`` per segment s (device-reduced capture)."""

import torch

from vllm_steer.kernels.capture_reduce.naive import segment_add_naive


def segment_add(acc: torch.Tensor, pool: torch.Tensor, src: torch.Tensor, slot: torch.Tensor, off: torch.Tensor,
                n_seg: int) -> None:
    """Each of ``n_seg`` segments' pool rows summed in float32 into its accumulator row, on the tensors' device
    (CUDA: the Triton kernel, no host sync; CPU: the plain-torch reference)."""
    if acc.is_cuda:
        from vllm_steer.kernels.capture_reduce.triton import segment_add_triton

        segment_add_triton(acc, pool, src, slot, off, n_seg)
    else:
        segment_add_naive(acc, pool, src, slot, off, n_seg)
