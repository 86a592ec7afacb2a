"""Triton segmented add: one program per (segment, block of columns) sums the segment's pool rows in float32
registers and adds the sum to its accumulator row once (a step names each slot once: no atomics)."""

import torch
import triton
import triton.language as tl

from vllm_steer.kernels.host_math import cdiv, next_power_of_2

_BLOCK_D = 1024
_UNROLL = 4  # rows loaded a loop step: loads in flight per thread


# the index pointers are slices of one buffer at offsets that change with the step (an odd count of segments leaves
# ``p_off`` 8 bytes off 16): not specialized on, so one compiled kernel serves every step (warmed at start-up)
@triton.jit(do_not_specialize_on_alignment=["p_src", "p_slot", "p_off"])
def _segment_add_kernel(p_acc, p_pool, p_src, p_slot, p_off, stride_acc, stride_pool, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, UNROLL: tl.constexpr):
    i_s = tl.program_id(0)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    a = tl.load(p_off + i_s)
    b = tl.load(p_off + i_s + 1)
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(a, b, UNROLL):
        for u in tl.static_range(UNROLL):
            ok = j + u < b
            row = tl.load(p_src + j + u, mask=ok, other=0)
            total += tl.load(p_pool + row * stride_pool + o_d, mask=m_d & ok, other=0.0).to(tl.float32)
    p_out = p_acc + tl.load(p_slot + i_s) * stride_acc + o_d
    tl.store(p_out, tl.load(p_out, mask=m_d, other=0.0) + total, mask=m_d)


def segment_add_triton(acc: torch.Tensor, pool: torch.Tensor, src: torch.Tensor, slot: torch.Tensor,
                       off: torch.Tensor, n_seg: int) -> None:
    if n_seg == 0:
        return
    d = pool.shape[1]
    block_d = min(_BLOCK_D, next_power_of_2(d))
    _segment_add_kernel[(n_seg, cdiv(d, block_d))](
        acc, pool, src, slot, off, acc.stride(0), pool.stride(0), D=d, BLOCK_D=block_d, UNROLL=_UNROLL,
        num_warps=4 if block_d >= 512 else 2)
