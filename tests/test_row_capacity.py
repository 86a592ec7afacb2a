"""Rows as a cache with a bounded wait (issue 25), without an engine: the worker's allocator evicts
cached configs (released ones, modules' pre-materialized rows) and never a held one; the scheduler
gate refuses a request only after ``max_row_wait_s`` without any row turning over; the engine's
module registry lets workers forget versions nothing uses; refusals round-trip through stop_reason."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_steer.core.refusals import Refusal, decode
from vllm_steer.engine.module_registry import EngineModuleRegistry
from vllm_steer.engine.row_gate import RowGate
from vllm_steer.runtime.rows import RowAllocator, RowsExhaustedError


def test_materialized_rows_are_a_cache_evicted_lru_and_never_a_held_row():
    rows = RowAllocator(4)  # rows 1..3
    assert rows.materialize("M1") == 1 and rows.materialize("M2") == 2 and rows.materialize("M3") == 3
    assert rows.materialize("M1") is None  # resident: nothing to write
    assert rows.acquire("M2") == (2, False, True)  # a module request finds its row written
    row, write, _ = rows.acquire("X")  # a new config evicts the least recently cached (M1)
    assert (row, write, rows.evictions) == (1, True, 1)
    assert rows.acquire("M1") == (3, True, True) and rows.evictions == 2  # M1 rebuilt in M3's row
    with pytest.raises(RowsExhaustedError):  # all three held by running requests: the gate's job
        rows.acquire("Y")
    assert rows.materialize("Z") is None  # nothing evictable: not materialized, built on demand
    rows.release("X")
    assert rows.materialize("Z") == 1 and rows.evictions == 3


def _held(gate: RowGate, rid: str, *keys: str):
    gate.arrive(rid, keys)
    return SimpleNamespace(request_id=rid)


def test_gate_refuses_only_after_the_bound_with_no_row_turning_over(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    gate = RowGate(capacity=1, max_wait_s=10.0)
    gate.arrive("a", ("K1",))
    gate.admit_scheduled(["a"])  # K1 live at t=100: a turnover
    b = _held(gate, "b", "K2")
    assert gate.select_held([b]) == [b]
    assert gate.split_expired([b], 105.0) == ([b], [])
    clock[0] = 108.0
    gate.release("a")  # K1 done at t=108: rows turned over, so b keeps waiting past t=110
    gate.arrive("c", ("K3",))
    gate.admit_scheduled(["c"])  # another config took the row
    assert gate.split_expired([b], 115.0) == ([b], [])  # 15 s waited, but the last turnover was 7 s ago
    keep, expired = gate.split_expired([b], 118.5)  # 10.5 s without a turnover: refused
    assert (keep, expired, gate.wait_timeouts) == ([], [b], 1)
    late = _held(gate, "d", "K4")  # arrived during the drought: waits its own full bound
    assert gate.split_expired([late], 118.5) == ([late], [])


def test_gate_with_zero_wait_refuses_at_once_when_rows_are_stuck():
    gate = RowGate(capacity=1, max_wait_s=0.0)
    gate.admit("a", ("K1",))
    b = _held(gate, "b", "K2")
    assert gate.split_expired(gate.select_held([b]), time.monotonic()) == ([], [b])


def test_registry_forgets_versions_no_entry_and_no_request_uses():
    reg = EngineModuleRegistry()
    reg.record("m", 1, {}, {})
    reg.record("m", 2, {}, {})  # replaced
    reg.record("n", 3, {}, {})
    assert reg.retire(in_use={("m", 1)}) == []  # m@1 still used by an unfinished request
    assert reg.holds("m", 1)
    assert reg.retire(in_use=set()) == [("m", 1)] and not reg.holds("m", 1)
    reg.remove("n")
    assert reg.retire(in_use=set()) == [("n", 3)] and reg.holds("m", 2)


def test_refusal_travels_as_a_stop_reason():
    r = Refusal(503, None, "no steering-table row: retry: later")
    assert decode(r.encode()) == r
    r = Refusal(400, "steering_module.name", "gone")
    assert decode(r.encode()) == r
    assert decode("</s>") is None and decode(7) is None and decode(None) is None


def test_rows_that_overflow_the_model_dtype_are_refused_by_the_layout():
    from vllm_steer.core.layout import table_layout

    v = {"post_mlp": {3: np.full(8, 70000.0, np.float32)}}
    table_layout(v, "float32")  # fits float32 and bfloat16
    table_layout(v, "bfloat16")
    with pytest.raises(ValueError, match="float16.*65504"):
        table_layout(v, "float16")
    with pytest.raises(ValueError, match="float32"):
        table_layout({"post_mlp": {3: np.full(8, 3e38, np.float32) * np.float32(10)}}, "float32")


def test_numbers_outside_float32_are_refused_naming_the_field():
    from vllm_steer.core.errors import SteeringSpecError
    from vllm_steer.frontend.spec import finite_number

    assert finite_number("x", 3e38) == 3e38
    with pytest.raises(SteeringSpecError, match="overflows float32") as e:
        finite_number("steering_module.scale", 1e39)
    assert e.value.field == "steering_module.scale"
