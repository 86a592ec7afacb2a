"""Capture rows per step (CPU, no engine): the front end's per-token cost of a request (``frontend.capture_rows``)
bounds the pool rows the workers' planner takes for it, per pipeline stage; the scheduler's cap
(``engine.capture_budget``) keeps a step's captured cells inside ``steer.capture_max_rows`` under a vLLM-like
token assignment, always lets a prompt through, and counts the steps it capped; a request one token of
which cannot fit the pool is a 400 naming ``capture``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_steer.core.config import SteerConfig
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.engine.capture_budget import CaptureBudget

HIDDEN, HOOKS = 8, ("pre_attn", "post_attn", "post_mlp")


def _frontend(layers: int, pp: int = 1, max_rows: int = 4096):
    from vllm_steer.frontend.prepare import SteeringFrontend

    mc = SimpleNamespace(dtype=torch.float32, hf_text_config=SimpleNamespace(num_hidden_layers=layers),
                         get_hidden_size=lambda: HIDDEN)
    steer = {"capture": ["activations:instance=act", "logging:instance=log"], "capture_max_rows": max_rows}
    return SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": steer},
                                            parallel_config=SimpleNamespace(pipeline_parallel_size=pp)))


SPECS = [
    {"log": {"layers": "all", "hooks": "all", "positions": "all"}},
    {"log": {"layers": [0, 3], "hooks": ["pre_attn", "post_mlp"], "positions": "all_prompt"}},
    {"log": {"layers": [1], "hooks": "all", "positions": "last_prompt"}},
    {"log": {"layers": [2, 3], "hooks": ["post_attn"], "positions": "all_generated"}},
    {"log": {"layers": [0, 1, 2], "hooks": ["pre_attn"], "positions": [0, 2, 40]}},
    {"act": {"layers": "all", "hooks": "all", "positions": "all", "reduce": "last"}},  # its own slots: no step rows
    {"act": {"layers": [1, 3], "hooks": "all", "positions": "all", "reduce": "mean"}},
    {"act": {"layers": [0, 1], "hooks": ["post_mlp"], "positions": "all", "reduce": "last"},
     "log": {"layers": [1, 2], "hooks": ["post_mlp"], "positions": "all_prompt"}},
]


def _pool_rows(rt, req_ids, num_scheduled, num_computed) -> int:
    """The step rows of the pool one planned step uses (consumers' cells and mean-reduced tokens' own rows)."""
    steps = []
    plan = rt._planner.plan
    rt._planner.plan = lambda *a, **k: steps.append(plan(*a, **k)) or steps[-1]
    try:
        rt.plan_step(req_ids, num_scheduled, num_computed)
    finally:
        del rt._planner.plan
    return steps[0].pool_rows


@pytest.mark.parametrize("pp", [1, 2])
def test_the_front_end_cost_bounds_the_rows_each_stage_plans(pp):
    """Each stage's planner (the workers' truth) takes at most the front end's rows for a whole prompt in one
    step ((P - 1) x c0 + c1) and for a decode step (c2); on one stage exactly those."""
    from vllm_steer.runtime.capture import CaptureRuntime

    layers, prompt = 4, 6
    fe = _frontend(layers, pp)
    cfg = SteerConfig.model_validate({"capture": ["activations:instance=act", "logging:instance=log"],
                                      "hooks": list(HOOKS)})
    stage_sites = [[(h, l) for l in range(layers) for h in HOOKS if fe.stage_of(h, l) == k] for k in range(pp)]
    runtimes = [CaptureRuntime(cfg, sites, layers, 64, HIDDEN, torch.float32, torch.device("cpu"), pp_rank=k,
                               pp_size=pp) for k, sites in enumerate(stage_sites)]
    try:
        for i, spec in enumerate(SPECS):
            payload = fe.engine_extra_args({"capture": spec}).payload
            c0, c1, c2 = payload.capture_rows or (0, 0, 0)
            planned = []
            for rt in runtimes:
                rt.add_request(f"r{i}", payload.capture, prompt)
                pre = _pool_rows(rt, [f"r{i}"], np.array([prompt]), np.array([0]))
                planned.append((pre, _pool_rows(rt, [f"r{i}"], np.array([1]), np.array([prompt]))))
                rt.finish_request(f"r{i}")
            assert all(pre <= (prompt - 1) * c0 + c1 and dec <= c2 for pre, dec in planned), (spec, planned)
            if pp == 1 and all(isinstance(v["positions"], str) for v in spec.values()):  # explicit: an upper bound
                assert planned == [((prompt - 1) * c0 + c1, c2)], (spec, planned, (c0, c1, c2))
        assert fe.engine_extra_args({"capture": SPECS[5]}).payload.capture_rows is None
    finally:
        for rt in runtimes:
            rt.close()


def test_one_token_wider_than_the_pool_is_refused_naming_capture():
    """8 layers x 3 hooks = 24 rows a token against a pool of 16: a 400 naming the field and both numbers; a
    device ``last`` reduction takes no step rows (accepted), and on 2 pipeline stages the wider holds 13 (accepted)."""
    every = {"layers": "all", "hooks": "all", "positions": "all"}
    with pytest.raises(SteeringSpecError) as refused:
        _frontend(8, max_rows=16).engine_extra_args({"capture": {"log": every}})
    assert refused.value.field == "capture"
    assert "24 (site, token) rows" in str(refused.value) and "steer.capture_max_rows (16)" in str(refused.value)
    assert _frontend(8, max_rows=16).engine_extra_args(
        {"capture": {"act": {**every, "reduce": "last"}}}).payload.capture_rows is None
    assert _frontend(8, pp=2, max_rows=16).engine_extra_args({"capture": {"log": every}}).payload.capture_rows == (
        13, 13, 13)  # post_mlp.3 is on the second stage (layer 4's norm receives it): 11 + 13


def test_a_request_s_capture_specs_are_parsed_once(monkeypatch):
    """The front end validates a request's capture specs and counts its rows from the same parse: one
    ``parse_capture_spec`` per instance a request names, with the same rows as a fresh parse gives."""
    from vllm_steer.frontend import prepare

    calls = []
    real = prepare.parse_capture_spec
    monkeypatch.setattr(prepare, "parse_capture_spec", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    fe = _frontend(4)
    got = fe.engine_extra_args({"capture": SPECS[7]}).payload.capture_rows
    assert sorted(calls) == ["act", "log"], calls
    assert got == fe.capture_rows(dict(SPECS[7])) and any(got), got  # asked again (the memo is spent): parsed afresh, same rows
    assert sorted(calls) == ["act", "act", "log", "log"], calls


def _cells(cost, computed, tokens, prompt):
    """Rows a capturing request's chunk of ``tokens`` from ``computed`` takes (the planner's classes)."""
    c0, c1, c2 = cost
    if computed >= prompt:
        return c2 * tokens
    end = computed + tokens
    return c0 * (min(end, prompt - 1) - computed) + (c1 if end >= prompt else 0) + c2 * max(0, end - prompt)


def _schedule(reqs, budget):
    """vLLM's order: running decodes one token each, then prefills in order, each up to what is left."""
    out = {}
    for rid, r in reqs.items():
        if r.num_computed_tokens >= r.num_prompt_tokens and budget > 0:
            out[rid], budget = 1, budget - 1
    for rid, r in reqs.items():
        left = r.num_prompt_tokens - r.num_computed_tokens
        if left > 0 and budget > 0:
            out[rid] = min(left, budget)
            budget -= out[rid]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_capped_steps_keep_their_cells_in_the_pool_and_every_prompt_finishes(seed):
    rng = random.Random(seed)
    max_rows, full_budget = 64, 512
    budget = CaptureBudget(max_rows)
    reqs, costs, generated = {}, {}, {}
    for i in range(rng.randint(3, 8)):
        rid = f"r{i}"
        reqs[rid] = SimpleNamespace(num_prompt_tokens=rng.randint(1, 300), num_computed_tokens=0)
        generated[rid] = rng.randint(1, 5)
        if rng.random() < 0.7:  # capturing: up to 12 rows a token (a decode batch of 8 fits 64 rows)
            costs[rid] = (rng.randint(0, 12), rng.randint(0, 12), rng.randint(0, 6))
            budget.arrive(rid, costs[rid])
    capped = steps = 0
    while reqs:
        steps += 1
        assert steps < 10_000
        cap = budget.token_cap(reqs, reqs.values())
        decode_cells = sum(costs[r][2] for r, q in reqs.items() if r in costs and q.num_computed_tokens >= q.num_prompt_tokens)
        got = _schedule(reqs, min(full_budget, cap) if cap is not None else full_budget)
        cells = sum(_cells(costs[r], reqs[r].num_computed_tokens, n, reqs[r].num_prompt_tokens)
                    for r, n in got.items() if r in costs)
        widest = max((max(costs[r][:2]) for r, q in reqs.items() if r in costs and q.num_computed_tokens < q.num_prompt_tokens),
                     default=0)
        if cap is not None:
            capped += 1
            if max_rows - decode_cells >= widest:  # room for a prompt token: the step fits
                assert cells <= max_rows, (cap, got, cells)
            assert any(reqs[r].num_computed_tokens < reqs[r].num_prompt_tokens for r in got)  # a prompt moved
        else:
            assert cells <= max_rows
        for r, n in got.items():
            reqs[r].num_computed_tokens += n
        for r in [r for r, q in reqs.items() if q.num_computed_tokens >= q.num_prompt_tokens + generated[r]]:
            del reqs[r]
            budget.release(r)
    assert budget.throttled_steps == capped and not budget
    if any(c[0] for c in costs.values()):
        assert capped > 0  # prompts of up to 300 tokens at up to 12 rows each overflow 64 rows


def test_decode_rows_alone_never_cap_a_step():
    """Capturing decodes wider than the pool with no capturing prompt left: nothing to chunk (their rows drop,
    counted by the workers), so no cap; a prompt waiting beside them gets one token a step."""
    budget = CaptureBudget(16)
    reqs = {f"d{i}": SimpleNamespace(num_prompt_tokens=4, num_computed_tokens=9) for i in range(6)}
    for rid in reqs:
        budget.arrive(rid, (0, 0, 3))
    assert budget.token_cap(reqs, reqs.values()) is None and budget.throttled_steps == 0
    reqs["p"] = SimpleNamespace(num_prompt_tokens=50, num_computed_tokens=0)
    budget.arrive("p", (2, 2, 2))
    assert budget.token_cap(reqs, reqs.values()) == 6 + 1 and budget.throttled_steps == 1
