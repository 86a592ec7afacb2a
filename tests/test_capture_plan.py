"""Capture planning against a plain reference (CPU, no engine): random batches of prefill chunks and
decode steps, preempted requests recomputing, a pool that overflows, several consumers sharing sites,
explicit positions and sites another rank hooks. Each step the device plan (updated sparsely) must
equal the reference's dense plan, and the entries, drops and counters must match it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_steer.capture.consumer import CaptureConsumer
from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod

HOOKS = ("pre_attn", "post_attn", "post_mlp")
NUM_LAYERS = 4


class Sink(CaptureConsumer):
    location = "worker"

    def __init__(self, instance: str, **params) -> None:
        pass

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        pass

    def on_request_finished(self, request_id, meta):
        return None


_MADE: list = []


@pytest.fixture(autouse=True)
def _close_runtimes():
    """Each runtime's consumers' process ends with its test (none left behind for the rest of the run)."""
    yield
    while _MADE:
        _MADE.pop().close()


def _runtime(monkeypatch, sites, max_rows, max_tokens):
    monkeypatch.setattr(capture_mod, "consumer_class", lambda name: Sink)
    cfg = SteerConfig.model_validate({"capture": ["a", "b", "c"], "capture_max_rows": max(max_rows, 16),
                                      "hooks": list(HOOKS)})
    rt = capture_mod.CaptureRuntime(cfg, sites, NUM_LAYERS, max_tokens, 8, torch.float32, torch.device("cpu"))
    rt._planner.max_rows = max_rows  # below the config's floor: overflow with few cells
    _MADE.append(rt)
    return rt


class Reference:
    """The plan as a plain loop per request, per token, per spec and per site (rows: requests in
    batch order, then sites in plan order, then tokens; a step's first row follows the last placed step's
    rows, or is 0 when they do not fit before ``max_rows``; a step planned as last step's cells keeps its rows)."""

    def __init__(self, sites, width, max_rows):
        self.site_index = {s: i for i, s in enumerate(sites)}
        self.width, self.max_rows = width, max_rows
        self.planned_upto: dict[str, int] = {}
        self.dropped: dict[str, list] = {}
        self.next_base = self.base = 0

    def step(self, reqs, req_ids, num_scheduled, num_computed, reused=False):
        plan, entries, rows, recomputed, dropped = self._step(reqs, req_ids, num_scheduled, num_computed)
        if not reused and rows:
            self.base = self.next_base if self.next_base + rows <= self.max_rows else 0
            self.next_base = self.base + rows
        plan[plan >= 0] += self.base
        return plan, entries, rows, recomputed, dropped

    def _step(self, reqs, req_ids, num_scheduled, num_computed):
        plan = np.full((len(self.site_index), self.width), -1, dtype=np.int32)
        entries, row, offset, recomputed, dropped = [], 0, 0, 0, 0
        for rid, n, first in zip(req_ids, num_scheduled.tolist(), num_computed.tolist()):
            if rid in reqs and n:
                prompt_len, specs = reqs[rid]
                upto = self.planned_upto.get(rid, 0)
                skip = min(max(upto - first, 0), n)
                self.planned_upto[rid] = max(upto, first + n)
                recomputed += skip
                cells: dict[int, dict[int, int]] = {}  # site -> token -> mask
                for j in range(skip, n):
                    p = first + j
                    for bit, spec in specs.items():
                        mode = spec.positions
                        want = {"all": True, "all_prompt": p < prompt_len, "all_generated": p >= prompt_len,
                                "last_prompt": p == prompt_len - 1}.get(mode) if isinstance(mode, str) else p in mode
                        if want:
                            for site in spec.sites:
                                if site in self.site_index:
                                    cell = cells.setdefault(self.site_index[site], {})
                                    cell[j] = cell.get(j, 0) | bit
                for s in sorted(cells):
                    toks = sorted(cells[s])
                    hook, layer = next(k for k, v in self.site_index.items() if v == s)
                    kept = toks[: max(self.max_rows - row, 0)]
                    for t in toks[len(kept):]:
                        self.dropped.setdefault(rid, []).append((hook, layer, first + t, cells[s][t]))
                        dropped += 1
                    if not kept:
                        continue
                    for i, t in enumerate(kept):
                        plan[s, offset + t] = row + i
                    entries.append((rid, layer, hook, [first + t for t in kept], row, [cells[s][t] for t in kept]))
                    row += len(kept)
            offset += n
        return plan, entries, row, recomputed, dropped


def _random_spec(rng, n_explicit_max, explicit=True):
    if rng.random() < 0.5:
        raw = {"layers": rng.sample(range(NUM_LAYERS), rng.randint(1, NUM_LAYERS)),
               "hooks": rng.sample(HOOKS, rng.randint(1, 3))}
    else:
        raw = {"sites": [f"{rng.choice(HOOKS)}.{rng.randrange(NUM_LAYERS)}" for _ in range(rng.randint(1, 3))]}
    mode = rng.choice(["all", "all_prompt", "all_generated", "last_prompt"] + ["explicit"] * explicit)
    raw["positions"] = (sorted(rng.sample(range(n_explicit_max), rng.randint(1, 6))) if mode == "explicit" else mode)
    return raw


@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "general"])
@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_the_reference(monkeypatch, seed, ranges):
    """Steps without explicit positions are planned from ranges (``ranges``) or by the general path: both
    equal the reference."""
    rng = random.Random(seed)
    all_sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    # this rank hooks a subset (another stage holds the rest): specs naming those are skipped here
    sites = all_sites if seed % 2 else [s for s in all_sites if s[1] < 3]
    max_rows, max_tokens = rng.choice([12, 40, 4096]), 64
    rt = _runtime(monkeypatch, sites, max_rows, max_tokens)
    rt._planner.ranges = ranges
    ref = Reference(sites, rt.buffers.plan.shape[1], max_rows)
    live: dict[str, dict] = {}  # rid -> prompt_len, computed, generated, specs (the reference's copy)
    next_id = 0
    steady = seed % 3 != 0  # a stable batch order, few arrivals and preemptions: steps repeat last step's cells
    for step in range(60):
        while len(live) < 6 and rng.random() < (0.15 if steady else 0.6):  # new requests, some capturing nothing
            rid, prompt_len = f"r{next_id}", rng.randint(1, 20)
            next_id += 1
            capture = {inst: _random_spec(rng, 30, not steady) for inst in ("a", "b", "c") if rng.random() < 0.6}
            if rng.random() < 0.3:  # two consumers on the same sites and positions: one row, two bits
                capture["b"] = capture["a"] = _random_spec(rng, 30, not steady)
            rt.add_request(rid, capture, prompt_len)
            req = rt._requests.get(rid)
            live[rid] = {"prompt_len": prompt_len, "computed": 0, "total": prompt_len,
                         "specs": req.specs if req is not None else {}}
        if not live:
            continue
        ids = list(live)
        if not steady:  # a batch in a new order every step
            rng.shuffle(ids)
        budget = 48
        req_ids, scheduled, computed = [], [], []
        for rid in ids:
            st = live[rid]
            if rng.random() < (0.01 if steady else 0.08) and st["computed"]:  # preempted: recomputes from 0 or a cached prefix
                st["computed"] = rng.choice([0, st["computed"] // 2])
            left = st["total"] - st["computed"]
            n = min(left, rng.randint(1, 16), budget) if left > 1 else 1
            if rng.random() < 0.05:  # in the batch with nothing scheduled: its mark stays
                n = 0
                req_ids.append(rid), scheduled.append(0), computed.append(st["computed"] + 2)
                continue
            if n <= 0 or budget <= 0:
                continue
            req_ids.append(rid), scheduled.append(n), computed.append(st["computed"])
            budget -= n
        # a request capture never heard of (steady: decoding too, so steps of decoding requests may advance)
        req_ids.append("not-capturing"), scheduled.append(1 if steady else 3), computed.append(step if steady else 5)
        scheduled, computed = np.array(scheduled, dtype=np.int32), np.array(computed, dtype=np.int32)
        before, reused = dict(rt.stats), rt._planner.reused
        rt.plan_step(req_ids, scheduled, computed)
        want_plan, want_entries, want_rows, want_recomputed, want_dropped = ref.step(
            {r: (live[r]["prompt_len"], live[r]["specs"]) for r in live if live[r]["specs"]},
            req_ids, scheduled, computed, rt._planner.reused > reused)
        assert np.array_equal(rt.buffers.plan.numpy(), want_plan), f"step {step}"
        got = [(rid, layer, hook, pos.tolist(), row0, masks.tolist()) for rid, layer, hook, pos, row0, masks in
               (rt._pending.entries() if rt._pending is not None else ())]
        assert got == want_entries, f"step {step}"
        assert rt._rows_used == want_rows
        assert rt.stats["recomputed_positions"] - before["recomputed_positions"] == want_recomputed
        assert rt.stats["dropped_rows"] - before["dropped_rows"] == want_dropped
        for rid, n, first in zip(req_ids[:-1], scheduled.tolist(), computed.tolist()):
            st = live[rid]
            st["computed"] = first + n
            if st["computed"] >= st["total"]:  # sampled a token: generation continues (or ends)
                st["total"] += 1
                if st["total"] - st["prompt_len"] > rng.randint(3, 40 if steady else 12):
                    rt.finish_request(rid)
                    del live[rid]
    if steady:
        assert rt._planner.reused > 0  # the steps planned as last step's cells were checked above
        assert rt._planner.advanced_steps > 0  # and those planned without looking at the requests (_advance)
        assert (rt._planner.ranged > 0) == ranges
        assert (rt._planner.decoded > 0) == ranges  # decode batches that changed, from per-request pieces
    for rid, parts in ref.dropped.items():  # the drops each request recorded, per site and consumer
        req = rt._requests.get(rid)
        if req is None:
            continue
        got = sorted((h, l, p, m) for (h, l), chunks in req.dropped.items() for ps, ms in chunks
                     for p, m in zip(ps.tolist(), ms.tolist()))
        assert got == sorted(parts)


def test_overflow_drops_the_tail_and_a_repeated_step_uploads_nothing(monkeypatch):
    rt = _runtime(monkeypatch, [("post_mlp", l) for l in range(NUM_LAYERS)], 6, 16)
    spec = {"layers": [0, 2], "hooks": ["post_mlp"], "positions": "all"}
    rt.add_request("x", {"a": spec, "b": {**spec, "positions": "all_generated"}}, prompt_len=3)
    rt.add_request("y", {"c": spec}, prompt_len=3)
    planner = rt._planner
    rt.plan_step(["x", "y"], np.array([3, 3]), np.array([0, 0]))  # 12 cells wanted, 6 rows
    assert rt._rows_used == 6 and rt.stats["dropped_rows"] == 6
    assert [(rid, layer, row0, pos.tolist()) for rid, layer, _, pos, row0, _ in rt._pending.entries()] == [
        ("x", 0, 0, [0, 1, 2]), ("x", 2, 3, [0, 1, 2])]
    assert {k: [p.tolist() for p, _ in v] for k, v in rt._requests["y"].dropped.items()} == {
        ("post_mlp", 0): [[0, 1, 2]], ("post_mlp", 2): [[0, 1, 2]]}
    assert planner.uploads == 1
    # decode: x's token 3 is generated (bits a|b), y's is not wanted by b; rows 0..3
    rt.plan_step(["x", "y"], np.array([1, 1]), np.array([3, 3]))
    assert [(rid, layer, row0, masks.tolist()) for rid, layer, _, _, row0, masks in rt._pending.entries()] == [
        ("x", 0, 0, [3]), ("x", 2, 1, [3]), ("y", 0, 2, [4]), ("y", 2, 3, [4])]
    plan = rt.buffers.plan.numpy()
    assert plan[0, :2].tolist() == [0, 2] and plan[2, :2].tolist() == [1, 3] and (plan[:, 2:] == -1).all()
    assert planner.uploads == 2
    rt.plan_step(["x", "y"], np.array([1, 1]), np.array([4, 4]))  # same cells, same rows: no upload
    assert planner.uploads == 2 and rt._rows_used == 4 and planner.reused == 1
    assert [(rid, layer, row0, pos.tolist()) for rid, layer, _, pos, row0, _ in rt._pending.entries()] == [
        ("x", 0, 0, [4]), ("x", 2, 1, [4]), ("y", 0, 2, [4]), ("y", 2, 3, [4])]
    rt.finish_request("x"), rt.finish_request("y")
    assert rt.active  # the device plan still holds last step's cells
    rt.plan_step(["z"], np.array([1]), np.array([0]))
    assert planner.uploads == 3 and (rt.buffers.plan.numpy() == -1).all() and rt._pending is None
    assert not rt.active  # idle: plan_step is no longer called


def test_plain_requests_plan_and_hand_off_nothing(monkeypatch):
    """Requests without a capture spec on a capturing server: the runtime holds nothing for them and a step plans
    nothing and hands nothing to the consumers' process (no per-step work while nobody captures)."""
    from vllm_steer.kernels.capture_rows import live

    rt = _runtime(monkeypatch, [("post_mlp", l) for l in range(NUM_LAYERS)], 6, 16)
    calls = []
    for name in ("plan_step", "_hand_off"):
        real = getattr(rt, name)
        monkeypatch.setattr(rt, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    for rid in ("p", "q"):
        rt.add_request(rid, None, prompt_len=3)
    assert not rt._requests and not rt.active
    from vllm_steer.runtime.manager import SteeringRuntime

    host = SimpleRuntime(rt)
    for first in (0, 3, 4):  # a prefill, two decodes
        SteeringRuntime.plan_capture(host, ["p", "q"], np.array([3 if not first else 1] * 2), np.array([first] * 2))
        assert live.capture_live is False
        rt.after_forward()
    rt.finish_request("p"), rt.finish_request("q")
    assert calls == []
    spec = {"layers": [0], "hooks": ["post_mlp"], "positions": "all"}  # one capturing request: both run again
    rt.add_request("x", {"a": spec}, prompt_len=3)
    SteeringRuntime.plan_capture(host, ["x"], np.array([3]), np.array([0]))
    rt.after_forward()
    assert calls == ["plan_step", "_hand_off"] and live.capture_live is True
    rt.finish_request("x")
    # a prompt-only capture ends with its prefill: the plan is cleared after that forward, the next step is idle
    rt.add_request("y", {"a": {**spec, "positions": "all_prompt"}}, prompt_len=3, max_tokens=1)
    SteeringRuntime.plan_capture(host, ["y"], np.array([3]), np.array([0]))
    assert (rt.buffers.plan.numpy() >= 0).sum() == 3
    rt.after_forward()
    assert not rt._requests and not rt.active and (rt.buffers.plan.numpy() == -1).all()
    SteeringRuntime.plan_capture(host, ["p"], np.array([3]), np.array([0]))
    assert calls == ["plan_step", "_hand_off"] * 2


def test_an_eager_steps_plan_is_made_by_its_first_capturing_op(monkeypatch):
    """An eager step (``plan_capture(..., eager=True)``) queues the requests added before it and leaves its plan to
    the forward: nothing is registered or planned until the first capturing op of the forward at a site a request
    captures runs (the capture op, here on the CPU; the op at post_mlp.0, which no request captures, does not), whose
    rows are then the plan's, the same as a step planned before its forward; a forward with no capturing op (a CUDA
    graph replayed it) gets its plan after it, a warning, and plans before the forward after. The op at a site
    no request captures launches nothing (``live.may_skip`` with its plan row)."""
    from vllm_steer.kernels.capture_rows import live
    from vllm_steer.kernels.capture_rows import op as op_mod
    from vllm_steer.kernels.capture_rows.op import _impl as capture_op
    from vllm_steer.runtime.manager import SteeringRuntime

    spec = {"layers": [1, 2], "hooks": ["post_mlp"], "positions": "all"}
    sites = [("post_mlp", l) for l in range(NUM_LAYERS)]
    pools, launched = [], []  # the op returns at once at a site no request captures (its plan row is all -1)
    monkeypatch.setattr(op_mod, "capture_rows", lambda pool, x, plan, real=op_mod.capture_rows: (
        launched.append(int(x[0, 0])), real(pool, x, plan)))
    for eager in (False, True):
        rt = _runtime(monkeypatch, sites, 64, 16)
        host = SimpleRuntime(rt)
        rt.add_later("x", {"a": spec}, prompt_len=5)
        rt.add_later("y", {"b": {**spec, "layers": [2]}}, prompt_len=3)
        assert rt.active and not rt._requests  # queued until the step's plan
        rows = rt.buffers.plan
        assert live.wanted == {rows[rt.buffers.site_index[("post_mlp", l)]].data_ptr() for l in (1, 2)}
        SteeringRuntime.plan_capture(host, ["x", "y"], np.array([5, 3]), np.array([0, 0]), eager)
        assert (not rt._requests) == eager and ((rt.buffers.plan.numpy() >= 0).sum() == 0) == eager
        assert (live.deferred is not None) == eager and rt.stats["plans_in_forward"] == 0
        a = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
        launched.clear()
        for hook, layer in sites:  # the forward: each site's capture op (the first at a wanted site makes the plan)
            capture_op(rt.buffers.pool, a + layer, rt.buffers.plan_view(hook, layer))
            if layer == 0:  # no request captures post_mlp.0: its op leaves the plan to a later one
                assert (live.deferred is not None) == eager
        assert launched == [1, 2]
        assert live.deferred is None and rt.stats["plans_in_forward"] == int(eager)
        assert set(rt._requests) == {"x", "y"} and (rt.buffers.plan.numpy() >= 0).sum() == 5 * 2 + 3
        pools.append(rt.buffers.pool[: rt._rows_used].clone())
        rt.after_forward()
    assert pools[0].shape[0] == 13 and torch.equal(pools[0], pools[1])
    rt.add_later("z", {"a": spec}, prompt_len=2)
    SteeringRuntime.plan_capture(host, ["z"], np.array([2]), np.array([0]), True)
    warned = []  # vLLM's logging config may keep its loggers from propagating to caplog
    monkeypatch.setattr(capture_mod.logger, "warning", lambda msg, *a: warned.append(msg % a))
    rt.after_forward()  # no op ran: planned now
    assert len(warned) == 1 and "no capturing op ran" in warned[0] and rt.in_forward is False
    assert rt.stats["plans_in_forward"] == 1 and rt._requests["z"].planned_upto == 2
    rt.finish_requests(["x", "y", "z"])
    rt.plan_step([], np.zeros(0, np.int64), np.zeros(0, np.int64))  # nobody captures: the plan all -1 again
    assert live.wanted == frozenset() and not rt.active
    rt.add_later("w", {"a": spec}, prompt_len=2)
    SteeringRuntime.plan_capture(host, ["w"], np.array([2]), np.array([0]), True)
    assert live.deferred is None and (rt.buffers.plan.numpy() >= 0).sum() == 4  # before the forward from now on
    rt.after_forward()
    rt.in_forward = True  # a forward that raised before its first capturing op: its deferred plan is dropped by the
    SteeringRuntime.plan_capture(host, ["w"], np.array([1]), np.array([2]), True)  # next step's, never made after it
    SteeringRuntime.plan_capture(host, ["w"], np.array([1]), np.array([2]), False)
    recomputed = rt.stats["recomputed_positions"]
    rt.after_forward()
    assert live.deferred is None and rt.stats["recomputed_positions"] == recomputed
    assert rt._requests["w"].planned_upto == 3
    from prometheus_client import REGISTRY

    from vllm_steer.engine.metrics_rpc import worker_values
    from vllm_steer.server.metrics import apply_engine

    _, totals = worker_values([{"steering": True, "live_configs": 0, "peak_live_configs": 0, "capture": rt.status()}])
    before = REGISTRY.get_sample_value("vllm_steer_capture_plans_in_forward_total") or 0.0
    apply_engine({"increments": totals})  # the workers' count on /metrics
    assert REGISTRY.get_sample_value("vllm_steer_capture_plans_in_forward_total") == before + 1


def test_the_wanted_sites_cache_stays_bounded_while_the_union_holds_every_field(monkeypatch):
    """A server that never idles sees new capture fields without end: the record of fields already in the union keeps
    at most ``COMPILED_MAX`` (as the compiled fields do), and the union still holds every site asked for."""
    from vllm_steer.kernels.capture_rows import live

    sites = [("post_mlp", l) for l in range(NUM_LAYERS)]
    rt = _runtime(monkeypatch, sites, 64, 16)
    for k in range(3 * capture_mod.COMPILED_MAX):  # each a new field (its positions), the last ones at layer 3
        layer = 3 if k >= 2 * capture_mod.COMPILED_MAX else k % 3
        rt.add_later(f"r{k}", {"a": {"layers": [layer], "hooks": ["post_mlp"], "positions": [k]}}, prompt_len=4)
        assert len(rt._unioned) <= capture_mod.COMPILED_MAX
    rows = rt.buffers.plan
    assert live.wanted == {rows[rt.buffers.site_index[s]].data_ptr() for s in sites}


def test_the_v2_runner_defers_only_batches_no_cuda_graph_replays():
    """``graph_max_tokens``: vLLM replays graphs only for captured sizes (at most ``max_cudagraph_capture_size``), so a
    batch above it runs eagerly; with graphs off (``enforce_eager``: mode NONE) every batch does."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from vllm_steer.runtime.runner_v2 import graph_max_tokens

    for mode, size, want in ((CUDAGraphMode.FULL_AND_PIECEWISE, 512, 512), (CUDAGraphMode.PIECEWISE, 8, 8),
                             (CUDAGraphMode.NONE, 512, -1), (None, 512, -1), (CUDAGraphMode.PIECEWISE, None, 0)):
        assert graph_max_tokens(SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=size)) == want


class SimpleRuntime:
    """What ``SteeringRuntime.plan_capture`` reads of its runtime."""

    def __init__(self, capture) -> None:
        self.capture = capture


def test_a_step_waits_only_for_the_copies_of_the_pool_rows_it_overwrites(monkeypatch):
    """The pool's step rows are a ring: each copy to the host (on the copy stream, an event) is of the rows its step
    wrote, and a later step's forward waits for a copy (``wait_event`` on the compute stream) only when it writes
    some of those rows: the next prefill step goes on beside the last step's copy (on a GPU a prefill step's copy
    is ~5 ms); a step that wraps to row 0 waits for the newest copy of rows it overwrites (and so the older ones);
    a steady decode step (last step's cells and rows again) waits for last step's copy. Each copy reads exactly
    the rows its step's forward wrote. Fake events and streams stand in for CUDA's (``_copy_into``'s order)."""
    from vllm_steer.runtime import capture_lanes

    rt = _runtime(monkeypatch, [("post_mlp", l) for l in range(NUM_LAYERS)], 16, 16)
    copies, waits = [], []

    class Event:
        def __init__(self, rows):
            self.rows = rows.clone()

        def synchronize(self):
            pass

    def copy_into(dst, rows, stream):
        dst.copy_(rows)
        copies.append(Event(rows))
        return copies[-1]

    class ComputeStream:
        def wait_event(self, event):
            waits[-1] = copies.index(event)

    monkeypatch.setattr(capture_lanes, "_copy_into", copy_into)
    monkeypatch.setattr(capture_mod, "current_stream", lambda *a: ComputeStream())
    rt._copy_stream = object()  # a GPU runtime's: plan_step checks the copies
    spec = {"layers": [0, 1], "hooks": ["post_mlp"], "positions": "all"}

    def step(req_ids, scheduled, computed):
        waits.append(None)
        scheduled, computed = np.array(scheduled), np.array(computed)
        rt.plan_step(req_ids, scheduled, computed)
        plan = rt.buffers.plan.numpy()
        written = sorted(int(r) for r in plan[plan >= 0])
        value = 100.0 * len(waits)
        for r in written:  # what the forward's capture op stores: this step's value in each planned row
            rt.buffers.pool[r] = value + r
        base = rt._pending.base
        rt.after_forward()
        assert written == list(range(base, base + len(written)))
        assert torch.equal(copies[-1].rows[:, 0], value + torch.arange(base, base + len(written), dtype=torch.float32))
        return base

    rt.add_request("x", {"a": spec}, prompt_len=3)
    assert step(["x"], [3], [0]) == 0  # 6 rows: 0..5, copy 0
    assert step(["x"], [1], [3]) == 6 and waits[-1] is None  # rows 6..7 beside copy 0 (it waited for copy 0 before)
    rt.add_request("y", {"a": spec}, prompt_len=5)
    assert step(["x", "y"], [1, 5], [4, 0]) == 0  # 12 rows do not fit after row 8: rows 0..11
    assert waits[-1] == 1  # the newest copy of rows it overwrites (rows 6..7); copy 0 ran before it
    assert step(["x", "y"], [1, 1], [5, 5]) == 12 and waits[-1] is None  # rows 12..15: nobody's copy
    assert step(["x", "y"], [1, 1], [6, 6]) == 12 and waits[-1] == 3  # steady decode: last step's rows again
    assert rt._planner.reused == 1


def test_compiled_capture_fields_are_kept_up_to_a_bound_oldest_first(monkeypatch):
    """``_compile`` keeps each distinct capture field's specs and plan once (the second request with the same field
    reuses them) and at most ``COMPILED_MAX`` fields: the oldest goes first, and a request bringing it back is
    compiled again, to the same plan."""
    monkeypatch.setattr(capture_mod, "COMPILED_MAX", 3)
    rt = _runtime(monkeypatch, [(h, l) for l in range(NUM_LAYERS) for h in HOOKS], 64, 16)
    fields = [{"a": {"layers": [layer], "hooks": ["post_mlp"], "positions": "all"}} for layer in range(4)]
    first = rt._compile(fields[0])
    assert rt._compile(dict(fields[0])) is first  # the same field (another dict): compiled once
    for k, field in enumerate(fields):
        rt.add_request(f"r{k}", field, prompt_len=3)
    assert len(rt._compiled) == 3 and repr(fields[0]) not in rt._compiled
    assert [repr(f) for f in fields[1:]] == list(rt._compiled)
    again = rt._compile(fields[0])
    assert again is not first and repr(fields[0]) in rt._compiled and repr(fields[1]) not in rt._compiled
    assert again[0].keys() == first[0].keys() and again[1].__dict__.keys() == first[1].__dict__.keys()
    assert all(np.array_equal(np.asarray(again[1].__dict__[k]), np.asarray(first[1].__dict__[k]))
               for k, v in first[1].__dict__.items() if isinstance(v, np.ndarray))
    rt.add_request("s", fields[0], prompt_len=3)  # served from the recompiled entry: its plan is the template's copy
    assert rt._requests["s"].plan.__dict__.keys() == again[1].__dict__.keys()
