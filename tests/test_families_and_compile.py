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


def test_compiled_matches_eager_and_stale_graph_never_loads(tiny_model, tmp_path):
    """Compile with steering off, restart with it on (same compile cache dir): steering works and
    matches eager, so the steering-off graph was not reused. The ``inline`` apply mode (plain
    torch ops that Inductor fuses) compiles to the same results as the opaque op."""
    path = tiny_model("llama")
    _, tok = hf_oracle.load(path)
    ids = tok("once upon a time the robot")["input_ids"]
    d = _hidden(path)
    reqs = [params(10)] + [params(10, steering_vectors=floats(h, 1, vector(d, i, 4.0))) for i, h in enumerate(HOOKS)]
    calls = [{"prompts": [{"prompt_token_ids": ids}] * len(reqs), "params": reqs}]
    base = {"dtype": "float32", "max_model_len": 256, "distributed_executor_backend": "uni"}
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    off = {"model": path, "llm_kwargs": base, "calls": [{"prompts": [{"prompt_token_ids": ids}], "params": [params(10)]}]}
    unsteered = run_job(off, _mk(tmp_path / "off"), env=env)["calls"][0][0]["token_ids"]
    steer = {"steer": {"max_configs": 4}}
    compiled = run_job({"model": path, "llm_kwargs": {**base, "additional_config": steer}, "calls": calls},
                       _mk(tmp_path / "on"), env=env)["calls"][0]
    eager = run_job({"model": path, "llm_kwargs": {**base, "enforce_eager": True, "additional_config": steer},
                     "calls": calls}, _mk(tmp_path / "eager"), env=env)["calls"][0]
    inline_steer = {"steer": {"max_configs": 4, "apply": "inline"}}
    inline = run_job({"model": path, "llm_kwargs": {**base, "additional_config": inline_steer}, "calls": calls,
                      "rpc": ["vllm_steer_status"]}, _mk(tmp_path / "inline"), env=env)
    assert inline["rpc"]["vllm_steer_status"][0]["apply"] == "inline"
    assert compiled[0]["token_ids"] == unsteered
    for c, e, i in zip(compiled, eager, inline["calls"][0]):
        assert c["token_ids"] == e["token_ids"] == i["token_ids"]
        np.testing.assert_allclose(c["logprobs"], e["logprobs"], atol=1e-4)
        np.testing.assert_allclose(i["logprobs"], e["logprobs"], atol=1e-4)
    assert all(c["token_ids"] != unsteered for c in compiled[1:])


def _mk(p):
    p.mkdir(parents=True, exist_ok=True)
    return p
