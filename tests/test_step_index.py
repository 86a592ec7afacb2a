"""The token -> row index of a step built from request slots (the V2 runner's path): the reference
``step_index_naive`` against a token-by-token reading of the rule, padding, and the per-slot table
(``SlotRows``) that feeds it, copied to the device only when a request's rows changed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_steer.kernels.step_index.naive import step_index_naive
from vllm_steer.runtime.pinned_ring import PinnedRing
from vllm_steer.runtime.slot_rows import SlotRows


def random_step(seed: int, max_slots: int = 12):
    """A batch in vLLM's V2 layout: a permutation of slots, each with a prompt length, tokens computed
    so far and tokens scheduled now (prefill chunks, a chunk crossing the prompt's end, decodes)."""
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, max_slots))
    slots = rng.permutation(max_slots)[:num_reqs]
    slot_rows = np.zeros((max_slots, 4), np.int32)
    slot_rows[:, :2] = rng.integers(0, 9, size=(max_slots, 2))
    slot_rows[rng.random(max_slots) < 0.3, :2] = 0  # unsteered requests
    slot_rows[:, 2] = rng.integers(1, 40, size=max_slots)
    computed = [int(rng.integers(0, slot_rows[s, 2] + 5)) for s in slots]
    scheduled = [int(rng.integers(1, 30)) for _ in slots]
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, scheduled)])
    return num_reqs, slots.astype(np.int32), qsl, positions.astype(np.int64), slot_rows


def expected(num_reqs, slots, qsl, positions, slot_rows) -> list[int]:
    out = []
    for b in range(num_reqs):
        pre, dec, plen, _ = slot_rows[slots[b]]
        out += [int(pre if positions[t] < plen else dec) for t in range(qsl[b], qsl[b + 1])]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_reference_index_is_the_prefill_or_decode_row_of_each_token(seed):
    num_reqs, slots, qsl, positions, slot_rows = random_step(seed)
    n = int(qsl[num_reqs])
    index = torch.full((n + 40,), 7, dtype=torch.int32)
    step_index_naive(index, torch.from_numpy(slots), torch.from_numpy(qsl), torch.from_numpy(positions),
                     torch.from_numpy(slot_rows), num_reqs, n + 24)
    assert index[:n].tolist() == expected(num_reqs, slots, qsl, positions, slot_rows)
    assert index[n:n + 24].tolist() == [0] * 24  # graph padding: row 0
    assert index[n + 24:].tolist() == [7] * 16  # past the padding: untouched


def test_a_prompt_chunk_crossing_the_prompt_end_switches_rows_at_the_first_generated_token():
    slot_rows = torch.tensor([[0, 0, 0, 0], [3, 5, 4, 0]], dtype=torch.int32)
    index = torch.zeros(8, dtype=torch.int32)
    # slot 1: 2 tokens computed, 6 scheduled (positions 2..7), prompt of 4 -> 2 prefill, then decode rows
    step_index_naive(index, torch.tensor([1], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32),
                     torch.arange(2, 8), slot_rows, 1, 6)
    assert index[:6].tolist() == [3, 3, 5, 5, 5, 5]


def test_slot_rows_reach_the_device_table_only_when_they_changed():
    slots = SlotRows(6, torch.device("cpu"))
    slots.set(2, (0, 0), 10)  # unsteered into a clear slot: nothing to do
    assert not slots._dirty
    slots.set(4, (3, 7), 12)
    slots.set(1, (0, 2), 5)
    slots.sync()
    assert slots.device.tolist() == slots.host.tolist()
    assert slots.device[4].tolist() == [3, 7, 12, 0] and slots.device[1].tolist() == [0, 2, 5, 0]
    copies = slots._ring._cursor
    slots.sync()  # nothing changed since: no copy
    assert slots._ring._cursor == copies
    slots.clear(4)
    slots.clear(3)  # never steered: nothing to clear
    slots.sync()
    assert slots._ring._cursor == copies + 1
    assert slots.device[4].tolist() == [0, 0, 0, 0] and slots.device[1].tolist() == [0, 2, 5, 0]


def test_pinned_ring_lands_the_filled_prefix_in_order():
    ring = PinnedRing((8,), torch.int32, torch.device("cpu"), slots=2)
    dst = torch.full((8,), -1, dtype=torch.int32)
    for k in range(5):  # the ring wraps: every stage still lands what was written into it
        buf, land = ring.stage()
        buf[:3] = (k, k + 1, k + 2)
        land(dst[:3])
        assert dst.tolist() == [k, k + 1, k + 2] + [-1] * 5


def test_the_start_up_launch_passes_the_tensors_a_v2_step_passes(monkeypatch):
    """Triton compiles one kernel per argument dtype and alignment: the start-up launch must use what vLLM's V2
    runner passes each step (its InputBuffers' ``query_start_loc`` and ``positions``, an int32 ``idx_mapping``),
    or the first steered step compiles another during inference (an engine error under ``--jit-monitor-mode
    error``; s40's servers logged the warning)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.kernels.launch_cache import spec_of
    from vllm_steer.runtime import manager

    calls = []
    monkeypatch.setattr(manager, "step_index", lambda *args: calls.append(args))
    buffers = InputBuffers(max_num_reqs=4, max_num_tokens=16, device=torch.device("cpu"))
    rt = SimpleNamespace(tables=SimpleNamespace(index=torch.zeros(16, dtype=torch.int32)))
    slots = SlotRows(4, torch.device("cpu"))
    manager.SteeringRuntime.index_on_device_warmup(rt, slots, buffers)
    manager.SteeringRuntime.index_on_device_warmup(rt, slots)  # a runner without input buffers: vLLM 0.26's dtypes
    batch = InputBatch.make_dummy(3, 7, buffers)  # a step's tensors, as vLLM builds them
    step = spec_of((batch.idx_mapping, batch.query_start_loc, batch.positions))
    assert [spec_of(c[1:4]) for c in calls] == [step, step]
    assert [c[5:] for c in calls] == [(0, 0), (0, 0)]  # no request, no padding: nothing written
