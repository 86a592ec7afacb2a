"""Clamp-only SAE packs (the layout of kernels/sae_clamp/packed.py) built by hand, for the kernel tests.

Rows (R = 6) are laid out so every case the kernel distinguishes is present:

- row 0: the no-op row (mode OFF, no codes);
- row 1: DELTA, slot j gets code ``j % 7 + 1``: every kind, with and without only_if_active;
- row 2: OFF although it has codes (the codes must be ignored);
- row 3: DELTA with no codes (the stream must come back bit for bit);
- row 4: DELTA, only the last slot and slot 31 clamped (SET): the ends of the blocks of codes;
- row 5: DELTA, random codes (about half the slots clamped).
"""

from __future__ import annotations

import torch

R = 6
ROW_OFF, ROW_BARE = 2, 3
IDLE_ROWS = (0, ROW_OFF, ROW_BARE)  # rows whose tokens must equal the no-SAE kernel exactly


def clamp_pack(d: int, c: int, seed: int, jumprelu: bool = True, device: str | torch.device = "cpu",
               hidden_scale: float = 3.0) -> list[torch.Tensor]:
    """[mode, code, value, enc, dec, bias, thr, features] for ``c`` clampable features of a random SAE
    with hidden size ``d``; ``hidden_scale`` is about the stream's per-element std (so pre ~ O(1..5))."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randn(c, d, generator=g) * (1.5 / (hidden_scale * d ** 0.5))
    dec = torch.randn(c, d, generator=g) * 0.3
    bias = torch.randn(c, generator=g) * 0.5
    thr = torch.rand(c, generator=g) * 0.8 if jumprelu else torch.zeros(c)
    mode = torch.ones(R, dtype=torch.int32)
    mode[0] = mode[ROW_OFF] = 0
    code = torch.zeros(R, c, dtype=torch.int32)
    code[1] = torch.arange(c, dtype=torch.int32) % 7 + 1
    code[ROW_OFF] = torch.arange(c, dtype=torch.int32) % 3 + 1
    code[4, c - 1] = 1  # SET
    code[4, min(c, 32) - 1] = 1  # the last slot of the first block of codes (the kernel's BLOCK_C is 32)
    code[5] = torch.randint(0, 8, (c,), generator=g, dtype=torch.int32) * (torch.rand(c, generator=g) < 0.5)
    value = torch.randn(R, c, generator=g) * 3
    value[4, c - 1] = 4.0
    features = torch.randperm(4 * c, generator=g)[:c].sort().values
    pack = [mode, code, value.float(), enc, dec, bias, thr, features]
    return [t.to(device) for t in pack]


def token_rows(n: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """An index [n + 5] int32 that cycles through every row (so each row has tokens)."""
    return (torch.arange(n + 5, device=device) % R).to(torch.int32)


FULL_MODES = (0, 1, 0, 1, 2, 2)  # per row: OFF, DELTA (every kind), OFF with codes, DELTA bare, RECONSTRUCT x 2


def full_pack(d: int, f: int, c: int, seed: int, topk: int = 0, device: str | torch.device = "cpu",
              hidden_scale: float = 3.0, modes: tuple[int, ...] = FULL_MODES, thr_scale: float = 0.8
              ) -> list[torch.Tensor]:
    """A full pack (packed.py, 13 tensors) of a random SAE with ``f`` features (``c`` of them clampable, rows as
    ``clamp_pack``'s but for ``modes``; JumpReLU thresholds up to ``thr_scale``); w_enc / w_dec in bfloat16 as the engine stages them, the clampable
    copies their float32 values (so the reference and the kernels use the same weights)."""
    g = torch.Generator().manual_seed(seed + 1)
    pack = clamp_pack(d, c, seed, jumprelu=not topk)
    pack[0] = torch.tensor(modes, dtype=torch.int32)
    pack[7] = torch.randperm(f, generator=g)[:c].sort().values
    w_enc = (torch.randn(d, f, generator=g) * (1.5 / (hidden_scale * d ** 0.5))).bfloat16()
    w_dec = (torch.randn(f, d, generator=g) * 0.3).bfloat16()
    b_enc = torch.randn(f, generator=g) * 0.5
    thr_f = torch.zeros(f) if topk else torch.rand(f, generator=g) * thr_scale
    b_dec = torch.randn(d, generator=g) * 0.2
    feats = pack[7]
    pack[3:7] = [w_enc[:, feats].T.float().contiguous(), w_dec[feats].float(), b_enc[feats], thr_f[feats]]
    pack += [w_enc, b_enc, thr_f, w_dec, b_dec]
    return [t.to(device) for t in pack]


def prefill_rows(n: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """An index [n + 5] int32 laid out as a prefill step (n >= 64): decode tokens of rows 1, 4, 5, 0, 2, 3 (one each),
    a prompt of row 1 from token 6 (off a multiple of any tile size), an unsteered prompt (row 0), a prompt of row
    5, tokens of rows 2 (OFF) and 3 (no codes), the rest row 4, then padding (row 0). At n = 100: prompts of 37, 10
    and 40 tokens."""
    runs = [(1, 1), (4, 1), (5, 1), (0, 1), (2, 1), (3, 1), (1, 37 * n // 100), (0, n // 10), (5, 40 * n // 100),
            (2, 3), (3, 4)]
    rows = [r for r, k in runs for _ in range(k)]
    assert len(rows) <= n
    return torch.tensor(rows + [4] * (n - len(rows)) + [0] * 5, dtype=torch.int32, device=device)
