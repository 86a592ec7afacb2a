"""Plain-torch reference of capture_reduce's segmented add: the spec the Triton kernel is tested against."""

import torch


def segment_add_naive(
    acc: torch.Tensor,  # [S, D] float32: accumulator rows, added to in place
    pool: torch.Tensor,  # [P, D]: captured rows (model dtype)
    src: torch.Tensor,  # [>= off[n_seg]] int64: pool rows, segment by segment
    slot: torch.Tensor,  # [>= n_seg] int64: each segment's accumulator row (each at most once)
    off: torch.Tensor,  # [>= n_seg + 1] int64: segment s is src[off[s]:off[s + 1]]
    n_seg: int,
) -> None:
    if n_seg == 0:
        return
    bounds = off[: n_seg + 1]
    n = int(bounds[-1])  # host-side only: the CPU lane's path
    rows = torch.repeat_interleave(slot[:n_seg], bounds.diff())
    acc.index_add_(0, rows, pool.index_select(0, src[:n]).float())
