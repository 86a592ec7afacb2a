"""step_index on the GPU: the Triton kernel equals the plain-torch reference on random batches (prefill
chunks, chunks crossing the prompt's end, decodes, padding), with no host sync; the per-slot table
reaches the device through its pinned ring."""

from __future__ import annotations

import pytest
import torch

from tests.test_step_index import random_step
from vllm_steer.kernels.step_index.naive import step_index_naive
from vllm_steer.kernels.step_index.triton import step_index_triton
from vllm_steer.runtime.slot_rows import SlotRows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("seed", range(30))
def test_step_index_kernel_matches_reference(seed):
    num_reqs, slots, qsl, positions, slot_rows = random_step(seed, max_slots=300)
    args = [torch.from_numpy(a).cuda() for a in (slots, qsl, positions, slot_rows)]
    n = int(qsl[num_reqs])
    got, want = (torch.full((n + 300,), 9, dtype=torch.int32, device="cuda") for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step_index_triton(got, *args, num_reqs, n + 200)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    step_index_naive(want, *args, num_reqs, n + 200)
    assert torch.equal(got, want)


def test_long_prefill_chunk_and_slot_rows_through_the_ring():
    slots = SlotRows(8, torch.device("cuda"))
    slots.set(5, (4, 6), 1000)
    slots.sync()
    index = torch.full((3000,), 9, dtype=torch.int32, device="cuda")
    idx = torch.tensor([5], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 2048], dtype=torch.int32, device="cuda")
    pos = torch.arange(2048, dtype=torch.int64, device="cuda")
    step_index_triton(index, idx, qsl, pos, slots.device, 1, 2560)
    assert index[:1000].eq(4).all() and index[1000:2048].eq(6).all()
    assert index[2048:2560].eq(0).all() and index[2560:].eq(9).all()
    for k in range(10):  # more changes than ring slots, no waits: the device follows every one
        slots.set(5, (k, k + 1), 1000)
        slots.sync()
    step_index_triton(index, idx, qsl, pos, slots.device, 1, 2048)
    assert index[:1000].eq(9).all() and index[1000:2048].eq(10).all()
