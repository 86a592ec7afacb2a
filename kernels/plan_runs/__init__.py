"""plan_runs: ``plan[flat[i] + j] = rows[i] + j`` (or -1: a reset) for ``j < lens[i]``, each of ``n`` runs (the
capture plan's upload, ``runtime/capture_plan.py``)."""

import torch

from vllm_steer.kernels.plan_runs.naive import write_runs_naive


def write_runs(plan: torch.Tensor, runs: torch.Tensor, n: int, reset: bool = False) -> None:
    """``runs``: int64 ``[>= 3n]`` on ``plan``'s device, the runs' first cells, first rows and lengths one after
    another; ``plan``: int32, flat. CUDA: the Triton kernel (one launch, no host sync); CPU: the plain-torch
    reference."""
    if n == 0:
        return
    if plan.is_cuda:
        from vllm_steer.kernels.plan_runs.triton import write_runs_triton

        write_runs_triton(plan, runs, n, reset)
    else:
        write_runs_naive(plan, runs, n, reset)
