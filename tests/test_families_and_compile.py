"""Every supported family steers at every hook like transformers does; compiled == eager; a graph
compiled with steering off is never reused once steering is on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import hf_oracle
from tests.engine_job import run_job
from tests.steering_cases import floats, params, vector

HOOKS = ("pre_attn", "post_attn", "post_mlp")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3")


def _hidden(path: str) -> int:
    with open(f"{path}/config.json") as f:
        return json.load(f)["hidden_size"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_steers_each_hook_like_transformers(family, tiny_model, tmp_path):
    path = tiny_model(family)
    _, tok = hf_oracle.load(path)
    ids = tok("the robot said hello to the sun")["input_ids"]
    d = _hidden(path)
    reqs = [params(10)] + [params(10, steering_vectors=floats(h, 1, vector(d, i, 4.0))) for i, h in enumerate(HOOKS)]
    job = {"model": path,
           "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                          "distributed_executor_backend": "uni", "additional_config": {"steer": {"max_configs": 4}}},
           "calls": [{"prompts": [{"prompt_token_ids": ids}] * len(reqs), "params": reqs}]}
    got = run_job(job, tmp_path)["calls"][0]
    ref_plain, _ = hf_oracle.greedy(path, ids, 10, family=family)
    assert got[0]["token_ids"] == ref_plain
    for i, hook in enumerate(HOOKS):
        ref, ref_lp = hf_oracle.greedy(path, ids, 10, {hook: {1: vector(d, i, 4.0)}}, family=family)
        assert got[1 + i]["token_ids"] == ref, hook
        np.testing.assert_allclose(got[1 + i]["logprobs"], ref_lp, atol=2e-3)
        assert got[1 + i]["token_ids"] != ref_plain, f"{hook} did not change {family}"


@pytest.fixture(scope="module")
def compile_case(tiny_model, tmp_path_factory):
    """A tiny Llama, a batch (one unsteered request, one per hook), and that batch run eager."""
    path = tiny_model("llama")
    _, tok = hf_oracle.load(path)
    ids = tok("once upon a time the robot")["input_ids"]
    d = _hidden(path)
    reqs = [params(10)] + [params(10, steering_vectors=floats(h, 1, vector(d, i, 4.0))) for i, h in enumerate(HOOKS)]
    root = tmp_path_factory.mktemp("compile")
    case = {"path": path, "ids": ids, "root": root,
            "calls": [{"prompts": [{"prompt_token_ids": ids}] * len(reqs), "params": reqs}],
            "base": {"dtype": "float32", "max_model_len": 256, "distributed_executor_backend": "uni"},
            "env": {"VLLM_CACHE_ROOT": str(root / "vllm-cache")}}
    eager = {"model": path, "calls": case["calls"],
             "llm_kwargs": {**case["base"], "enforce_eager": True, "additional_config": {"steer": {"max_configs": 4}}}}
    case["eager"] = run_job(eager, _mk(root / "eager"), env=case["env"])["calls"][0]
    return case


def test_compiled_matches_eager_and_stale_graph_never_loads(compile_case):
    """Compile with steering off, restart with it on (same compile cache dir): steering works and
    matches eager, so the steering-off graph was not reused."""
    c = compile_case
    off = {"model": c["path"], "llm_kwargs": c["base"],
           "calls": [{"prompts": [{"prompt_token_ids": c["ids"]}], "params": [params(10)]}]}
    unsteered = run_job(off, _mk(c["root"] / "off"), env=c["env"])["calls"][0][0]["token_ids"]
    on = {"model": c["path"], "llm_kwargs": {**c["base"], "additional_config": {"steer": {"max_configs": 4}}},
          "calls": c["calls"]}
    compiled = run_job(on, _mk(c["root"] / "on"), env=c["env"])["calls"][0]
    assert compiled[0]["token_ids"] == unsteered
    for got, want in zip(compiled, c["eager"]):
        assert got["token_ids"] == want["token_ids"]
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)
    assert all(got["token_ids"] != unsteered for got in compiled[1:])


def test_inline_apply_compiles_to_the_results_of_the_op(compile_case):
    """``apply: inline`` (plain torch ops that Inductor fuses into the next add+norm) gives what the
    opaque op gives in eager mode, steered and unsteered requests alike."""
    c = compile_case
    job = {"model": c["path"], "calls": c["calls"], "rpc": ["vllm_steer_status"],
           "llm_kwargs": {**c["base"], "additional_config": {"steer": {"max_configs": 4, "apply": "inline"}}}}
    inline = run_job(job, _mk(c["root"] / "inline"), env=c["env"])
    assert inline["rpc"]["vllm_steer_status"][0]["apply"] == "inline"
    for got, want in zip(inline["calls"][0], c["eager"]):
        assert got["token_ids"] == want["token_ids"]
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)
    assert all(got["token_ids"] != inline["calls"][0][0]["token_ids"] for got in inline["calls"][0][1:])


def _mk(p):
    p.mkdir(parents=True, exist_ok=True)
    return p
