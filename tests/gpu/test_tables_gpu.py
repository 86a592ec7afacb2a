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


def test_projection_and_sae_rows_are_written_without_a_host_sync(tmp_path):
    """Rows of the projection and SAE clamp tables (written when a config is admitted, while the forward of
    the step before runs) go through pinned staging buffers: no write synchronises with the device (a pageable
    host -> device copy would wait for the queued work), and every write lands, more back to back than the
    rings have slots, with the stream kept busy."""
    import numpy as np

    from vllm_steer.core.sae_catalog import Slot
    from vllm_steer.core.sae_paths import runtime_access
    from vllm_steer.core.sae_rows import DELTA, SET, wire_entry
    from vllm_steer.runtime.pinned_ring import SLOTS
    from vllm_steer.runtime.projection_tables import ProjectionTables
    from vllm_steer.runtime.sae_tables import SaeTables

    d, k, rows, site = 256, 2, 3 * SLOTS + 2, ("post_mlp", 3)
    proj = ProjectionTables({("post_mlp", 1), site}, rows + 1, k, d, torch.device("cuda"))
    sae = SaeTables({}, {site: Slot(48)}, {site}, rows + 1, d, torch.device("cuda"), runtime_access((str(tmp_path),), 1))
    rng = np.random.default_rng(0)
    slow = torch.randn(4096, 4096, device="cuda")
    expect = {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in range(1, rows + 1):
            if r % 3 == 0:
                slow = slow @ slow  # queued work a synchronising copy would wait for
                slow /= slow.norm()
            n = 1 + r % k
            dirs = rng.standard_normal((n, d)).astype(np.float32)
            bounds = rng.standard_normal((n, 2)).astype(np.float32)
            slots = rng.choice(48, size=5, replace=False).astype(np.int32)
            values = rng.standard_normal(5).astype(np.float32)
            proj.write_row(r, [("post_mlp", 1, dirs.tobytes(), bounds.tobytes())] if r % 2 else
                           [(*site, dirs.tobytes(), bounds.tobytes())])
            sae.write_row(r, [wire_entry("s", *site, DELTA, slots, np.full(5, SET, np.int32), values)])
            expect[r] = (n, dirs, bounds, slots, values)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for r, (n, dirs, bounds, slots, values) in expect.items():
        count, d_table, b_table = proj.descs[("post_mlp", 1) if r % 2 else site]
        assert count[r].item() == n, r
        assert torch.equal(d_table[r, :n].cpu(), torch.from_numpy(dirs)) and torch.equal(b_table[r, :n].cpu(),
                                                                                           torch.from_numpy(bounds))
        pack = sae.packs[site]
        assert pack[0][r].item() == DELTA
        code, value = np.zeros(48, np.int32), np.zeros(48, np.float32)
        code[slots], value[slots] = SET, values
        assert np.array_equal(pack[1][r].cpu().numpy(), code) and np.array_equal(pack[2][r].cpu().numpy(), value), r
    other = proj.descs[site if rows % 2 else ("post_mlp", 1)][0]
    assert other[rows].item() == 0  # a row's other site holds no projection
