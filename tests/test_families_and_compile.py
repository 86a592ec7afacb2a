"""Every supported family steers at every site like transformers does (each hook at each layer, and
both tables of one norm at once); compiled == eager; a graph compiled with steering off is never
reused once steering is on. Gemma-2's job (its norm gains made random: the fixture's are 0, a gain of 1) also
serves a Gemma Scope-style transcoder (sae-lens ``jumprelu_transcoder``, hook ``blocks.1.ln2.hook_normalized``):
its encoder must read what Gemma Scope trained on, the MLP's input just after the pre-MLP RMSNorm with the norm's
gain folded away (``tests/gemma_scope_input.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import hf_oracle
from tests.engine_job import run_job
from tests.gemma_scope_input import GS_CLAMPS, GS_LAYER, GS_TC, gemma_scope_refs, with_norm_gains
from tests.sae_writers import write_sae_lens_transcoder
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


def _family_run(family: str, path: str, tmp_path) -> tuple[str, list[int], int, list[dict]]:
    """One engine of ``family`` (Gemma-2: norm gains random, the Gemma Scope transcoder loaded) serving the plain
    request, one per SITE_CASES and (Gemma-2) one clamping the transcoder: (path, prompt ids, hidden, outputs)."""
    steer = {"max_configs": 8}
    if family == "gemma2":
        path = with_norm_gains(path, tmp_path / "gemma2-gains")
        tc = write_sae_lens_transcoder(str(tmp_path / "gst"), GS_TC, GS_LAYER,
                                       hook_name=f"blocks.{GS_LAYER}.ln2.hook_normalized")
        steer["sae"] = {"gst": {"path": tc}}
    _, tok = hf_oracle.load(path)
    ids = tok("the robot said hello to the sun")["input_ids"]
    d = _hidden(path)
    reqs = [params(10)] + [params(10, steering_vectors=_fields(c, d)) for c in SITE_CASES]
    if family == "gemma2":
        reqs.append(params(10, sae={"name": "gst", "clamps": GS_CLAMPS}))
    job = {"model": path,
           "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                          "distributed_executor_backend": "uni", "additional_config": {"steer": steer}},
           "calls": [{"prompts": [{"prompt_token_ids": ids}] * len(reqs), "params": reqs}]}
    return path, ids, d, run_job(job, tmp_path)["calls"][0]


@pytest.fixture(scope="module")
def gemma2_run(tiny_model, tmp_path_factory):
    return _family_run("gemma2", tiny_model("gemma2"), tmp_path_factory.mktemp("gemma2"))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_steers_each_site_like_transformers(family, tiny_model, tmp_path, request):
    if family == "gemma2":
        path, ids, d, got = request.getfixturevalue("gemma2_run")
    else:
        path, ids, d, got = _family_run(family, tiny_model(family), tmp_path)
    hf_oracle.check_greedy(got[0], path, ids, 10, family=family, what="plain")
    for k, case in enumerate(SITE_CASES):
        hf_oracle.check_greedy(got[1 + k], path, ids, 10, _oracle_vectors(case, d), family=family, what=case)
        assert got[1 + k]["token_ids"] != got[0]["token_ids"], f"{case} did not change {family}"


def test_gemma_scope_oracle_tells_the_norm_gain_apart(gemma2_run):
    """The transcoder's edit from Gemma Scope's input and from the gain-included one move transformers' logprobs of
    the engine's tokens apart (so the next test can tell which one the engine encodes), and the clamps move them."""
    path, ids, _, got = gemma2_run
    refs = gemma_scope_refs(got[-1], path, ids)
    assert np.abs(refs[True]["logprobs"] - refs[False]["logprobs"]).max() > 0.05, refs["gap"]
    assert got[-1]["token_ids"] != got[0]["token_ids"]


def test_gemma_scope_transcoder_encodes_the_pre_mlp_norm_without_its_gain(gemma2_run):
    """Served Gemma-2 (gains random): the Gemma Scope-hooked transcoder's clamps give transformers' greedy tokens
    and logprobs with the edit encoded from Gemma Scope's input (``gemma_scope_input.gemma_scope_edits``)."""
    path, ids, _, got = gemma2_run
    refs = gemma_scope_refs(got[-1], path, ids)
    ref = refs[True]
    off = np.flatnonzero(ref["trail"] > 0)
    assert off.size == 0, (f"token {off[0]} trails transformers' argmax (Gemma Scope's input) by "
                           f"{ref['trail'][off[0]]:.3g}; logprobs off (gain-free, gain included): {refs['gap']}")
    np.testing.assert_allclose(got[-1]["logprobs"], ref["logprobs"], atol=2e-3,
                               err_msg=f"logprobs off (gain-free, gain included): {refs['gap']}")


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
