"""Capture reduced on the device (``runtime.capture_reduce``) against a plain reference (CPU, no engine).

Random batches of prefill chunks and decode steps, preempted requests recomputing, two ``activations``
instances (``last`` / ``mean``) and a per-step consumer sharing sites; the forward is simulated (each
plan cell's stream, a function of request, position and site, stored to ``pool[plan]``). The
``activations`` results must equal the reduction of every position each request selected (each
counted once), whether the request was reduced on the device or, with the accumulator rows all held,
fell back to rows step by step (``reduce_fallbacks``)."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from tests.test_capture_plan import HOOKS, NUM_LAYERS, Sink, _random_spec
from vllm_steer.capture.activations import ActivationStats, decode_result
from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod

HIDDEN = 8
MODES = {"all": lambda p, n: True, "all_prompt": lambda p, n: p < n, "all_generated": lambda p, n: p >= n,
         "last_prompt": lambda p, n: p == n - 1}


def stream(rid: str, pos: int, site: int) -> np.ndarray:
    return np.sin(int(rid[1:]) * 1.3 + pos * 0.7 + site * 0.11 + np.arange(HIDDEN)).astype(np.float32)


@pytest.fixture
def runtimes():
    made = []
    yield made
    for rt in made:
        rt.close()


def _runtime(monkeypatch, runtimes, sites, reduce_rows, max_tokens=64):
    classes = {"activations": ActivationStats, "sink": Sink}
    monkeypatch.setattr(capture_mod, "consumer_class", lambda name: classes[name])
    cfg = SteerConfig.model_validate({"capture": ["sink", "activations", {"name": "activations", "instance": "act2"}],
                                      "capture_reduce_rows": reduce_rows, "hooks": list(HOOKS)})
    rt = capture_mod.CaptureRuntime(cfg, sites, NUM_LAYERS, max_tokens, HIDDEN, torch.float32, torch.device("cpu"))
    runtimes.append(rt)
    got: dict[str, dict] = {}
    rt._send = lambda key, reply, requests, results: got.setdefault(key, {}).update(results)
    return rt, got


def _forward(rt, req_ids, scheduled, computed) -> None:
    """What the steered norms store: each planned cell's stream at ``pool[plan[site, token]]``."""
    plan = rt.buffers.plan.numpy()
    tok = 0
    for rid, n, first in zip(req_ids, scheduled.tolist(), computed.tolist()):
        for j in range(n):
            for s in np.flatnonzero(plan[:, tok + j] >= 0).tolist():
                rt.buffers.pool[int(plan[s, tok + j])] = torch.from_numpy(stream(rid, first + j, s))
        tok += n


def _stepper(rt):
    """One engine step of ``rt``: plan, forward (``_forward``), after_forward."""
    def step(req_ids, scheduled, computed):
        scheduled, computed = np.array(scheduled, np.int32), np.array(computed, np.int32)
        rt.plan_step(req_ids, scheduled, computed)
        _forward(rt, req_ids, scheduled, computed)
        rt.after_forward()
    return step


def _schedule(live: dict, ids: list, rng, budget: int, chunk: int, preempt: float = 0.0):
    """One random step over ``ids`` of ``live``: each request schedules up to ``chunk`` tokens within ``budget``
    (one when a single token is left); with ``preempt`` > 0 a request that computed something first recomputes from
    0 or half of it with that probability. Returns (req_ids, scheduled int32, computed int32)."""
    req_ids, scheduled, computed = [], [], []
    for rid in ids:
        st = live[rid]
        if preempt and rng.random() < preempt and st["computed"]:  # preempted: recomputes
            st["computed"] = rng.choice([0, st["computed"] // 2])
        left = st["total"] - st["computed"]
        n = min(left, rng.randint(1, chunk), budget) if left > 1 else 1
        if n <= 0 or budget <= 0:
            continue
        req_ids.append(rid), scheduled.append(n), computed.append(st["computed"])
        budget -= n
    return req_ids, np.array(scheduled, dtype=np.int32), np.array(computed, dtype=np.int32)


def _arrival(got: dict):
    """``sent(rid, within)``: whether ``rid``'s result reaches ``got`` within the seconds given."""
    def sent(rid, within=10.0):
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and rid not in got:
            time.sleep(0.02)
        return rid in got
    return sent


@pytest.mark.parametrize("seed,reduce_rows", [(0, 2048), (1, 2048), (2, 14), (3, 8)])
def test_device_reduction_equals_the_reference(monkeypatch, runtimes, seed, reduce_rows):
    rng = random.Random(seed)
    sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    rt, got = _runtime(monkeypatch, runtimes, sites, reduce_rows)
    live: dict[str, dict] = {}
    want: dict[str, dict] = {}  # rid -> instance -> (reduce, {site name: set of positions})
    seen: dict[str, set] = {}  # rid -> positions computed at least once
    next_id = 0
    steady = seed % 2 == 1
    for step in range(50):
        while len(live) < 6 and rng.random() < (0.2 if steady else 0.6):
            rid, prompt_len = f"r{next_id}", rng.randint(1, 20)
            next_id += 1
            capture = {}
            for inst in ("activations", "act2", "sink"):
                if rng.random() < 0.7:
                    capture[inst] = _random_spec(rng, 30, not steady)
                    if inst != "sink":
                        capture[inst]["reduce"] = rng.choice(["last", "mean"])
            if rng.random() < 0.3 and "activations" in capture:  # the same cells as another consumer
                capture["sink"] = {k: v for k, v in capture["activations"].items() if k != "reduce"}
            rt.add_request(rid, capture, prompt_len)
            live[rid] = {"prompt_len": prompt_len, "computed": 0, "total": prompt_len, "capture": capture}
            seen[rid] = set()
        if not live:
            continue
        ids = list(live)
        if not steady:
            rng.shuffle(ids)
        req_ids, scheduled, computed = _schedule(live, ids, rng, 48, 16, 0.01 if steady else 0.08)
        rt.plan_step(req_ids, scheduled, computed)
        _forward(rt, req_ids, scheduled, computed)
        rt.after_forward()
        ended = []  # the step's ends, handed over together as a runner does (one gather, one copy)
        for rid, n, first in zip(req_ids, scheduled.tolist(), computed.tolist()):
            st = live[rid]
            seen[rid].update(range(first, first + n))
            st["computed"] = first + n
            if st["computed"] >= st["total"]:
                st["total"] += 1
                if st["total"] - st["prompt_len"] > rng.randint(3, 30 if steady else 10) or step == 49:
                    ended.append(rid)
                    want[rid] = st
                    del live[rid]
        rt.finish_requests(ended)
    rt.finish_requests(list(live))
    want.update(live)
    assert rt.stats["dropped_rows"] == 0
    if reduce_rows < 100:
        assert rt.stats["reduce_fallbacks"] > 0 and rt.stats["reduced_requests"] > 0
        _fallbacks_reach_the_metrics(rt.status())
    else:
        assert rt.stats["reduce_fallbacks"] == 0 and rt.stats["reduced_requests"] > 0
    assert rt._reduce.free == reduce_rows  # every slot is free again
    expected = {}
    for rid, st in want.items():
        for inst in ("activations", "act2"):
            raw = st["capture"].get(inst)
            if raw is None:
                continue
            spec = capture_mod.parse_capture_spec(inst, raw, NUM_LAYERS, HOOKS)
            sel = (lambda p, n, ps=raw["positions"]: p in ps) if isinstance(raw["positions"], list) \
                else MODES[raw["positions"]]
            positions = sorted(p for p in seen[rid] if sel(p, st["prompt_len"]))
            if not positions:
                continue
            out = {}
            for hook, layer in spec.sites:
                s = sites.index((hook, layer))
                vals = np.stack([stream(rid, p, s) for p in positions])
                out[f"{hook}.{layer}"] = (vals.mean(axis=0) if raw["reduce"] == "mean" else vals[-1], len(positions))
            expected.setdefault(rid, {})[inst] = out
    assert sum(map(len, expected.values())) >= 10
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(set(v) - set(got.get(k, {})) for k, v in expected.items()):
        time.sleep(0.05)
    for rid, per in expected.items():
        for inst, sites_want in per.items():
            res = got[rid][inst]
            vectors = decode_result(res)
            assert sorted(vectors) == sorted(sites_want), (rid, inst)
            for name, (vec, n) in sites_want.items():
                np.testing.assert_allclose(vectors[name], vec, rtol=1e-5, atol=1e-6, err_msg=f"{rid} {inst} {name}")
                assert res["count"][res["sites"].index(name)] == n
            assert res["dropped_rows"] == 0


def _fallbacks_reach_the_metrics(status: dict) -> None:
    """The worker's counters become engine totals and Prometheus counters (as for every capture counter)."""
    from prometheus_client import REGISTRY

    from vllm_steer.engine.metrics_rpc import worker_values
    from vllm_steer.server.metrics import apply_engine

    _, totals = worker_values([{"steering": True, "live_configs": 0, "peak_live_configs": 0, "capture": status}])
    assert totals["capture_reduce_fallbacks"] == status["reduce_fallbacks"] > 0
    before = REGISTRY.get_sample_value("vllm_steer_capture_reduce_fallbacks_total") or 0.0
    apply_engine({"increments": totals})
    assert REGISTRY.get_sample_value("vllm_steer_capture_reduce_fallbacks_total") == before + status["reduce_fallbacks"]


def test_requests_with_one_capture_field_compile_it_once_and_hold_their_own_slots(monkeypatch, runtimes):
    """``add_request`` parses and compiles a capture field once (``CaptureRuntime._compile``): requests sharing it
    share nothing they write (their slots, their plan's slot fields), each result is its own stream's last rows,
    and an end frees exactly the ender's slots."""
    sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    rt, got = _runtime(monkeypatch, runtimes, sites, 2048)
    parsed = []
    parse = capture_mod.parse_capture_spec
    monkeypatch.setattr(capture_mod, "parse_capture_spec", lambda *a: (parsed.append(a[0]), parse(*a))[1])
    capture = {"activations": {"layers": [0, 2], "hooks": ["post_mlp", "pre_attn"], "positions": "all_generated",
                               "reduce": "last"}}
    ids = ["r1", "r2", "r3"]
    for rid in ids:
        rt.add_request(rid, {k: dict(v) for k, v in capture.items()}, 3)  # equal fields, not the same object
    assert parsed == ["activations"]
    plans = [rt._requests[rid].plan for rid in ids]
    held = [set(p.red_slots.tolist()) for p in plans]
    assert [len(h) for h in held] == [4, 4, 4] and len(set.union(*held)) == 12 and rt._reduce.free == 2048 - 12
    for p in plans:  # each table names its own slots at the spec's site columns
        cols = sorted(sites.index((h, l)) for h in ("pre_attn", "post_mlp") for l in (0, 2))
        assert np.flatnonzero(p.red_slot[0] >= 0).tolist() == cols and set(p.red_slot[0][cols].tolist()) == set(
            p.red_slots.tolist())
    step, sent = _stepper(rt), _arrival(got)
    step(ids, [3, 3, 3], [0, 0, 0])
    for k in range(3):
        step(ids, [1, 1, 1], [3 + k] * 3)
    rt.finish_requests(["r2"])
    assert sent("r2") and rt._reduce.free == 2048 - 8
    assert all(set(rt._requests[rid].plan.red_slots.tolist()) == h for rid, h in (("r1", held[0]), ("r3", held[2])))
    rt.finish_requests(["r1", "r3"])
    assert sent("r1") and sent("r3") and rt._reduce.free == 2048
    for rid in ids:  # position 5 (the last fed) of each request's own stream, at every site
        vectors = decode_result(got[rid]["activations"])
        for h in ("pre_attn", "post_mlp"):
            for l in (0, 2):
                np.testing.assert_allclose(vectors[f"{h}.{l}"], stream(rid, 5, sites.index((h, l))), rtol=1e-6)
        assert got[rid]["activations"]["count"][0] == 3


def test_a_prompt_only_capture_ends_with_its_prefill(monkeypatch, runtimes):
    """A request whose specs want only prompt positions (or explicit ones) is ended by the step that plans its
    last wanted position, before the engine ends it: its result is sent then (a 1-token request does not wait
    the one or two engine steps the runner takes to hear of its end); the engine's later end and a re-add
    after a preemption change nothing; a request that wants generated tokens is not ended early."""
    sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    rt, got = _runtime(monkeypatch, runtimes, sites, 2048)
    sends: list[str] = []
    record = rt._send
    rt._send = lambda key, *rest: (sends.append(key), record(key, *rest))
    spec = {"layers": [0, 1], "hooks": ["post_mlp"], "reduce": "mean"}
    rt.add_request("r1", {"activations": {**spec, "positions": "all_prompt"}}, 6)
    rt.add_request("r2", {"activations": {**spec, "positions": [0, 2]}}, 6)
    rt.add_request("r3", {"activations": {**spec, "positions": "all"}}, 6)

    step, sent = _stepper(rt), _arrival(got)

    step(["r1", "r2", "r3"], [4, 2, 4], [0, 0, 0])  # r2's positions 0..1: its position 2 is still to come
    assert not sent("r1", 0.5) and not sent("r2", 0.01)
    step(["r1", "r2", "r3"], [2, 4, 2], [4, 2, 4])  # the prompts end: r1 and r2 are complete
    assert sent("r1") and sent("r2")
    assert not sent("r3", 0.5)  # it wants generated tokens: only the engine's end ends it
    for rid, n, ps in (("r1", 6, range(6)), ("r2", 2, (0, 2))):
        vectors = decode_result(got[rid]["activations"])
        s = sites.index(("post_mlp", 1))
        np.testing.assert_allclose(vectors["post_mlp.1"], np.mean([stream(rid, p, s) for p in ps], axis=0),
                                   rtol=1e-5, atol=1e-6)
        assert got[rid]["activations"]["count"][0] == n
    rt.add_request("r1", {"activations": {**spec, "positions": "all_prompt"}}, 6)  # resumed: ignored
    step(["r1", "r3"], [6, 1], [0, 6])  # r1 recomputed from 0 after a preemption: nothing planned for it
    rt.finish_request("r1"), rt.finish_request("r2"), rt.finish_request("r3")
    assert sent("r3")
    time.sleep(0.3)
    assert sorted(sends) == ["r1", "r2", "r3"]  # each sent once
    assert rt._reduce.free == 2048 and not rt._requests and not rt._bounded


def test_a_generated_capture_ends_with_the_step_that_samples_its_last_token(monkeypatch, runtimes):
    """A request capturing generated tokens with ``max_tokens`` M feeds positions up to prompt + M - 2 (its M-th
    token is sampled, never computed): the step that plans that position ends its capture and sends its result,
    before the engine's end reaches the runner (one or two steps later, the response waiting for it); the result
    is every generated position's; the engine's later end sends nothing more. A request that stops early (EOS)
    and one without ``max_tokens`` end with the engine's end."""
    sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    rt, got = _runtime(monkeypatch, runtimes, sites, 2048)
    sends: list[str] = []
    record = rt._send
    rt._send = lambda key, *rest: (sends.append(key), record(key, *rest))
    spec = {"layers": [1], "hooks": ["post_mlp"], "positions": "all_generated"}
    prompt, max_tokens = 4, 3  # positions 4 and 5 are fed (tokens 1 and 2); token 3 ends the request
    rt.add_request("r1", {"activations": {**spec, "reduce": "last"}, "act2": {**spec, "reduce": "mean"}}, prompt,
                   max_tokens=max_tokens)
    rt.add_request("r2", {"activations": {**spec, "reduce": "last"}}, prompt, max_tokens=8)  # stops at EOS
    rt.add_request("r3", {"activations": {**spec, "reduce": "last"}}, prompt)  # no cap known

    step, sent = _stepper(rt), _arrival(got)

    ids = ["r1", "r2", "r3"]
    step(ids, [4, 4, 4], [0, 0, 0])  # the prefills (token 1 sampled)
    step(ids, [1, 1, 1], [4, 4, 4])  # position 4 (token 2 sampled)
    assert not sent("r1", 0.3)
    step(ids, [1, 1, 1], [5, 5, 5])  # position 5: r1 samples its 3rd and last token in this step
    assert sent("r1") and not sent("r2", 0.3) and not sent("r3", 0.01)
    s = sites.index(("post_mlp", 1))
    last, mean = decode_result(got["r1"]["activations"]), decode_result(got["r1"]["act2"])
    np.testing.assert_allclose(last["post_mlp.1"], stream("r1", 5, s), rtol=1e-6)
    np.testing.assert_allclose(mean["post_mlp.1"], (stream("r1", 4, s) + stream("r1", 5, s)) / 2, rtol=1e-5, atol=1e-6)
    assert got["r1"]["activations"]["count"] == [2] and got["r1"]["act2"]["count"] == [2]
    time.sleep(0.3)
    r1_sends = sends.count("r1")  # one message per driver lane or one for both
    step(["r2", "r3"], [1, 1], [6, 6])  # r2 samples EOS here (the runtime cannot know)
    rt.finish_request("r1"), rt.finish_request("r2")  # the engine's ends: r1's changes nothing
    assert sent("r2") and got["r2"]["activations"]["count"] == [3]
    rt.finish_request("r3")
    assert sent("r3")
    time.sleep(0.3)
    assert sends.count("r1") == r1_sends and sends.count("r2") == sends.count("r3") == 1
    assert rt._reduce.free == 2048 and not rt._requests and not rt._bounded
    assert not rt._host.ring._live  # each end's reduced rows left the ring once its notices were read


def test_ends_handed_over_together_share_one_copy_or_lose_it_together(monkeypatch, runtimes):
    """Requests ended in one call (a runner's step) have their reduced rows gathered and copied to the consumers'
    ring once, each finish notice reading its part (results as when ended one by one); when the ring has no room
    the reductions are lost, counted once (``ring_full``), the slots freed and each request still ended (its
    consumer got no rows: ``activations`` returns nothing)."""
    sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    rt, got = _runtime(monkeypatch, runtimes, sites, 2048)
    spec = {"layers": [0, 2], "hooks": ["post_mlp"], "positions": "all"}
    staged = []
    real = rt._host.stage_reduced
    monkeypatch.setattr(rt._host, "stage_reduced", lambda rows, stream: staged.append(len(rows)) or real(rows, stream))

    def run(ids, reduce):
        for rid in ids:
            rt.add_request(rid, {"activations": {**spec, "reduce": reduce}}, 3)
        for n, first in ((3, 0), (1, 3)):
            scheduled, computed = np.full(len(ids), n, np.int32), np.full(len(ids), first, np.int32)
            rt.plan_step(ids, scheduled, computed)
            _forward(rt, ids, scheduled, computed)
            rt.after_forward()
        rt.finish_requests(ids)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(r in got for r in ids):
            time.sleep(0.02)

    run(["r1", "r2", "r3"], "last")
    assert staged == [6]  # 3 requests x 2 sites: one copy
    for rid in ("r1", "r2", "r3"):
        vectors = decode_result(got[rid]["activations"])
        for layer in (0, 2):
            np.testing.assert_allclose(vectors[f"post_mlp.{layer}"], stream(rid, 3, sites.index(("post_mlp", layer))))
    assert not rt._host.ring._live
    monkeypatch.setattr(rt._host, "stage_reduced", lambda rows, stream: None)  # the ring is full
    run(["r4", "r5"], "mean")
    assert rt.stats["ring_full"] == 1 and rt._reduce.free == 2048
    assert got["r4"] == got["r5"] == {}  # final messages without a result


@pytest.mark.parametrize("seed", range(4))
def test_ranged_planning_equals_the_general_path(monkeypatch, runtimes, seed):
    """``CapturePlanner._plan_ranges`` (a step without explicit positions, one device-reduced consumer a request)
    (and steady decode steps by ``_advance``) against ``plan``'s general path on the same random request mixes: prefill chunks long and short, decode, a
    per-step consumer's cells inside, around or apart from a reduced consumer's, a pool that overflows. Each step:
    the same entries, rows, drops and base; the same device plan, fresh mean rows aside (any row for each such
    cell); after the simulated forward the same pool rows handed off, the same mean sums, last rows, counts and
    last positions.

    Seeds 0 and 1 plan decode steps whose batch changed (ends, arrivals, a new order, a preempted request's first
    new token) from per-request pieces (``_plan_decode``; their batches are reordered and preempted now and then),
    seeds 2 and 3 from ranges."""
    rng = random.Random(seed)
    sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    max_rows = (200, 4096)[seed % 2]
    pieces = seed < 2
    pair = []
    for ranges in (True, False):
        rt, _ = _runtime(monkeypatch, runtimes, sites, 2048, max_tokens=256)
        rt._planner.ranges = rt._planner.advance = ranges  # the general path plans every step in full
        rt._planner.pieces = pieces
        rt._planner.max_rows = max_rows
        pair.append(rt)
    fast, slow = pair
    live: dict[str, dict] = {}
    next_id = 0
    for step in range(40):
        while len(live) < 8 and rng.random() < 0.5:
            rid, prompt_len = f"r{next_id}", rng.randint(1, 60)
            next_id += 1
            capture = {}
            if rng.random() < 0.8:
                capture[rng.choice(["activations", "act2"])] = {**_random_spec(rng, 30, False),
                                                                 "reduce": rng.choice(["last", "mean"])}
            if rng.random() < 0.6:
                red = next(iter(capture.values()), None)
                same_sites = red is not None and rng.random() < 0.5
                capture["sink"] = ({**{k: v for k, v in red.items() if k not in ("reduce", "positions")},
                                    "positions": rng.choice(["all", "all_prompt", "all_generated", "last_prompt"])}
                                   if same_sites else _random_spec(rng, 30, False))
            for rt in pair:
                rt.add_request(rid, capture, prompt_len)
            live[rid] = {"prompt_len": prompt_len, "computed": 0, "total": prompt_len, "capture": capture,
                         "seen": set()}
        if not live:
            continue
        ids = list(live)
        if pieces and rng.random() < 0.05:  # the batch in a new order
            rng.shuffle(ids)
        req_ids, scheduled, computed = _schedule(live, ids, rng, 256, 64, preempt=0.01 if pieces else 0.0)
        for rt in pair:
            rt.plan_step(req_ids, scheduled, computed)
        a, b = fast._pending, slow._pending
        assert (a is None) == (b is None), step
        if a is not None:
            assert list(a.entries()).__repr__() == list(b.entries()).__repr__(), step
            assert (a.rows, a.dropped_rows, a.base) == (b.rows, b.dropped_rows, b.base), step
        assert (fast._rows_used, fast.stats["dropped_rows"]) == (slow._rows_used, slow.stats["dropped_rows"]), step
        pa, pb = fast.buffers.plan.numpy(), slow.buffers.plan.numpy()
        lo, slots = (a.base + a.rows if a is not None else 0), fast._planner.reduce_base
        fresh_a, fresh_b = (pa >= lo) & (pa < slots), (pb >= lo) & (pb < slots)  # fresh mean rows: any order
        assert np.array_equal(np.where(fresh_a, -2, pa), np.where(fresh_b, -2, pb)), step
        for rt in pair:
            _forward(rt, req_ids, scheduled, computed)
        if a is not None:
            n = a.rows
            assert torch.equal(fast.buffers.pool[a.base : a.base + n], slow.buffers.pool[b.base : b.base + n])
        for rt in pair:
            red, rt._red_step, rt._pending = rt._red_step, None, None
            if red is not None:  # the hand-off's reduce (its rows to the consumers are compared above)
                rt._reduce.apply(red.mean_src, red.mean_len, red.mean_slot, red.copy_src, red.copy_dst)
        ra, rb = fast._reduce, slow._reduce
        torch.testing.assert_close(ra.acc, rb.acc, rtol=1e-6, atol=1e-6)
        assert torch.equal(fast.buffers.pool[slots:], slow.buffers.pool[slots:]), step  # the last slots
        assert np.array_equal(ra.count, rb.count) and np.array_equal(ra.last, rb.last), step
        for rid, n, first in zip(req_ids, scheduled.tolist(), computed.tolist()):
            st = live[rid]
            st["seen"].update(range(first, first + n))
            req = fast._requests.get(rid)  # a capture that ended with its last wanted position has left
            plan = req.plan if req is not None else None
            if plan is not None and plan.red_mask:  # each slot counted every selected position it was not dropped
                bit = plan.red_bits[0]  # at (the pool overflowed), a last slot holds the highest
                raw = st["capture"][fast.consumers[bit][0]]
                sel = {p for p in st["seen"] if MODES[raw["positions"]](p, st["prompt_len"])}
                for col in np.flatnonzero(plan.red_slot[0] >= 0).tolist():
                    slot = int(plan.red_slot[0][col])
                    lost = {p for ps, ms in req.dropped.get(sites[col], []) for p in ps[(ms & bit) != 0].tolist()}
                    kept = sel - lost
                    last = max(kept, default=-1) if raw["reduce"] == "last" else -1
                    assert (ra.count[slot], ra.last[slot]) == (len(kept), last), (step, rid)
            st["computed"] = first + n
            if st["computed"] >= st["total"]:
                st["total"] += 1
                if st["total"] - st["prompt_len"] > rng.randint(2, 12):
                    for rt in pair:
                        rt.finish_requests([rid])
                    del live[rid]
    assert fast._planner.ranged > 10 and slow._planner.ranged == 0
    assert (fast._planner.decoded > 0) == pieces and slow._planner.decoded == 0
    assert fast._planner.advanced_steps > 0 and slow._planner.advanced_steps == 0


def test_start_up_launches_each_capture_kernel_on_the_buffers_its_steps_use(monkeypatch, runtimes):
    """A Triton kernel compiles at its first launch (on a GPU, at the first capturing step: a JIT during inference,
    an engine error under vLLM's ``--jit-monitor-mode error``). Building the runtime launches ``write_runs`` (both
    modes) and ``segment_add`` once, writing nothing, on the very buffers the steps then pass (so the same dtypes
    and alignment: one compiled kernel, ``test_kernels_compile``)."""
    from vllm_steer.runtime import capture_plan, capture_reduce

    calls = []
    write_runs, segment_add = capture_plan.write_runs, capture_reduce.segment_add
    monkeypatch.setattr(capture_plan, "write_runs",
                        lambda *a, **k: (calls.append(("runs", a, k.get("reset", False))), write_runs(*a, **k))[1])
    monkeypatch.setattr(capture_reduce, "segment_add", lambda *a: (calls.append(("add", a, None)), segment_add(*a))[1])
    sites = [(h, l) for h in HOOKS for l in range(NUM_LAYERS)]
    rt, got = _runtime(monkeypatch, runtimes, sites, reduce_rows=8)
    warm = list(calls)
    planner, region = rt._planner, rt._reduce
    assert sorted((kind, str(reset)) for kind, _, reset in warm) == [("add", "None"), ("runs", "False"), ("runs", "True")]
    assert torch.equal(rt.buffers.plan, torch.full_like(rt.buffers.plan, -1))  # nothing written
    assert not region.acc.any()
    step = _stepper(rt)
    rt.add_request("r1", {"activations": {"layers": [0, 1], "hooks": ["post_mlp"], "positions": "all",
                                          "reduce": "mean"}}, 5)
    step(["r1"], [5], [0])
    step(["r1"], [1], [5])
    later = calls[len(warm):]
    assert {kind for kind, _, _ in later} == {"runs", "add"} and True in {r for k, _, r in later if k == "runs"}
    for kind, args, _ in later:
        w = next(a for k, a, _ in warm if k == kind)
        if kind == "runs":
            assert args[0] is planner._plan_flat is w[0] and args[1] is planner._staging is w[1]
        else:  # acc, pool, sources the same tensors; the slots and bounds views of the same index buffer
            assert all(args[i] is w[i] for i in range(3))
            assert all(a.untyped_storage().data_ptr() == region._idx.untyped_storage().data_ptr()
                       and a.dtype == region._idx.dtype for a in (args[3], args[4], w[3], w[4]))
