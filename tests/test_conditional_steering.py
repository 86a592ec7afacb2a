"""Conditional steering (``steering_condition``, issue 27): the op against a hand computation, the front
end's refusals (each names its field), and the engine against transformers with forward hooks that
compute the same gate from the same residual (SmolLM2, float32, CPU lane), in a mixed batch; what capture
reads at a gated site and just after it."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from tests import hf_oracle
from tests.engine_job import run_job
from tests.server import scrape_metrics
from tests.sae_writers import write_gemma_scope
from tests.sae_oracle import sae_edit
from tests.steering_cases import floats, params, vector
from tests.test_sae_engine import BIG as SAE_BIG, CAP_DIR, RESIDUAL_ATOL, RESIDUAL_RTOL, SAES, \
    stream_into
from vllm_steer.capture.activations import decode_result
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.hooks import site_order
from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive

HIDDEN = 576
PROBE_LAYER, STEER_LAYER = 10, 14  # probe at post_mlp.10, steer at post_mlp.14 (and pre_attn.16)
SCALE = 60.0
PROMPT = "The capital of France is"
LOGPROB_ATOL = 2e-3  # float32 vLLM-CPU vs transformers, as the other oracle tests
# request 0 (soft gate) captures the gated site post_mlp.14 and pre_attn.15, the same point after its steering
CAPTURED = [f"post_mlp.{STEER_LAYER}", f"pre_attn.{STEER_LAYER + 1}"]
CAPTURE = {"activations": {"sites": CAPTURED, "positions": "all_prompt", "reduce": "last"}}


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
    params_ = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0], [0.3, 2.0, 0, 0], [0, 0, 1, 0]], dtype=torch.float32)
    probe = torch.randn(r, d, generator=g)
    gate = torch.tensor([9.0, 9.0, 9.0, 9.0, 0.25, 9.0, 7.0])  # row 3's token: its gate from an earlier norm
    site_ids = torch.tensor([site_a, site_b], dtype=torch.int32)
    out, new_res = steered_norm_naive(x, res, w, 1e-6, 0.0, index, vec_a=(ta, one), vec_b=(tb, one),
                                      cond=(cond_site, params_, probe, site_ids), gate=gate)
    s0 = x + res
    want_gate = torch.tensor([9.0, 9.0, 0.0, 0.0, 0.25, 9.0])
    for t in (2, 3):  # computed here, at slot A, from the stream before A's add
        want_gate[t] = torch.sigmoid(2.0 * ((s0[t] * probe[2]).sum() - 0.3))
    weight = torch.where(cond_site[index.long()] >= 0, want_gate, torch.ones(n))
    s = s0 + ta[index.long()] * weight[:, None] + tb[index.long()] * weight[:, None]
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(gate[:n], want_gate)
    assert gate[n] == 7.0  # past this step's tokens: untouched
    plain_out, plain_res = steered_norm_naive(x, res, w, 1e-6, 0.0, index, vec_a=(ta, one), vec_b=(tb, one))
    for t in (0, 1, 5):  # unsteered and unconditional rows: the plain op, bit for bit
        assert torch.equal(new_res[t], plain_res[t]) and torch.equal(out[t], plain_out[t])
    params_[0, 3] = 0  # no live row has a condition (runtime.condition_tables keeps the flag): the plain op
    idle = steered_norm_naive(x, res, w, 1e-6, 0.0, index, vec_a=(ta, one), vec_b=(tb, one),
                              cond=(cond_site, params_, probe, torch.tensor([site_a, site_b], dtype=torch.int32)),
                              gate=gate)
    assert torch.equal(idle[0], plain_out) and torch.equal(idle[1], plain_res)


def _frontend(**steer):
    from vllm_steer.frontend.prepare import SteeringFrontend

    mc = SimpleNamespace(dtype=torch.float32, hf_text_config=SimpleNamespace(num_hidden_layers=8),
                         get_hidden_size=lambda: 8)
    return SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": steer}))


V = [0.5] * 8


def _packed(values: list[float], dtype: str = "float32") -> str:
    import base64

    from vllm_steer.core import bf16

    arr = np.asarray(values, dtype=np.float32)
    raw = bf16.to_bits(arr).tobytes() if dtype == "bfloat16" else arr.astype(dtype).tobytes()
    return base64.b64encode(raw).decode()


def test_a_packed_probe_is_the_same_probe_as_its_floats():
    fe = _frontend(conditions=True)
    probe = [0.25 * (i - 3) for i in range(8)]  # exact in every packed dtype
    steer = {"steering_vectors": {"post_mlp": {"6": V}}}
    listed, key, _ = fe.resolve({**steer, "steering_condition": {"site": "post_mlp.4", "probe": probe}})
    for dtype in ("float32", "float16", "bfloat16"):
        packed, pkey, _ = fe.resolve({**steer, "steering_condition": {
            "site": "post_mlp.4", "probe": {"dtype": dtype, "data": _packed(probe, dtype)}}})
        assert pkey == key and packed.condition == listed.condition, dtype
    raw = np.asarray(probe, dtype=np.float32).tobytes()  # bytes, as a msgpack body carries them
    _, bkey, _ = fe.resolve({**steer, "steering_condition": {"site": "post_mlp.4",
                                                              "probe": {"dtype": "float32", "data": raw}}})
    assert bkey == key


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
    ({"site": "post_mlp.2", "probe": V, "phase": "prompt"}, {"post_mlp": {"3": V}}, "steering_condition.phase",
     "decode"),
    ({"site": "post_mlp.2", "probe": V, "phase": "decode"}, {"prefill": {"post_mlp": {"3": V}}},
     "steering_condition", "none in its decode phase"),
    ({"site": "post_mlp.2", "probe": V, "phase": "decode"}, {"prefill": {"post_mlp": {"1": V}}, "decode": {
        "post_mlp": {"1": V}}}, "steering_condition.site", "before the probe"),
    ({"site": "post_mlp.2", "probe": {"module": "nope"}}, {"post_mlp": {"3": V}}, "steering_condition.probe.module",
     "unknown steering module"),
    ({"site": "post_mlp.2", "probe": {"module": "cond-probe", "layer": 3}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.layer", "unknown key"),
    ({"site": "post_mlp.2", "probe": {"module": "cond-probe"}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.module", "no vector at post_mlp.2"),
    ({"site": "post_mlp.2", "probe": {"module": "cond-probe", "site": "post_mlp.6"}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.site", "no vector at post_mlp.6"),
    ({"site": "post_mlp.2", "probe": {"module": "cond-probe", "site": "post_mlp.5"}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.module", "ambiguous"),
    ("post_mlp.2", {"post_mlp": {"3": V}}, "steering_condition", "expected"),
    ({"site": "post_mlp.2", "probe": V, "stop_when": {"tokens": 2}}, {"post_mlp": {"3": V}},
     "steering_condition.stop_when.above", "required"),
    ({"site": "post_mlp.2", "probe": V, "stop_when": {"above": 1.0}}, {"post_mlp": {"3": V}},
     "steering_condition.stop_when.above", "[0, 1)"),
    ({"site": "post_mlp.2", "probe": V, "stop_when": {"above": 0.5, "tokens": 0}}, {"post_mlp": {"3": V}},
     "steering_condition.stop_when.tokens", "integer"),
    ({"site": "post_mlp.2", "probe": V, "stop_when": {"above": 0.5, "tokens": True}}, {"post_mlp": {"3": V}},
     "steering_condition.stop_when.tokens", "integer"),
    ({"site": "post_mlp.2", "probe": V, "stop_when": {"above": 0.5, "after": 2}}, {"post_mlp": {"3": V}},
     "steering_condition.stop_when.after", "unknown key"),
    ({"site": "post_mlp.2", "probe": V, "stop_when": 0.5}, {"post_mlp": {"3": V}},
     "steering_condition.stop_when", "expected"),
    ({"site": "post_mlp.2", "probe": V, "phase": "prefill", "stop_when": {"above": 0.5}}, {"post_mlp": {"3": V}},
     "steering_condition.stop_when", "must gate decode"),
    ({"site": "post_mlp.2", "probe": {"dtype": "int8", "data": ""}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.dtype", "unknown dtype"),
    ({"site": "post_mlp.2", "probe": {"dtype": "float32", "data": "AAAA"}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.data", "needs 32"),
    ({"site": "post_mlp.2", "probe": {"dtype": "float32", "data": "%%%"}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.data", "base64"),
    ({"site": "post_mlp.2", "probe": {"dtype": "float32", "data": _packed([float("inf")] * 8)}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.data", "Inf"),
    ({"site": "post_mlp.2", "probe": {"dtype": "float32", "data": _packed(V), "module": "m"}}, {"post_mlp": {"3": V}},
     "steering_condition.probe.module", "unknown key"),
    ({"site": "post_mlp.2", "probe": V, "applies_to": "clamps"}, {"post_mlp": {"3": V}},
     "steering_condition.applies_to", "'both'"),
    ({"site": "post_mlp.2", "probe": V, "applies_to": "sae"}, {"post_mlp": {"3": V}},
     "steering_condition", "scales SAE clamps"),
])
def test_bad_conditions_are_refused_naming_the_field(cond, steer, field, words, probe_module):
    fe = _frontend(conditions=True)
    tiers = steer if steer and {"prefill", "decode"} & set(steer) else {"steering_vectors": steer} if steer else {}
    extra = {"steering_condition": cond, **{(k if k == "steering_vectors" else f"{k}_steering_vectors"): v
                                            for k, v in tiers.items()}}
    with pytest.raises(SteeringSpecError) as e:
        fe.engine_extra_args(extra)
    assert e.value.field == field and words in str(e.value), str(e.value)


@pytest.fixture
def probe_module():
    """A named module ``cond-probe`` in this process's store: post_mlp.4 in both phases (one vector),
    post_mlp.5 different in each."""
    from vllm_steer.frontend.module_registration import module_from_json
    from vllm_steer.frontend.module_store import STORE

    fe = _frontend(conditions=True)
    w = [0.25 * (i + 1) for i in range(8)]
    module = module_from_json({"name": "cond-probe", "steering_vectors": {"post_mlp": {"4": w}},
                               "prefill_steering_vectors": {"post_mlp": {"5": V}},
                               "decode_steering_vectors": {"post_mlp": {"5": w}}}, fe.shape)
    module.version = STORE.next_version()
    STORE.publish(module)
    yield w
    STORE.drop("cond-probe")


def test_a_probe_named_by_module_is_its_vector_and_a_phase_gates_only_that_phase(probe_module):
    fe = _frontend(conditions=True)
    steer = {"steering_vectors": {"post_mlp": {"6": V}}}
    cond = {"site": "post_mlp.4", "probe": probe_module, "threshold": 0.5}
    explicit, pk, dk = fe.resolve({**steer, "steering_condition": cond})
    for probe in ({"module": "cond-probe"}, {"module": "cond-probe", "site": "post_mlp.4"}):
        named, npk, ndk = fe.resolve({**steer, "steering_condition": {**cond, "probe": probe}})
        assert (npk, ndk) == (pk, dk) and named.condition == explicit.condition  # the same probe bytes
    _, plain, _ = fe.resolve(steer)
    decode_only, dpk, ddk = fe.resolve({**steer, "steering_condition": {**cond, "phase": "decode"}})
    assert dpk == plain and ddk == dk and set(decode_only.condition) == {dk}  # prefill unconditional
    assert set(decode_only.configs) == {plain, dk}
    prefill_only, ppk, pdk = fe.resolve({**steer, "steering_condition": {**cond, "phase": "prefill"}})
    assert ppk == pk and pdk == plain and set(prefill_only.condition) == {pk}


def test_stop_when_travels_beside_the_rows_and_keeps_the_key():
    fe = _frontend(conditions=True)
    cond = {"site": "post_mlp.2", "probe": V}
    base = fe.engine_extra_args({"steering_condition": cond, "steering_vectors": {"post_mlp": {"3": V}}}).payload
    for phase, from_prompt in (("both", True), ("decode", False)):
        payload = fe.engine_extra_args({"steering_condition": {**cond, "phase": phase, "stop_when": {"above": 0.25}},
                                        "steering_vectors": {"post_mlp": {"3": V}}}).payload
        assert payload.stop_when == (0.25, 1, from_prompt)
        if phase == "both":  # the same rows, keys and salt as without the stop
            assert payload.prefill == base.prefill and base.stop_when is None


def test_a_condition_needs_steer_conditions_and_changes_the_key():
    extra = {"steering_condition": {"site": "post_mlp.2", "probe": V}, "steering_vectors": {"post_mlp": {"3": V}}}
    with pytest.raises(SteeringSpecError) as e:
        _frontend().engine_extra_args(extra)
    assert e.value.field == "steering_condition" and "steer.conditions" in str(e.value)
    fe = _frontend(conditions=True)
    _, pk, dk = fe.resolve(extra)
    _, plain, _ = fe.resolve({"steering_vectors": extra["steering_vectors"]})
    _, harder, _ = fe.resolve({**extra, "steering_condition": {**extra["steering_condition"], "mode": "hard"}})
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


# Request 10: projections gated (applies_to "projections"; its vectors ungated): a cap at the SAE site
# post_mlp.14 (the SAE norm's op reads the gate) and an ablation at pre_attn.16
UNIT_CAP = (CAP_DIR / np.linalg.norm(CAP_DIR.astype(np.float64))).astype(np.float32)
PROJ_ABLATE = vector(HIDDEN, 9, 1.0)
PROJECTIONS = {f"post_mlp.{STEER_LAYER}": [{"direction": CAP_DIR.tolist(), "mode": "cap", "min": 25.0}],
               f"pre_attn.{STEER_LAYER + 2}": [{"direction": (PROJ_ABLATE * 5).tolist(), "mode": "ablate"}]}
PROJ_OPS = {STEER_LAYER: [(UNIT_CAP, 25.0, np.inf)], STEER_LAYER + 2: [(PROJ_ABLATE, 0.0, 0.0)]}


def _condition(ps: dict, mode: str, phase: str = "both", applies_to: str | list = "vectors") -> dict:
    return {"site": f"post_mlp.{PROBE_LAYER}", "probe": [float(x) for x in ps["probe"]], "threshold": ps["threshold"],
            "sharpness": ps["sharpness"], "mode": mode, "phase": phase, "applies_to": applies_to}


# An SAE at STEER_LAYER's post_mlp site (so the vectors there run through the SAE norm's conditional op
# too), and its clamps gated alone (applies_to sae) or with the vectors (both): requests 8 and 9
SAE_SITE = ("post_mlp", STEER_LAYER)
SAE_CLAMPS = {"name": "gs", "clamps": SAE_BIG}


def _vectors(ps: dict) -> dict:
    return {**floats("post_mlp", STEER_LAYER, ps["v1"]), **floats("pre_attn", STEER_LAYER + 2, ps["v2"])}


def _open_gate(phase: str, tokens: int) -> dict:
    """A hard gate every token passes, stopping after ``tokens`` gates read."""
    return {"site": f"post_mlp.{PROBE_LAYER}", "probe": [1.0] * HIDDEN, "threshold": -1e30, "mode": "hard",
            "phase": phase, "stop_when": {"above": 0.5, "tokens": tokens}}


@pytest.fixture(scope="module")
def stop_setup(smollm2_path, prompt_ids, probe_setup):
    """The soft gate along transformers' gated generation (the probe site is before every steered site,
    so its residual is the unsteered model's on those tokens), and a ``stop_when`` bound halfway between
    two of its values: where two consecutive gates first pass it is where the engine must stop."""
    ps = probe_setup
    tokens, _ = hf_oracle.greedy(smollm2_path, prompt_ids, 12, edits=_hf_gated(smollm2_path, prompt_ids, ps, "soft"))
    model, _ = hf_oracle.load(smollm2_path)
    with torch.no_grad():
        hidden = model(torch.tensor([prompt_ids + tokens]), output_hidden_states=True).hidden_states[PROBE_LAYER + 1][0]
    z = hidden.numpy() @ ps["probe"] - ps["threshold"]
    gates = 1 / (1 + np.exp(-ps["sharpness"] * z))[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(tokens)]
    ranked = np.sort(gates)
    gaps = np.diff(ranked)[len(ranked) // 4:]  # the widest gap above the lowest quarter
    k = len(ranked) // 4 + int(np.argmax(gaps))
    above = float((ranked[k] + ranked[k + 1]) / 2)
    over = gates > above
    stop = next((j for j in range(1, len(gates)) if over[j] and over[j - 1]), None)
    return {"tokens": tokens, "gates": gates, "above": above, "stop": stop, "gap": float(gaps.max())}


@pytest.fixture(scope="module")
def cond_run(smollm2_path, prompt_ids, probe_setup, stop_setup, tmp_path_factory):
    ps = probe_setup
    soft_stop = {**_condition(ps, "soft"), "stop_when": {"above": stop_setup["above"], "tokens": 2}}
    batch = [params(steering_vectors=_vectors(ps), steering_condition=_condition(ps, "soft"), capture=CAPTURE),
             params(steering_vectors=_vectors(ps), steering_condition=_condition(ps, "hard")),
             params(steering_vectors=_vectors(ps)),
             params(),
             params(steering_vectors=_vectors(ps), steering_condition=_condition(ps, "soft", "decode")),
             params(steering_vectors=_vectors(ps), steering_condition=soft_stop),
             params(steering_vectors=_vectors(ps), steering_condition=_open_gate("both", 3)),
             params(steering_vectors=_vectors(ps), steering_condition=_open_gate("decode", 3)),
             params(sae=SAE_CLAMPS, steering_condition=_condition(ps, "soft", applies_to="sae")),
             params(sae=SAE_CLAMPS, steering_vectors=_vectors(ps), steering_condition=_condition(ps, "hard",
                                                                                                   applies_to="both")),
             params(steering_vectors=_vectors(ps), steering_projections=PROJECTIONS,
                    steering_condition=_condition(ps, "soft", applies_to="projections"))]
    d = tmp_path_factory.mktemp("cond")
    sae = {"gs": {"path": write_gemma_scope(str(d / "gs"), SAES["gs"][SAE_SITE]), "site": "post_mlp.%d" % STEER_LAYER}}
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 11,
              "distributed_executor_backend": "uni", "additional_config": {"steer": {"max_configs": 12,
                                                                                    "max_projections": 1,
                                                                                    "conditions": True, "sae": sae,
                                                                                    "capture": ["activations"]}}}
    job = {"model": smollm2_path, "llm_kwargs": engine,
           "calls": [{"prompts": [{"prompt_token_ids": list(prompt_ids)}] * len(batch), "params": batch}]
           + [{"prompts": [{"prompt_token_ids": list(prompt_ids)}], "params": [p]} for p in batch[:2]]
           + [{"llm_call": "vllm_steer.frontend.module_registration:register_module",  # the LLM path of a module's own
               "kwargs": {"name": "gated", "steering_vectors": _vectors(ps),         # condition: like batch[0]
                          "steering_condition": _condition(ps, "soft")}},
              {"prompts": [{"prompt_token_ids": list(prompt_ids)}],
               "params": [params(steering_module={"name": "gated", "scale": 1.0})]}],
           "collect_capture": True}
    res = run_job(job, d)
    return {"mixed": res["calls"][0], "alone": [c[0] for c in res["calls"][1:3]], "module": res["calls"][4][0]}


def _hf_gated(path: str, prompt_ids: list[int], ps: dict, mode: str, phase: str = "both", applies_to: str = "vectors",
              clamps: list | None = None, vectors: bool = True, projections: dict | None = None) -> list:
    """The stream edits of transformers gated as the engine: the gate from the residual leaving layer PROBE_LAYER,
    then at each later site the SAE clamp's move (``clamps``, at SAE_SITE), the projections' (``projections``:
    layer -> [(unit v, lo, hi)] at STEER_LAYER's post_mlp and STEER_LAYER + 2's pre_attn) and each vector, scaled
    by its token's gate as ``applies_to`` says (``phase`` decode: the prompt's tokens ungated, the generated
    ones gated)."""
    return _gated_edits(len(prompt_ids), ps, mode, phase, applies_to, clamps, vectors, projections)[0]


def _gated_edits(n_prompt: int, ps: dict, mode: str, phase: str = "both", applies_to: str = "vectors",
                 clamps: list | None = None, vectors: bool = True, projections: dict | None = None) -> tuple[list, dict]:
    """``_hf_gated``'s stream edits, and the dict whose ``"g"`` holds the last forward's gates per token."""
    probe = torch.from_numpy(ps["probe"])
    gate: dict[str, torch.Tensor] = {}

    def read_gate(s: torch.Tensor) -> torch.Tensor:
        z = s @ probe - ps["threshold"]
        gate["g"] = (z > 0).float() if mode == "hard" else torch.sigmoid(ps["sharpness"] * z)
        if phase == "decode":  # each forward runs the whole sequence: positions past the prompt are decode's
            gate["g"][..., :n_prompt] = 1.0
        return s

    gated = {"both": ("vectors", "sae")}.get(applies_to, applies_to)

    def weight(what: str) -> torch.Tensor:
        return gate["g"][..., None] if what in gated else torch.ones(())

    def project(s: torch.Tensor, ops: list) -> torch.Tensor:
        for v, lo, hi in ops:
            v = torch.from_numpy(v)
            p = s @ v
            s = s + (p.clamp(lo, hi) - p)[..., None] * v
        return s

    def add(v: np.ndarray | None, clamp=None, ops=None):
        vt = torch.from_numpy(v) if v is not None and vectors else torch.zeros(())

        def edit(s: torch.Tensor) -> torch.Tensor:
            if clamp is not None:  # the clamp first, as at every site: its move scaled
                s = s + weight("sae") * (clamp(s) - s)
            if ops:  # then the projections' move
                s = s + weight("projections") * (project(s, ops) - s)
            return s + weight("vectors") * vt
        return edit

    clamp = sae_edit(SAES["gs"][SAE_SITE], "delta", clamps) if clamps else None
    ops = projections or {}
    edits = [("post_mlp", PROBE_LAYER, read_gate), ("post_mlp", STEER_LAYER, add(ps["v1"], clamp, ops.get(STEER_LAYER))),
             ("pre_attn", STEER_LAYER + 2, add(ps["v2"], None, ops.get(STEER_LAYER + 2)))]
    return edits, gate


@pytest.mark.parametrize("i, mode, phase", [(0, "soft", "both"), (1, "hard", "both"), (4, "soft", "decode")])
def test_gated_steering_matches_transformers_with_the_same_gate(cond_run, smollm2_path, prompt_ids, probe_setup, i,
                                                                mode, phase):
    got = cond_run["mixed"][i]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, edits=_hf_gated(smollm2_path, prompt_ids, probe_setup,
                                                                               mode, phase), atol=LOGPROB_ATOL)
    if i >= len(cond_run["alone"]):
        return
    alone = cond_run["alone"][i]  # a mixed batch changes nothing
    assert alone["token_ids"] == got["token_ids"]
    np.testing.assert_allclose(alone["logprobs"], got["logprobs"], atol=1e-4)
    if i == 0:  # a module registered on the LLM with the same vectors and condition runs the same
        assert cond_run["module"]["token_ids"] == got["token_ids"]
        np.testing.assert_allclose(cond_run["module"]["logprobs"], got["logprobs"], atol=1e-4)


@pytest.mark.parametrize("i, mode, applies_to, vectors", [(8, "soft", "sae", False), (9, "hard", "both", True)])
def test_gated_sae_clamps_match_transformers_with_the_same_gate(cond_run, smollm2_path, prompt_ids, probe_setup, i,
                                                                mode, applies_to, vectors):
    """``applies_to``: the clamp's move at the SAE site (and the vectors, for ``both``) scaled by the gate,
    in the same mixed batch (whose other requests' vectors at that site ran through the SAE norm too)."""
    got = cond_run["mixed"][i]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, edits=_hf_gated(
        smollm2_path, prompt_ids, probe_setup, mode, applies_to=applies_to, clamps=SAE_BIG, vectors=vectors),
        atol=LOGPROB_ATOL)
    ungated = [("post_mlp", STEER_LAYER, sae_edit(SAES["gs"][SAE_SITE], "delta", SAE_BIG))]
    # the gate mattered: not the ungated clamp's greedy tokens, nor the plain request's
    assert not hf_oracle.is_greedy(got["token_ids"], smollm2_path, prompt_ids, edits=ungated)
    assert got["token_ids"] != cond_run["mixed"][3]["token_ids"]


def test_gated_projections_match_transformers_with_the_same_gate(cond_run, smollm2_path, prompt_ids, probe_setup):
    """``applies_to: "projections"``: each projection's move (a cap at the SAE site, an ablation at a plain
    norm) scaled by the gate, ``s + g * (projected(s) - s)``, the vectors at the same sites ungated."""
    got = cond_run["mixed"][10]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, edits=_hf_gated(
        smollm2_path, prompt_ids, probe_setup, "soft", applies_to="projections", projections=PROJ_OPS),
        atol=LOGPROB_ATOL)
    ungated = _hf_gated(smollm2_path, prompt_ids, probe_setup, "soft", applies_to=(), projections=PROJ_OPS)
    # the gate mattered: not the ungated projections' greedy tokens, nor the ungated vectors' request's
    assert not hf_oracle.is_greedy(got["token_ids"], smollm2_path, prompt_ids, edits=ungated)
    assert got["token_ids"] != cond_run["mixed"][2]["token_ids"]


@pytest.mark.parametrize("site", CAPTURED)
def test_capture_reads_the_stream_before_its_own_sites_gated_vector_and_after_earlier_ones(
        cond_run, smollm2_path, prompt_ids, probe_setup, site):
    """At the last prompt token (soft gate ~0.23 there): post_mlp.14, the gated vector's site, is
    transformers' pristine stream; pre_attn.15, the same point read after post_mlp.14's steering, is that
    stream plus the vector scaled by the gate transformers computes, neither the pristine nor the ungated one."""
    got = cond_run["mixed"][0]["capture"]["activations"]
    assert got["count"] == [len(prompt_ids)] * 2 and got["dropped_rows"] == 0, got
    edits, gate = _gated_edits(len(prompt_ids), probe_setup, "soft")
    pristine = stream_into(smollm2_path, prompt_ids, STEER_LAYER + 1)
    streams = {"pristine": pristine, "gated": stream_into(smollm2_path, prompt_ids, STEER_LAYER + 1, edits),
               "ungated": pristine + probe_setup["v1"]}
    g = float(gate["g"][0, -1])
    assert 0.05 < g < 0.95, g  # neither open nor shut: the three readings are far apart
    want = "pristine" if site.startswith("post_mlp") else "gated"
    row = decode_result(got)[site]
    off = {k: round(float(np.abs(row - v).max()), 4) for k, v in streams.items()}
    np.testing.assert_allclose(row, streams[want], rtol=RESIDUAL_RTOL, atol=RESIDUAL_ATOL,
                               err_msg=f"{site}: max |diff| to each reading {off}")
    for other in set(streams) - {want}:
        assert not np.allclose(row, streams[other], rtol=RESIDUAL_RTOL, atol=RESIDUAL_ATOL), (site, other)


def test_stop_when_ends_a_request_where_transformers_gate_passes_the_bound(cond_run, stop_setup):
    """``stop_when``: the soft gate's request ends at the first two consecutive generated tokens whose
    gate (transformers' residual, same probe) is above the bound, with finish_reason "stop_when" and that
    gate as stop_reason; its tokens up to there are the gated ones. An always-open hard gate with
    ``tokens: 3`` stops after 3 tokens (the last prompt position's gate counts), after 4 when only decode
    is gated (the first token comes from an ungated position). The rest of the batch runs to max_tokens."""
    assert stop_setup["stop"] is not None and stop_setup["gap"] > 1e-2, stop_setup  # a bound with room
    j = stop_setup["stop"]
    soft = cond_run["mixed"][5]
    assert soft["finish_reason"] == "stop_when", soft
    assert soft["token_ids"] == stop_setup["tokens"][: j + 1]
    assert abs(float(soft["stop_reason"]) - stop_setup["gates"][j]) < 1e-2
    for got, n in ((cond_run["mixed"][6], 3), (cond_run["mixed"][7], 4)):
        assert (got["finish_reason"], len(got["token_ids"]), float(got["stop_reason"])) == ("stop_when", n, 1.0)
    assert [r["finish_reason"] for r in cond_run["mixed"][:5] + cond_run["mixed"][8:]] == ["length"] * 8


def test_the_gate_matters_and_the_neighbours_are_untouched(cond_run, smollm2_path, prompt_ids, probe_setup):
    scores = probe_setup["scores"]
    assert (scores > probe_setup["threshold"]).any() and (scores < probe_setup["threshold"]).any()
    soft, hard, ungated, plain, decode_gated = cond_run["mixed"][:5]
    assert soft["token_ids"] != ungated["token_ids"] and soft["token_ids"] != plain["token_ids"]
    # the prompt's last token ran ungated, so the first token is the ungated one; later ones are gated
    assert decode_gated["token_ids"][0] == ungated["token_ids"][0] and decode_gated["token_ids"] != ungated["token_ids"]
    hf_oracle.check_greedy(ungated, smollm2_path, prompt_ids, 12, {
        "post_mlp": {STEER_LAYER: probe_setup["v1"]}, "pre_attn": {STEER_LAYER + 2: probe_setup["v2"]}},
        atol=LOGPROB_ATOL, what="ungated")
    hf_oracle.check_greedy(plain, smollm2_path, prompt_ids, 12, atol=LOGPROB_ATOL, what="plain")


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


    counted, refused = 'vllm_steer_requests_total{kind="condition"}', \
        'vllm_steer_rejected_total{field="steering_condition",status="400"}'
    before = scrape_metrics(base)
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
    after = scrape_metrics(base)  # on /metrics: the two conditional requests, the two refusals of the field
    assert after[counted] - before.get(counted, 0.0) == 2 and after[refused] - before.get(refused, 0.0) == 2


def test_over_http_stop_when_finishes_with_its_own_reason(api_server):
    """Completions (streaming or not) and chat: a request whose open gate passes ``stop_when`` for 2
    tokens ends after 2 with finish_reason "stop_when" and the gate as stop_reason."""
    base, model = api_server[0], api_server[1]
    counted = "vllm_steer_stop_when_stops_total"
    before = scrape_metrics(base).get(counted, 0.0)
    fields = {"steering_vectors": {"post_mlp": {str(STEER_LAYER): vector(HIDDEN, 1, SCALE).tolist()}},
              "steering_condition": _open_gate("both", 2)}
    done = _http(base, model, **fields).json()
    assert (done["choices"][0]["finish_reason"], done["choices"][0]["stop_reason"],
            done["usage"]["completion_tokens"]) == ("stop_when", "1", 2), done
    events = [json.loads(line[6:]) for line in _http(base, model, stream=True, **fields).text.splitlines()
              if line.startswith("data: {")]
    last = [e["choices"][0] for e in events if e["choices"]][-1]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop_when", "1"), events[-3:]
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, **fields}).json()
    assert (chat["choices"][0]["finish_reason"], chat["usage"]["completion_tokens"]) == ("stop_when", 2), chat
    deadline = time.time() + 30  # on /metrics: the three stops (a scrape may answer an earlier question)
    while scrape_metrics(base).get(counted, 0.0) < before + 3:
        assert time.time() < deadline, scrape_metrics(base).get(counted)
        time.sleep(0.5)
    assert scrape_metrics(base)[counted] == before + 3


def test_a_condition_gates_sae_clamps_as_applies_to_says(tmp_path):
    """``applies_to``: the condition keys the phase's whole config (vectors and clamps), the clamps travel
    under that key; gated clamps before the probe, and a probe beside an SAE site, are refused; vectors a
    condition does not gate may sit before the probe; a module's condition must gate its vectors."""
    from tests.sae_writers import random_sae, write_gemma_scope
    from vllm_steer.frontend.module_registration import module_from_json

    path = write_gemma_scope(str(tmp_path / "gs"), random_sae(8, 16, "jumprelu", seed=1))
    fe = _frontend(conditions=True, max_configs=8, sae={"gs": {"path": path, "site": "post_mlp.6"}})
    clamps = {"name": "gs", "clamps": [{"feature": 3, "value": 2.0}]}
    cond = {"site": "post_mlp.4", "probe": V, "applies_to": "sae"}
    plain_sae, sk, _ = fe.resolve({"sae": clamps})
    gated, pk, dk = fe.resolve({"sae": clamps, "steering_condition": cond})
    assert pk == dk and pk != sk and set(gated.condition) == {pk} and gated.condition[pk][6] == 2
    assert set(gated.sae) == {pk} and gated.sae[pk] == plain_sae.sae[sk] and gated.configs[pk] == {}
    early = {"post_mlp": {"1": V}}  # vectors before the probe: fine while the condition gates only the clamps
    mixed, mk, _ = fe.resolve({"sae": clamps, "steering_condition": cond, "steering_vectors": early})
    assert mk not in (pk, sk) and mixed.configs[mk] and mixed.sae[mk] == gated.sae[pk]
    both, bk, _ = fe.resolve({"sae": clamps, "steering_condition": {**cond, "applies_to": "both"},
                              "steering_vectors": {"post_mlp": {"5": V}}})
    assert both.condition[bk][6] == 3
    for extra, field, words in (
            ({"steering_vectors": early, "steering_condition": {**cond, "applies_to": "both"}},
             "steering_condition.site", "before the probe"),
            ({"steering_condition": {**cond, "site": "post_mlp.7"}}, "steering_condition.site", "before the probe"),
            ({"steering_condition": {**cond, "site": "pre_attn.7", "applies_to": "vectors"},
              "steering_vectors": {"post_mlp": {"7": V}}}, "steering_condition.site", "shares its norm"),
            ({"steering_condition": {**cond, "phase": "decode"}, "sae": {**clamps, "phase": "prefill"}},
             "steering_condition", "none in its decode phase")):
        with pytest.raises(SteeringSpecError) as e:
            fe.resolve({"sae": clamps, **extra})
        assert e.value.field == field and words in str(e.value), (extra, str(e.value))
    with pytest.raises(SteeringSpecError) as e:
        module_from_json({"name": "m", "steering_vectors": {"post_mlp": {"5": V}}, "steering_condition": cond},
                         fe.module_shape, True)
    assert e.value.field == "steering_condition.applies_to" and "a module's condition gates its vectors" in str(e.value)


def test_a_module_carries_its_condition_to_the_requests_that_name_it(probe_module):
    from vllm_steer.frontend.module_registration import module_from_json
    from vllm_steer.frontend.module_store import STORE

    fe = _frontend(conditions=True)
    vecs = {"post_mlp": {"6": V}}
    cond = {"site": "post_mlp.4", "probe": {"module": "cond-probe"}, "threshold": 0.5, "mode": "hard"}
    body = {"name": "gated", "steering_vectors": vecs, "steering_condition": cond}
    with pytest.raises(SteeringSpecError) as e:  # only under steer.conditions
        module_from_json(body, fe.module_shape)
    assert e.value.field == "steering_condition" and "steer.conditions" in str(e.value)
    with pytest.raises(SteeringSpecError) as e:  # checked against the module's own vectors
        module_from_json({**body, "steering_vectors": {"post_mlp": {"1": V}}}, fe.module_shape, True)
    assert e.value.field == "steering_condition.site" and "before the probe" in str(e.value)
    with pytest.raises(SteeringSpecError) as e:
        module_from_json({**body, "steering_condition": {**cond, "mode": "maybe"}}, fe.module_shape, True)
    assert e.value.field == "steering_condition.mode"
    module = module_from_json(body, fe.module_shape, True)
    assert module.summary()["condition"] == cond
    inline = module_from_json({**body, "name": "gated2", "steering_condition": {**cond, "probe": V}}, fe.module_shape, True)
    assert inline.summary()["condition"]["probe"] == {"floats": 8}  # the listing does not echo the floats
    module.version = STORE.next_version()
    STORE.publish(module)
    try:
        carried, pk, dk = fe.resolve({"steering_module": {"name": "gated", "scale": 1.0}})
        sent, spk, sdk = fe.resolve({"steering_vectors": vecs, "steering_condition": cond})
        assert (pk, dk) == (spk, sdk) and carried.condition == sent.condition
        _, plain, _ = fe.resolve({"steering_vectors": vecs})
        # the request's own condition replaces the module's
        _, own, _ = fe.resolve({"steering_module": {"name": "gated", "scale": 1.0},
                                "steering_condition": {**cond, "threshold": 0.25}})
        assert len({pk, plain, own}) == 3
        with pytest.raises(SteeringSpecError) as e:  # what the module's condition cannot take names the module
            fe.resolve({"steering_module": {"name": "gated", "scale": 1.0}, "steering_vectors": {"post_mlp": {"1": V}}})
        assert e.value.field == "steering_module.name" and "module's steering_condition" in str(e.value)
    finally:
        STORE.drop("gated")


def test_over_http_a_module_registered_with_a_condition_gates_the_requests_naming_it(api_server):
    """A module registered with a hard gate every token passes steers like the same vectors; one no
    token passes does not steer; the listing shows the condition; a bad one is a 400 naming the field."""
    from tests.conftest import API_KEY

    base, model = api_server[0], api_server[1]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    vecs = {"post_mlp": {str(STEER_LAYER): vector(HIDDEN, 1, SCALE).tolist()}}
    cond = {"site": f"post_mlp.{PROBE_LAYER}", "probe": vector(HIDDEN, 7, 1.0).tolist(), "mode": "hard"}
    names = {"cond-open": -1e30, "cond-shut": 1e30}
    try:
        for name, threshold in names.items():
            r = httpx.post(f"{base}/v1/steering/modules", headers=auth, timeout=60, json={
                "name": name, "steering_vectors": vecs, "steering_condition": {**cond, "threshold": threshold}})
            assert r.status_code == 201, r.text
            assert r.json()["condition"]["probe"] == {"floats": HIDDEN} and r.json()["condition"]["threshold"] == threshold
        bad = httpx.post(f"{base}/v1/steering/modules", headers=auth, timeout=60, json={
            "name": "cond-bad", "steering_vectors": vecs, "steering_condition": {**cond, "sharpness": -1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "steering_condition.sharpness", bad.text
        steered = _http(base, model, steering_vectors=vecs).json()["choices"][0]["text"]
        plain = _http(base, model).json()["choices"][0]["text"]
        opened = _http(base, model, steering_module={"name": "cond-open", "scale": 1.0}).json()
        shut = _http(base, model, steering_module={"name": "cond-shut", "scale": 1.0}).json()
        assert steered != plain
        assert opened["choices"][0]["text"] == steered and shut["choices"][0]["text"] == plain
        listed = {m["name"]: m for m in httpx.get(f"{base}/v1/steering/modules", timeout=30).json()["data"]}
        assert listed["cond-shut"]["condition"]["threshold"] == 1e30 and "cond-bad" not in listed
    finally:
        for name in names:
            httpx.delete(f"{base}/v1/steering/modules/{name}", headers=auth, timeout=60)
