"""Conditional steering (``steering_condition``, issue 27): the op against a hand computation, the front
end's refusals (each names its field), and the engine against transformers with forward hooks that
compute the same gate from the same residual (SmolLM2, float32, CPU lane), in a mixed batch."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from tests import hf_oracle
from tests.engine_job import run_job
from tests.steering_cases import floats, params, vector
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.hooks import site_order
from vllm_steer.kernels.steered_rms_norm.naive import steered_cond_rms_norm_naive, steered_rms_norm_naive

HIDDEN = 576
PROBE_LAYER, STEER_LAYER = 10, 14  # probe at post_mlp.10, steer at post_mlp.14 (and pre_attn.16)
SCALE = 60.0
PROMPT = "The capital of France is"
LOGPROB_ATOL = 2e-3  # float32 vLLM-CPU vs transformers, as the other oracle tests


def test_the_op_gates_conditional_rows_and_leaves_the_others_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    n, d, r = 6, 16, 4
    x, res = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    w = torch.rand(d, generator=g) + 0.5
    ta, tb = torch.randn(r, d, generator=g), torch.randn(r, d, generator=g)
    ta[0] = tb[0] = 0
    one = torch.ones(1, dtype=torch.uint8)
    index = torch.tensor([0, 1, 2, 2, 3, 1], dtype=torch.int32)  # row 1 plain, 2 gated at A, 3 gated earlier
    site_a, site_b = site_order("post_mlp", 4), site_order("pre_attn", 5)
    cond_site = torch.tensor([-1, -1, site_a, site_order("post_mlp", 2)], dtype=torch.int32)
    params_ = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0.3, 2.0, 0, 0], [0, 0, 1, 0]], dtype=torch.float32)
    probe = torch.randn(r, d, generator=g)
    gate = torch.tensor([9.0, 9.0, 9.0, 9.0, 0.25, 9.0, 7.0])  # row 3's token: its gate from an earlier norm
    out, new_res = steered_cond_rms_norm_naive(x, res, w, 1e-6, 0.0, index, ta, one, tb, one, cond_site, params_,
                                               probe, gate, torch.tensor([site_a, site_b], dtype=torch.int32))
    s0 = x + res
    want_gate = torch.tensor([9.0, 9.0, 0.0, 0.0, 0.25, 9.0])
    for t in (2, 3):  # computed here, at slot A, from the stream before A's add
        want_gate[t] = torch.sigmoid(2.0 * ((s0[t] * probe[2]).sum() - 0.3))
    weight = torch.where(cond_site[index.long()] >= 0, want_gate, torch.ones(n))
    s = s0 + ta[index.long()] * weight[:, None] + tb[index.long()] * weight[:, None]
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(gate[:n], want_gate)
    assert gate[n] == 7.0  # past this step's tokens: untouched
    plain_out, plain_res = steered_rms_norm_naive(x, res, w, 1e-6, 0.0, index, ta, one, tb, one)
    for t in (0, 1, 5):  # unsteered and unconditional rows: the plain op, bit for bit
        assert torch.equal(new_res[t], plain_res[t]) and torch.equal(out[t], plain_out[t])


def _frontend(**steer):
    from vllm_steer.frontend.prepare import SteeringFrontend

    mc = SimpleNamespace(dtype=torch.float32, hf_text_config=SimpleNamespace(num_hidden_layers=8),
                         get_hidden_size=lambda: 8)
    return SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": steer}))


V = [0.5] * 8


@pytest.mark.parametrize("cond, steer, field, words", [
    ({"site": "post_mlp.2", "probe": V}, {"post_mlp": {"1": V}}, "steering_condition.site", "before the probe"),
    ({"site": "post_mlp.2", "probe": V}, None, "steering_condition", "has none"),
    ({"site": "pre_attn.0", "probe": V}, {"post_mlp": {"1": V}}, "steering_condition.site", "embeddings"),
    ({"site": "post_mlp.9", "probe": V}, {"post_mlp": {"1": V}}, "steering_condition.site", "out of range"),
    ({"site": "post_mlp.2"}, {"post_mlp": {"3": V}}, "steering_condition.probe", "required"),
    ({"site": "post_mlp.2", "probe": V[:3]}, {"post_mlp": {"3": V}}, "steering_condition.probe", "8 floats"),
    ({"site": "post_mlp.2", "probe": [float("nan")] * 8}, {"post_mlp": {"3": V}}, "steering_condition.probe", "NaN"),
    ({"site": "post_mlp.2", "probe": V, "sharpness": 0}, {"post_mlp": {"3": V}}, "steering_condition.sharpness", "> 0"),
    ({"site": "post_mlp.2", "probe": V, "threshold": 1e39}, {"post_mlp": {"3": V}}, "steering_condition.threshold",
     "overflows"),
    ({"site": "post_mlp.2", "probe": V, "mode": "maybe"}, {"post_mlp": {"3": V}}, "steering_condition.mode", "soft"),
    ({"site": "post_mlp.2", "probe": V, "when": 1}, {"post_mlp": {"3": V}}, "steering_condition.when", "unknown"),
    ("post_mlp.2", {"post_mlp": {"3": V}}, "steering_condition", "expected"),
])
def test_bad_conditions_are_refused_naming_the_field(cond, steer, field, words):
    fe = _frontend(conditions=True)
    extra = {"steering_condition": cond, **({"steering_vectors": steer} if steer else {})}
    with pytest.raises(SteeringSpecError) as e:
        fe.engine_extra_args(extra)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_a_condition_needs_steer_conditions_and_changes_the_key():
    extra = {"steering_condition": {"site": "post_mlp.2", "probe": V}, "steering_vectors": {"post_mlp": {"3": V}}}
    with pytest.raises(SteeringSpecError) as e:
        _frontend().engine_extra_args(extra)
    assert e.value.field == "steering_condition" and "steer.conditions" in str(e.value)
    fe = _frontend(conditions=True)
    _, pk, dk = fe.engine_extra_args(extra)
    _, plain, _ = fe.engine_extra_args({"steering_vectors": extra["steering_vectors"]})
    _, harder, _ = fe.engine_extra_args({**extra, "steering_condition": {**extra["steering_condition"], "mode": "hard"}})
    assert pk == dk and len({pk, plain, harder}) == 3  # rows, and prefix-cache salt, differ


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path):
    _, tok = hf_oracle.load(smollm2_path)
    return tok(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def probe_setup(smollm2_path, prompt_ids):
    """A probe direction and threshold under which the gate is open on some prompt tokens and shut on
    others (read from transformers' residual at the probe site), and the steering vectors."""
    model, _ = hf_oracle.load(smollm2_path)
    with torch.no_grad():
        hidden = model(torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states[PROBE_LAYER + 1][0]
    probe = vector(HIDDEN, 7, 1.0)
    scores = hidden.numpy() @ probe
    ranked = np.sort(scores)  # halfway between two tokens' scores: no token sits on a hard gate's edge
    threshold = float((ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2)
    sharpness = float(4.0 / (scores.std() + 1e-6))
    return {"probe": probe, "threshold": threshold, "sharpness": sharpness, "scores": scores,
            "v1": vector(HIDDEN, 1, SCALE), "v2": vector(HIDDEN, 2, SCALE / 2)}


def _condition(ps: dict, mode: str) -> dict:
    return {"site": f"post_mlp.{PROBE_LAYER}", "probe": [float(x) for x in ps["probe"]], "threshold": ps["threshold"],
            "sharpness": ps["sharpness"], "mode": mode}


def _vectors(ps: dict) -> dict:
    return {**floats("post_mlp", STEER_LAYER, ps["v1"]), **floats("pre_attn", STEER_LAYER + 2, ps["v2"])}


@pytest.fixture(scope="module")
def cond_run(smollm2_path, prompt_ids, probe_setup, tmp_path_factory):
    ps = probe_setup
    batch = [params(steering_vectors=_vectors(ps), steering_condition=_condition(ps, "soft")),
             params(steering_vectors=_vectors(ps), steering_condition=_condition(ps, "hard")),
             params(steering_vectors=_vectors(ps)),
             params()]
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 8,
              "distributed_executor_backend": "uni", "additional_config": {"steer": {"max_configs": 8,
                                                                                    "conditions": True}}}
    job = {"model": smollm2_path, "llm_kwargs": engine,
           "calls": [{"prompts": [{"prompt_token_ids": list(prompt_ids)}] * len(batch), "params": batch}]
           + [{"prompts": [{"prompt_token_ids": list(prompt_ids)}], "params": [p]} for p in batch[:2]]}
    res = run_job(job, tmp_path_factory.mktemp("cond"))
    return {"mixed": res["calls"][0], "alone": [c[0] for c in res["calls"][1:]]}


def _hf_gated(path: str, prompt_ids: list[int], ps: dict, mode: str):
    """transformers with hooks: the gate from the residual leaving layer PROBE_LAYER, then each vector
    scaled by its token's gate."""
    probe = torch.from_numpy(ps["probe"])
    gate: dict[str, torch.Tensor] = {}

    def read_gate(s: torch.Tensor) -> torch.Tensor:
        z = s @ probe - ps["threshold"]
        gate["g"] = (z > 0).float() if mode == "hard" else torch.sigmoid(ps["sharpness"] * z)
        return s

    def add(v: np.ndarray):
        vt = torch.from_numpy(v)
        return lambda s: s + gate["g"][..., None] * vt

    edits = [("post_mlp", PROBE_LAYER, read_gate), ("post_mlp", STEER_LAYER, add(ps["v1"])),
             ("pre_attn", STEER_LAYER + 2, add(ps["v2"]))]
    return hf_oracle.greedy(path, prompt_ids, 12, edits=edits)


@pytest.mark.parametrize("i, mode", [(0, "soft"), (1, "hard")])
def test_gated_steering_matches_transformers_with_the_same_gate(cond_run, smollm2_path, prompt_ids, probe_setup, i,
                                                                mode):
    ref_tokens, ref_lps = _hf_gated(smollm2_path, prompt_ids, probe_setup, mode)
    got = cond_run["mixed"][i]
    assert got["token_ids"] == ref_tokens
    np.testing.assert_allclose(got["logprobs"], ref_lps, atol=LOGPROB_ATOL)
    alone = cond_run["alone"][i]  # a mixed batch changes nothing
    assert alone["token_ids"] == got["token_ids"]
    np.testing.assert_allclose(alone["logprobs"], got["logprobs"], atol=1e-4)


def test_the_gate_matters_and_the_neighbours_are_untouched(cond_run, smollm2_path, prompt_ids, probe_setup):
    scores = probe_setup["scores"]
    assert (scores > probe_setup["threshold"]).any() and (scores < probe_setup["threshold"]).any()
    soft, hard, ungated, plain = cond_run["mixed"]
    assert soft["token_ids"] != ungated["token_ids"] and soft["token_ids"] != plain["token_ids"]
    ref_ungated, lps = hf_oracle.greedy(smollm2_path, prompt_ids, 12, {
        "post_mlp": {STEER_LAYER: probe_setup["v1"]}, "pre_attn": {STEER_LAYER + 2: probe_setup["v2"]}})
    assert ungated["token_ids"] == ref_ungated
    np.testing.assert_allclose(ungated["logprobs"], lps, atol=LOGPROB_ATOL)
    ref_plain, plps = hf_oracle.greedy(smollm2_path, prompt_ids, 12)
    assert plain["token_ids"] == ref_plain
    np.testing.assert_allclose(plain["logprobs"], plps, atol=LOGPROB_ATOL)


def _http(base: str, model: str, stream: bool = False, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream,
        **fields})


def test_over_http_an_open_gate_steers_fully_and_a_shut_one_not_at_all(api_server):
    """The OpenAI route (the shared server runs steer.conditions): a hard gate whose threshold every
    token passes gives the unconditional text, one no token passes the unsteered text; both report
    their own keys. Bad conditions are 400s naming the field, streaming too, before any byte."""
    base, model = api_server[0], api_server[1]
    vecs = {"post_mlp": {str(STEER_LAYER): vector(HIDDEN, 1, SCALE).tolist()}}
    probe = vector(HIDDEN, 7, 1.0).tolist()

    def gated(threshold: float) -> dict:
        return {"site": f"post_mlp.{PROBE_LAYER}", "probe": probe, "threshold": threshold, "mode": "hard"}

    steered = _http(base, model, steering_vectors=vecs).json()
    plain = _http(base, model).json()
    opened = _http(base, model, steering_vectors=vecs, steering_condition=gated(-1e30)).json()
    shut = _http(base, model, steering_vectors=vecs, steering_condition=gated(1e30)).json()
    assert steered["choices"][0]["text"] != plain["choices"][0]["text"]
    assert opened["choices"][0]["text"] == steered["choices"][0]["text"]
    assert shut["choices"][0]["text"] == plain["choices"][0]["text"]
    assert len({steered["steering"]["prefill"], opened["steering"]["prefill"], shut["steering"]["prefill"]}) == 3
    for stream in (False, True):
        r = _http(base, model, stream=stream, steering_vectors=vecs,
                  steering_condition={**gated(0.0), "probe": probe[:5]})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
        assert r.json()["error"]["param"] == "steering_condition.probe"
