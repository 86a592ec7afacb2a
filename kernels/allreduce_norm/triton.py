"""One launch per norm across the TP ranks of one node: each rank's partial sum ``x`` (o_proj's or down_proj's
output before vLLM's all-reduce) is pushed into every rank's symmetric buffer (``torch.distributed._symmetric_memory``),
and each rank adds the ranks' rows in rank order in float32 (the same bits on every rank), adds the residual and
normalizes: vLLM's all-reduce + fused add + RMSNorm in one kernel, as FlashInfer's fused all-reduce does for stock at
TP >= 2, so a steered norm can keep stock's kernel count under TP (NOTES issue 40, give-back C).

No barrier: a Lamport exchange. Every element of the buffers holds negative zero (the sentinel) until a rank pushes a
row into it (its own negative zeros pushed as positive ones: the sum is the same); a reader spins on its own buffer's
row until no element is the sentinel, adds it, and writes the sentinel back. Two buffers alternate by launch (the
epoch, flipped on the device by the launch's last program): a rank can be at most one launch ahead of another (its
next launch waits for the other's pushes), so a push never lands on a row still unread. CUDA graphs replay it as it is
(nothing per launch on the host).

``ArNormWorkspace`` is the exchange's host side; ``WORKSPACES`` holds the engine's (``runtime.allreduce_fusion``
makes one per TP group when ``VLLM_STEER_AR_NORM=1``), which the steered norm's ``AR`` feature uses
(``steered_norm_plain_ar``); ``allreduce_add_rms_norm`` is this kernel's launch, for its tests and bench
(``tests/gpu/test_allreduce_norm_gpu.py``, ``bench/allreduce_norm_bench.py``, two GPUs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_steer.kernels.allreduce_norm.lamport import epoch_base, flip_epoch, pull_sum, push_row
from vllm_steer.kernels.host_math import next_power_of_2
from vllm_steer.kernels.steered_rms_norm.triton import _num_warps


@triton.jit
def _ar_norm_kernel(p_bufs, p_flags, p_x, p_res, p_w, p_out, n_tokens, stride_x, stride_res, stride_out, eps,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                    MAX_T: tl.constexpr):
    """``p_bufs``: int64 ``[WORLD]``, each rank's buffer address (``[2, WORLD, MAX_T, D]``, the sentinel where no
    push is pending); ``p_flags``: int32 ``[2]`` of this rank, the epoch and the launch's arrivals."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    dtype: tl.constexpr = p_x.dtype.element_ty
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    epoch, base = epoch_base(p_flags, MAX_T, WORLD, D)
    w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    for t_i in range(pid, n_tokens, grid):
        t = tl.full((), 0, tl.int64) + t_i  # int64 offsets (the interpreter's loop index is a Python int)
        x = tl.load(p_x + t * stride_x + o_d, mask=m_d, other=0.0)
        push_row(p_bufs, x, base, RANK, t, MAX_T, o_d, m_d, WORLD, D)
        s = pull_sum(p_bufs, base, RANK, t, MAX_T, o_d, m_d, dtype, WORLD, D, BLOCK_D)
        p_r = p_res + t * stride_res + o_d
        s += tl.load(p_r, mask=m_d, other=0.0).to(tl.float32)
        tl.store(p_r, s.to(p_res.dtype.element_ty), mask=m_d)
        var = tl.sum(s * s, axis=0) / D
        out = s * tl.math.rsqrt(var + eps) * w
        tl.store(p_out + t * stride_out + o_d, out.to(p_out.dtype.element_ty), mask=m_d)
    flip_epoch(p_flags, epoch, grid)


# this process's workspaces, by TP group name (vLLM's ``GroupCoordinator.unique_name``)
WORKSPACES: dict[str, "ArNormWorkspace"] = {}


def _before_211() -> bool:
    """Whether this torch predates 2.11 (which enables symmetric memory for every group by itself)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 11)


class ArNormWorkspace:
    """The symmetric buffers ``[2, world, max_tokens, hidden]`` (two epochs; each rank's plane of every row) of one TP
    group and this rank's epoch flags, made once (a collective: every rank of ``group`` calls it)."""

    def __init__(self, max_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, group,
                 programs: int | None = None) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        world = dist.get_world_size(group)
        self.buf = symm_mem.empty((2, world, max_tokens, hidden), dtype=dtype, device=device)
        self.buf.fill_(-0.0)  # the sentinel everywhere before any rank pushes
        name = group.group_name if hasattr(group, "group_name") else group
        if _before_211() and hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous there
            symm_mem.enable_symm_mem_for_group(name)  # (torch 2.11 deprecates it: a FutureWarning per workspace)
        self.handle = symm_mem.rendezvous(self.buf, name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        self.max_tokens, self.hidden = max_tokens, hidden
        # a program an SM at most: every program of a launch is resident, so each rank's program p waits only on the
        # other ranks' program p, which runs too (the grids are alike on every rank)
        self.programs = programs or torch.cuda.get_device_properties(device).multi_processor_count
        # the ranks' buffer addresses as an int64 device array (the kernel loads rank r's, then casts it)
        self.buf_ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.flags = torch.zeros(2, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's sentinels are in place before a first push


def allreduce_add_rms_norm(ws: ArNormWorkspace, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = rms_norm(sum over ranks of x + residual) * weight``; ``residual`` is updated in place to the sum (every
    rank calls it with its partial ``x``, in the same order as every other collective of the group)."""
    t, d = x.shape
    assert d == ws.hidden and t <= ws.max_tokens and x.dtype == ws.buf.dtype, (x.shape, x.dtype)
    assert x.stride(-1) == 1 and residual.stride(-1) == 1
    if out is None:
        out = torch.empty_like(residual)
    if t == 0:
        return out
    block_d = next_power_of_2(d)
    _ar_norm_kernel[(min(t, ws.programs),)](  # the steered norm's warps: its reduction order, as merged into it next
        ws.buf_ptrs, ws.flags, x, residual, weight, out, t, x.stride(0), residual.stride(0), out.stride(0), eps, D=d,
        BLOCK_D=block_d, RANK=ws.rank, WORLD=ws.world, MAX_T=ws.max_tokens, num_warps=_num_warps(block_d))
    return out
