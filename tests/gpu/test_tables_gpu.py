"""Table rows written on the GPU through the pinned staging ring: every write lands, in order,
also when more rows are written back to back than the ring has slots (its fallback path)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_rows_written_through_the_staging_ring_land_exactly():
    from vllm_steer.runtime.tables import _STAGING_SLOTS, SteeringTables

    hooked = {"pre_attn": [0, 1, 2, 3], "post_mlp": [1, 3]}
    rows = 3 * _STAGING_SLOTS + 2
    t = SteeringTables(hooked, num_rows=rows + 1, hidden_size=256, max_num_tokens=16, dtype=torch.bfloat16,
                       device=torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    expect = {}
    slow = torch.randn(4096, 4096, device="cuda")
    for r in range(1, rows + 1):
        if r % 5 == 0:
            slow = slow @ slow  # keep the stream busy so some staging copies are still queued
            slow /= slow.norm()
        full = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
        part = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
        t.write_row(r, {"pre_attn": ((0, 1, 2, 3), full.view(torch.int16).numpy().tobytes()),
                        "post_mlp": ((3,), part.view(torch.int16).numpy().tobytes())})
        expect[r] = (full, torch.cat([torch.zeros(1, 256, dtype=torch.bfloat16), part]))
    torch.cuda.synchronize()
    for r, (full, post) in expect.items():
        assert torch.equal(t.table["pre_attn"][r].cpu(), full), r
        assert torch.equal(t.table["post_mlp"][r].cpu(), post), r
    assert not t.table["pre_attn"][0].any() and not t.table["post_mlp"][0].any()
