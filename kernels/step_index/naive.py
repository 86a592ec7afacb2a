"""Plain-torch reference of step_index: the spec the Triton kernel is tested against (and the CPU path)."""

import torch


def step_index_naive(
    index: torch.Tensor,  # [>= T] int32, written for tokens [0, T), T = query_start_loc[num_reqs]
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32: batch position -> request slot
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32: first token of each batch position
    positions: torch.Tensor,  # [>= T] int32 / int64: each token's position in its sequence
    slot_rows: torch.Tensor,  # [S, 4] int32 per slot: prefill row, decode row, prompt length, unused
    num_reqs: int,
    pad_end: int,  # tokens [T, pad_end) are padding (CUDA-graph sizes): row 0
) -> None:
    qsl = query_start_loc[: num_reqs + 1].long()
    n_tokens = int(qsl[-1])
    index[n_tokens:pad_end] = 0
    if n_tokens == 0:
        return
    request = torch.repeat_interleave(torch.arange(num_reqs, device=index.device), qsl[1:] - qsl[:-1])
    rows = slot_rows[idx_mapping[:num_reqs].long()[request]]  # [T, 4]
    prefill = positions[:n_tokens] < rows[:, 2]
    index[:n_tokens] = torch.where(prefill, rows[:, 0], rows[:, 1]).to(index.dtype)
