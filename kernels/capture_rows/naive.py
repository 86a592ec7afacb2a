"""Plain-torch reference of capture_rows: the spec the Triton kernel is tested against."""

import torch


def capture_rows_naive(
    pool: torch.Tensor,  # [P, D], rows written in place
    a: torch.Tensor,  # [N, D]: the residual stream at the captured point
    plan: torch.Tensor,  # [>= N] int32: pool row of token t, or -1
) -> None:
    n = a.shape[0]
    rows = plan[:n].to(torch.long)
    take = (rows >= 0).nonzero().flatten()  # host-side only: the CPU lane's path
    if take.numel() == 0:
        return
    pool.index_copy_(0, rows.index_select(0, take), a.index_select(0, take).to(pool.dtype))
