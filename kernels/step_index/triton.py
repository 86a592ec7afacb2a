"""Triton step_index: one program per request of the batch writes the rows of its tokens, one more
zeroes the padding up to ``pad_end``.

Launched once per step outside the CUDA graph (the graph's norms read ``index``), through
``CachedLauncher``: one direct launch, no argument binding on the host.
"""

import torch
import triton
import triton.language as tl

from vllm_steer.kernels.launch_cache import CachedLauncher

_BLOCK = 256  # tokens per iteration of a program (a prefill chunk loops)


@triton.jit(do_not_specialize=["num_reqs", "pad_end"])  # one compiled kernel for every batch
def _step_index_kernel(p_index, p_idx_mapping, p_qsl, p_positions, p_slot_rows, num_reqs, pad_end,
                       BLOCK: tl.constexpr):
    i_b = tl.program_id(0)
    start = tl.load(p_qsl + i_b)
    if i_b < num_reqs:
        end = tl.load(p_qsl + i_b + 1)
        i_slot = tl.load(p_idx_mapping + i_b).to(tl.int64)
        row_prefill = tl.load(p_slot_rows + i_slot * 4)
        row_decode = tl.load(p_slot_rows + i_slot * 4 + 1)
        prompt_len = tl.load(p_slot_rows + i_slot * 4 + 2)
        for off in range(start, end, BLOCK):
            o_t = off + tl.arange(0, BLOCK)
            m_t = o_t < end
            pos = tl.load(p_positions + o_t, mask=m_t, other=0)
            tl.store(p_index + o_t, tl.where(pos < prompt_len, row_prefill, row_decode), mask=m_t)
    else:  # the last program: padding tokens (CUDA-graph sizes) get row 0
        for off in range(start, pad_end, BLOCK):
            o_t = off + tl.arange(0, BLOCK)
            tl.store(p_index + o_t, tl.zeros([BLOCK], dtype=tl.int32), mask=o_t < pad_end)


_launch = CachedLauncher(_step_index_kernel)


def step_index_triton(index: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                      positions: torch.Tensor, slot_rows: torch.Tensor, num_reqs: int, pad_end: int) -> None:
    _launch((num_reqs + 1,), (index, idx_mapping, query_start_loc, positions, slot_rows, num_reqs, pad_end),
            (_BLOCK,), 1)
