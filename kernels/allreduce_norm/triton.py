"""One launch per norm across the TP ranks of one node: each rank's partial sum ``x`` (o_proj's or down_proj's
output before vLLM's all-reduce) is pushed into every rank's symmetric buffer, a per-program barrier over the ranks'
signal pads (``torch.distributed._symmetric_memory``) says every row arrived, and each rank adds the ranks' rows in
rank order in float32 (the same bits on every rank), adds the residual and normalizes: vLLM's all-reduce + fused add
+ RMSNorm in one kernel, as FlashInfer's fused all-reduce does for stock at TP >= 2, so a steered norm can keep
stock's kernel count under TP (NOTES issue 40, give-back C). A second barrier at the end keeps the next launch's
pushes off rows a slower rank still reads.

Programs: ``min(T, pad slots)``, each walking rows ``pid, pid + G, ...`` (every program is resident: a program waits
only on the same program of the other ranks). The signal pads are used as in PyTorch's symmetric-memory kernels: a
0 -> 1 compare-and-swap on the peer's slot (release, system scope) signals, a 1 -> 0 one on one's own slot (acquire)
waits, so the pads are zero between launches and CUDA graphs replay them as they are.

Not wired into the engine yet: ``ArNormWorkspace`` and ``allreduce_add_rms_norm`` are the kernel's host side for its
GPU test and bench (``tests/gpu/test_allreduce_norm_gpu.py``, ``bench/allreduce_norm_bench.py``, two GPUs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _barrier(p_pads, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    """``p_pads``: int64 ``[WORLD]``, each rank's signal pad address. Every rank's program ``slot`` has reached this point (and, with the CTA barrier before it, this program's
    earlier stores are visible to them)."""
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        peer = tl.load(p_pads + r).to(tl.pointer_type(tl.uint32))
        while tl.atomic_cas(peer + slot * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
            pass
    mine = tl.load(p_pads + RANK).to(tl.pointer_type(tl.uint32))
    for r in tl.static_range(WORLD):
        while tl.atomic_cas(mine + slot * WORLD + r, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@triton.jit
def _ar_norm_kernel(p_bufs, p_pads, p_x, p_res, p_w, p_out, n_tokens, stride_x, stride_res, stride_out, eps,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                    MAX_T: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    own = tl.load(p_bufs + RANK).to(tl.pointer_type(p_x.dtype.element_ty))
    w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    for t_i in range(pid, n_tokens, grid):
        t = tl.full((), 0, tl.int64) + t_i  # int64 offsets (the interpreter's loop index is a Python int)
        x = tl.load(p_x + t * stride_x + o_d, mask=m_d, other=0.0)
        for r in tl.static_range(WORLD):  # push: row t of rank RANK's plane in every rank's buffer
            peer = tl.load(p_bufs + r).to(tl.pointer_type(p_x.dtype.element_ty))
            tl.store(peer + (RANK * MAX_T + t) * D + o_d, x, mask=m_d)
        _barrier(p_pads, pid, RANK, WORLD)
        s = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: the same sum on every rank
            s += tl.load(own + (r * MAX_T + t) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        p_r = p_res + t * stride_res + o_d
        s += tl.load(p_r, mask=m_d, other=0.0).to(tl.float32)
        s_low = s.to(p_res.dtype.element_ty)
        tl.store(p_r, s_low, mask=m_d)
        var = tl.sum(s * s, axis=0) / D
        out = s * tl.math.rsqrt(var + eps) * w
        tl.store(p_out + t * stride_out + o_d, out.to(p_out.dtype.element_ty), mask=m_d)
        _barrier(p_pads, pid, RANK, WORLD)  # every rank read row t of this launch before a next one pushes


class ArNormWorkspace:
    """The symmetric buffer ``[world, max_tokens, hidden]`` (each rank's plane of every row) and the signal pads of
    one TP group, made once (a collective: every rank of ``group`` calls it)."""

    def __init__(self, max_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, group) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        world = dist.get_world_size(group)
        self.buf = symm_mem.empty((world, max_tokens, hidden), dtype=dtype, device=device)
        name = group.group_name if hasattr(group, "group_name") else group
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous in older releases
            symm_mem.enable_symm_mem_for_group(name)
        self.handle = symm_mem.rendezvous(self.buf, name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        self.max_tokens, self.hidden = max_tokens, hidden
        pad_bytes = getattr(self.handle, "signal_pad_size", 2048)
        self.programs = max(1, pad_bytes // 4 // self.world)  # a pad slot per (program, rank)
        # the ranks' buffer and pad addresses as int64 device arrays (the kernel loads rank r's, then casts it)
        self.buf_ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(list(self.handle.signal_pad_ptrs), dtype=torch.int64, device=device)


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
    block_d = triton.next_power_of_2(d)
    _ar_norm_kernel[(min(t, ws.programs),)](
        ws.buf_ptrs, ws.pad_ptrs, x, residual, weight, out, t, x.stride(0),
        residual.stride(0), out.stride(0), eps, D=d, BLOCK_D=block_d, RANK=ws.rank, WORLD=ws.world,
        MAX_T=ws.max_tokens, num_warps=4 if block_d <= 2048 else 8 if block_d <= 8192 else 16)
    return out
