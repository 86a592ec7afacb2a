"""Plain-torch reference of capture_rows: the spec the Triton kernel is tested against."""

import torch


def capture_rows_naive(
    pool: torch.Tensor,  # [P, D], rows written in place
    a: torch.Tensor,  # [N, D]
    b: torch.Tensor | None,  # [N, D] or None: the residual stream is a + b
    plan: torch.Tensor,  # [>= N] int32: pool row of token t, or -1
    table: torch.Tensor | None = None,  # [R, D]: steering rows already applied upstream at this point
    flag: torch.Tensor | None = None,  # [1] uint8
    index: torch.Tensor | None = None,  # [>= N] int32
) -> None:
    n = a.shape[0]
    rows = plan[:n].to(torch.long)
    take = (rows >= 0).nonzero().flatten()  # host-side only: the CPU lane's path
    if take.numel() == 0:
        return
    src = a.index_select(0, take).float()
    if b is not None:
        src = src + b.index_select(0, take).float()
    if table is not None and bool(flag[0]):
        src = src + table.index_select(0, index[:n].long().index_select(0, take)).float()
    pool.index_copy_(0, rows.index_select(0, take), src.to(pool.dtype))
