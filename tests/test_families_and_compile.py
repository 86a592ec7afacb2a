"""Every supported family steers at every site like transformers does (each hook at each layer, and
both tables of one norm at once); compiled == eager; a graph compiled with steering off is never
reused once steering is on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import hf_oracle
from tests.engine_job import run_job
from tests.steering_cases import params, vector

HOOKS = ("pre_attn", "post_attn", "post_mlp")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3")


def _hidden(path: str) -> int:
    with open(f"{path}/config.json") as f:
        return json.load(f)["hidden_size"]


# Every site of a 2-layer model: pre_attn[0] (the first norm, no residual: x steered in place),
# post_mlp[0] and pre_attn[1] (tables A and B of layer 1's input norm), post_mlp[1] (the final norm),
# post_attn[0/1]; and one request with A and B of the same norm at once plus post_attn.
SITE_CASES = [{h: {l: 10 * i + l} for l in (0, 1)} for i, h in enumerate(HOOKS)]
SITE_CASES = [{h: {l: s}} for case in SITE_CASES for h, ls in case.items() for l, s in ls.items()]
SITE_CASES.append({"post_mlp": {0: 91}, "pre_attn": {1: 92}, "post_attn": {0: 93}})


CAPTURE_ALL = {"layers": "all", "hooks": "all", "positions": "all", "reduce": "mean"}
CAPTURE_STEER = {"max_configs": 8, "capture": ["activations"]}


def _fields(case: dict, d: int) -> dict:
    return {h: {str(l): [float(x) for x in vector(d, s, 4.0)]} for h, ls in case.items() for l, s in ls.items()}


def _oracle_vectors(case: dict, d: int) -> dict:
    return {h: {l: vector(d, s, 4.0) for l, s in ls.items()} for h, ls in case.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_steers_each_site_like_transformers(family, tiny_model, tmp_path):
    path = tiny_model(family)
    _, tok = hf_oracle.load(path)
    ids = tok("the robot said hello to the sun")["input_ids"]
    d = _hidden(path)
    reqs = [params(10)] + [params(10, steering_vectors=_fields(c, d)) for c in SITE_CASES]
    job = {"model": path,
           "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                          "distributed_executor_backend": "uni", "additional_config": {"steer": {"max_configs": 8}}},
           "calls": [{"prompts": [{"prompt_token_ids": ids}] * len(reqs), "params": reqs}]}
    got = run_job(job, tmp_path)["calls"][0]
    hf_oracle.check_greedy(got[0], path, ids, 10, family=family, what="plain")
    for k, case in enumerate(SITE_CASES):
        hf_oracle.check_greedy(got[1 + k], path, ids, 10, _oracle_vectors(case, d), family=family, what=case)
        assert got[1 + k]["token_ids"] != got[0]["token_ids"], f"{case} did not change {family}"


@pytest.fixture(scope="module")
def compile_case(tiny_model, tmp_path_factory):
    """A tiny Llama, a batch (one unsteered request, one per hook), and that batch run eager."""
    path = tiny_model("llama")
    _, tok = hf_oracle.load(path)
    ids = tok("once upon a time the robot")["input_ids"]
    d = _hidden(path)
    reqs = [params(10)] + [params(10, steering_vectors=_fields(c, d)) for c in SITE_CASES]
    root = tmp_path_factory.mktemp("compile")
    case = {"path": path, "ids": ids, "root": root,
            "calls": [{"prompts": [{"prompt_token_ids": ids}] * len(reqs), "params": reqs}],
            "base": {"dtype": "float32", "max_model_len": 256, "distributed_executor_backend": "uni"},
            "env": {"VLLM_CACHE_ROOT": str(root / "vllm-cache")}}
    # eager, with every site captured (prompt and generated tokens): the steered norms run the capture op
    captured = [{**p, "extra_args": {**p.get("extra_args", {}), "capture": {"activations": CAPTURE_ALL}}}
                for p in reqs]
    case["captured_calls"] = [{"prompts": [{"prompt_token_ids": ids}] * len(reqs), "params": captured}]
    eager = {"model": path, "calls": case["captured_calls"], "collect_capture": True,
             "llm_kwargs": {**case["base"], "enforce_eager": True, "additional_config": {"steer": CAPTURE_STEER}}}
    case["eager"] = run_job(eager, _mk(root / "eager"), env=case["env"])["calls"][0]
    return case


def test_compiled_matches_eager_and_stale_graph_never_loads(compile_case):
    """Compile with steering off, restart with it on (same compile cache dir): steering works and
    matches eager, so the steering-off graph was not reused."""
    c = compile_case
    off = {"model": c["path"], "llm_kwargs": c["base"],
           "calls": [{"prompts": [{"prompt_token_ids": c["ids"]}], "params": [params(10)]}]}
    unsteered = run_job(off, _mk(c["root"] / "off"), env=c["env"])["calls"][0][0]["token_ids"]
    on = {"model": c["path"], "llm_kwargs": {**c["base"], "additional_config": {"steer": {"max_configs": 8}}},
          "calls": c["calls"]}
    compiled = run_job(on, _mk(c["root"] / "on"), env=c["env"])["calls"][0]
    assert compiled[0]["token_ids"] == unsteered
    for got, want in zip(compiled, c["eager"]):
        assert got["token_ids"] == want["token_ids"]
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)
    assert all(got["token_ids"] != unsteered for got in compiled[1:])


def test_compiled_capture_matches_eager(compile_case):
    """Capture folded into the steered norms under torch.compile (the op writes the capture pool, a graph
    input): every site's captured mean over prompt and generated tokens, and the tokens, equal eager's."""
    from vllm_steer.capture.activations import decode_result

    c = compile_case
    job = {"model": c["path"], "calls": c["captured_calls"], "collect_capture": True,
           "llm_kwargs": {**c["base"], "additional_config": {"steer": CAPTURE_STEER}}}
    compiled = run_job(job, _mk(c["root"] / "captured"), env=c["env"])["calls"][0]
    for got, want in zip(compiled, c["eager"]):
        assert got["token_ids"] == want["token_ids"]
        rows, ref = decode_result(got["capture"]["activations"]), decode_result(want["capture"]["activations"])
        assert sorted(rows) == sorted(ref) and len(rows) == 6  # 2 layers x 3 hooks
        for site, v in ref.items():
            np.testing.assert_allclose(rows[site], v, rtol=1e-5, atol=1e-4, err_msg=site)
    steered = decode_result(c["eager"][1]["capture"]["activations"])  # steered at pre_attn.0: the stream moved
    assert not np.allclose(steered["post_mlp.1"], decode_result(c["eager"][0]["capture"]["activations"])["post_mlp.1"])


def _mk(p):
    p.mkdir(parents=True, exist_ok=True)
    return p
