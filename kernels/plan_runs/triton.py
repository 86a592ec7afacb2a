"""Triton plan_runs: one program per run stores its cells (``rows[i] + j``, or -1) in blocks of ``BLOCK``; the runs
are read on the device, so the host sends 3 words a run and launches once (no per-cell host work, no sync)."""

import torch
import triton
import triton.language as tl

_BLOCK = 512


@triton.jit(do_not_specialize=["n"])  # one compiled kernel per RESET for every count of runs (warmed at start-up)
def _write_runs_kernel(p_plan, p_runs, n, RESET: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    flat = tl.load(p_runs + i)
    row = tl.load(p_runs + n + i)
    length = tl.load(p_runs + 2 * n + i)
    o = tl.arange(0, BLOCK)
    for j0 in range(0, length, BLOCK):
        j = j0 + o
        if RESET:
            v = tl.full((BLOCK,), -1, tl.int32)
        else:
            v = (row + j).to(tl.int32)
        tl.store(p_plan + flat + j, v, mask=j < length)


def write_runs_triton(plan: torch.Tensor, runs: torch.Tensor, n: int, reset: bool = False) -> None:
    if n == 0:
        return
    _write_runs_kernel[(n,)](plan, runs, n, RESET=reset, BLOCK=_BLOCK, num_warps=4)
