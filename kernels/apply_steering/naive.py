"""Plain-torch reference of apply_steering: the spec the Triton kernel is tested against."""

import torch


def apply_steering_naive(
    hidden: torch.Tensor,  # [N, D], modified in place
    table: torch.Tensor,  # [R, D], row 0 is all zeros
    index: torch.Tensor,  # [>= N] int32, row of each token
    active: torch.Tensor,  # [1] uint8, 0 when every row of the table is zero
) -> None:
    n = hidden.shape[0]
    rows = table.index_select(0, index[:n].to(torch.long))
    hidden.add_(rows.to(hidden.dtype))
