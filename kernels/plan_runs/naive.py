"""Plain-torch reference of plan_runs: the spec the Triton kernel is tested against (and the CPU lane's path)."""

import torch


def write_runs_naive(plan: torch.Tensor, runs: torch.Tensor, n: int, reset: bool = False) -> None:
    """``plan[flat[i] + j] = -1 if reset else rows[i] + j`` for ``j < lens[i]``, ``i < n`` (``runs``: flat, rows,
    lens, ``n`` each). Runs do not overlap. Reads the lengths on the host (the CPU lane's path only)."""
    if n == 0:
        return
    flat, rows, lens = runs[:n], runs[n : 2 * n], runs[2 * n : 3 * n]
    m = int(lens.sum())
    first = torch.cumsum(lens, 0) - lens
    offset = torch.arange(m, dtype=torch.int64, device=plan.device) - torch.repeat_interleave(first, lens, output_size=m)
    cells = torch.repeat_interleave(flat, lens, output_size=m) + offset
    if reset:
        plan.index_fill_(0, cells, -1)
    else:
        plan.index_copy_(0, cells, (torch.repeat_interleave(rows, lens, output_size=m) + offset).to(plan.dtype))
