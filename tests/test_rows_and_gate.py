"""Row allocation (worker) and the scheduler's capacity gate, without an engine."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_steer.core.payload import PAYLOAD_KEY, ModuleRef, SteerPayload, encode_payload

import pytest

from vllm_steer.runtime.rows import RowAllocator, RowsExhaustedError
from vllm_steer.engine.row_gate import RowGate


def test_allocator_shares_rows_for_identical_configs_and_reuses_released_contents():
    rows = RowAllocator(3)  # rows 1, 2 usable
    a, write_a, live_a = rows.acquire("A")
    assert (a, write_a, live_a) == (1, True, True)
    assert rows.acquire("A") == (1, False, False)  # shared, refcounted
    b = rows.acquire("B")[0]
    assert b == 2
    with pytest.raises(RowsExhaustedError):
        rows.acquire("C")
    assert rows.release("A") is False and rows.release("A") is True
    assert rows.acquire("A") == (1, False, True)  # still resident: no rewrite
    rows.release("A")
    c, write_c, _ = rows.acquire("C")  # evicts A's released row
    assert (c, write_c) == (1, True)
    assert rows.release("C") is True
    assert rows.acquire("A") == (1, True, True)  # A was evicted: written again


def _req(gate: RowGate, rid: str, *keys: str):
    """A request arriving at the scheduler (the gate notes steered ones), as the queue holds it."""
    gate.arrive(rid, tuple(dict.fromkeys(keys)))
    return SimpleNamespace(request_id=rid)


def test_gate_holds_back_requests_whose_new_configs_do_not_fit():
    gate = RowGate(capacity=2)
    reqs = [_req(gate, "a", "K1"), _req(gate, "u"), _req(gate, "b", "K2"), _req(gate, "c", "K3"),
            _req(gate, "d", "K1")]
    assert set(gate.waiting) == {"a", "b", "c", "d"}  # the unsteered request never involves the gate
    held = gate.select_held(reqs)
    assert [r.request_id for r in held] == ["c"]  # K1, K2 fit; K3 would be a third; d shares K1
    gate.admit_scheduled(["a", "u", "b"])
    assert set(gate.waiting) == {"c", "d"} and gate.live_keys == 2
    assert [r.request_id for r in gate.select_held(reqs)] == ["c"]
    gate.release("a")  # K1 is no longer live: c's K3 fits now, and d's K1 would be a third row
    assert [r.request_id for r in gate.select_held(reqs)] == ["d"]


def test_gate_counts_prefill_and_decode_configs_of_one_request():
    gate = RowGate(capacity=2)
    gate.admit("x", ("P1",))
    assert [r.request_id for r in gate.select_held([_req(gate, "y", "P2", "D2")])] == ["y"]
    assert gate.select_held([_req(gate, "z", "P1", "D2")]) == []


def test_gate_forgets_a_waiting_request_that_is_freed_before_it_runs():
    gate = RowGate(capacity=1)
    _req(gate, "w", "K1")
    gate.release("w")  # aborted while waiting
    assert gate.waiting == {} and gate.live_keys == 0


def _bf16_rows(layers: tuple, values) -> tuple:
    """A hook's entry in table layout: (layer ids, the rows' bfloat16 bytes)."""
    import torch

    return layers, values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def test_table_rows_written_per_layer_and_cleared_on_overwrite():
    import torch

    from vllm_steer.runtime.tables import SteeringTables

    hooked = {"pre_attn": [0, 2, 5], "post_mlp": [1, 2]}
    t = SteeringTables(hooked, num_rows=4, hidden_size=8, max_num_tokens=16, dtype=torch.bfloat16,
                       device=torch.device("cpu"))
    full = torch.arange(24, dtype=torch.float32).view(3, 8)
    t.write_row(1, {"pre_attn": _bf16_rows((0, 2, 5), full)})  # every hooked layer, in order
    assert torch.equal(t.table["pre_attn"][1], full.to(torch.bfloat16))
    assert not t.table["post_mlp"].any()  # a hook the row does not use is never touched
    # unordered, partial, and a layer this engine does not hook (3): placed by layer, rest zero
    part = torch.tensor([[1.0] * 8, [2.0] * 8, [3.0] * 8])
    t.write_row(1, {"pre_attn": _bf16_rows((5, 3, 0), part), "post_mlp": _bf16_rows((2,), part[:1])})
    expect = torch.zeros(3, 8)
    expect[2], expect[0] = 1.0, 3.0
    assert torch.equal(t.table["pre_attn"][1].float(), expect)
    assert torch.equal(t.table["post_mlp"][1].float(), torch.tensor([[0.0] * 8, [1.0] * 8]))
    t.write_row(1, {})  # overwrite with nothing: the old vectors are cleared
    assert not t.table["pre_attn"].any() and not t.table["post_mlp"].any()
    assert not t.table["pre_attn"][0].any()  # row 0 stays the zero no-op throughout


def test_every_view_handed_to_the_model_is_16_byte_aligned():
    """Inductor reuses one compiled piece for every layer and copies inputs that are less aligned
    than the first layer's: each table and flag view must start on a 16-byte boundary."""
    import torch

    from vllm_steer.runtime.tables import SteeringTables

    hooked = {"pre_attn": list(range(7)), "post_mlp": [1, 4, 6]}
    t = SteeringTables(hooked, num_rows=5, hidden_size=24, max_num_tokens=16, dtype=torch.bfloat16,
                       device=torch.device("cpu"))
    for hook, layers in hooked.items():
        for layer in layers:
            table, flag = t.layer_views(hook, layer)
            assert table.shape == (5, 24) and flag.shape == (1,)
            assert table.data_ptr() % 16 == 0 and flag.data_ptr() % 16 == 0, (hook, layer)
    t.write_row(2, {"post_mlp": _bf16_rows((4,), torch.ones(1, 24))})
    t.set_live(2, True)
    assert [int(t.layer_views("post_mlp", l)[1]) for l in (1, 4, 6)] == [0, 1, 0]
    assert torch.equal(t.layer_views("post_mlp", 4)[0][2], torch.ones(24, dtype=torch.bfloat16))


def test_module_users_counts_unfinished_requests_by_module_name():
    from vllm_steer.engine.module_rpc import module_users

    def req(module):
        payload = SteerPayload("k", "k", module=ModuleRef(module, 1, 1.0) if module else None)
        return SimpleNamespace(sampling_params=SimpleNamespace(extra_args={PAYLOAD_KEY: encode_payload(payload)}))

    plain = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None))
    pooling = SimpleNamespace(sampling_params=None)
    assert module_users([req("a"), req("b"), req("a"), req(None), plain, pooling]) == {"a": 2, "b": 1}
    assert module_users([]) == {}
