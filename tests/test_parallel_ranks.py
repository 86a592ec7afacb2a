"""Tensor and pipeline parallelism on the CPU lane (vLLM-CPU, 2 ranks over gloo / shared memory, the
tiny Llama: 2 layers, 4 heads): one mixed batch (unsteered, vectors at every hook, a named module
registered after start, capture at every site with a worker and a driver consumer) gives TP=2 and
PP=2 the tokens of TP=1, logprobs within 1e-3, the same capture files (each site once: TP rank 0
captures, each pipeline stage its own sites) and the same driver result. Under PP a request asking
the driver consumer for a later stage's site is refused, naming the field."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.engine_job import run_job
from tests.steering_cases import floats, params, vector
from vllm_steer.capture.filesystem import load_request

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


def refused_driver_spec(llm, hidden: int) -> str:
    """An engine_job call: a request asking the driver consumer for a site past the first stage."""
    from vllm import SamplingParams

    capture = {"probe": {"layers": [1], "hooks": ["post_mlp"], "positions": "all"}}
    try:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1, extra_args={"capture": capture}),
                     use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "accepted"


def _job(model: str, hidden: int, root: str, extra: dict, pp: bool) -> dict:
    fs = {"layers": [0, 1], "hooks": list(HOOKS), "positions": "all"}
    probe = {"layers": [0], "hooks": ["pre_attn", "post_attn"], "positions": "all"}
    batch = [params(8), params(8, steering_vectors=_all_hooks(hidden)),
             params(8, steering_module={"name": "pm", "scale": 0.8}),
             params(8, steering_vectors=floats("post_mlp", 0, vector(hidden, 7, 6.0)),
                    capture={"fs": fs, "probe": probe})]
    steer = {"max_configs": 8, "capture": [{"name": "filesystem", "instance": "fs", "params": {"root": root}},
                                           {"name": "probe", "instance": "probe", "params": {"dim": hidden, "seed": 2}}]}
    calls = [{"llm_call": REGISTER, "kwargs": {"name": "pm", "steering_vectors": floats("post_attn", 1, vector(hidden, 9, 6.0))}},
             {"prompts": [{"prompt": "The quick brown fox"}] * len(batch), "params": batch}]
    if pp:
        calls.append({"llm_call": "tests.test_parallel_ranks:refused_driver_spec", "kwargs": {"hidden": hidden}})
    return {"model": model, "collect_capture": True, "rpc_after": ["vllm_steer_status"],
            "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8,
                           "additional_config": {"steer": steer}, **extra},
            "calls": calls}


def _published(root: str, request_id: str) -> dict:
    deadline = time.time() + 60
    while True:
        try:
            return load_request(root, request_id, sites=len(SITES))
        except FileNotFoundError:
            assert time.time() < deadline, f"capture of {request_id} never published in full"
            time.sleep(0.2)


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
    # capture: every site once, equal to one rank's rows; the driver consumer's result too
    want, have = _published(ref_root, ref_batch[3]["request_id"]), _published(root, batch[3]["request_id"])
    assert set(have) == set(want) == set(SITES)
    for site in SITES:
        np.testing.assert_array_equal(have[site][0], want[site][0], err_msg=str(site))
        np.testing.assert_allclose(have[site][1], want[site][1], rtol=1e-4, atol=1e-4, err_msg=str(site))
    assert batch[3]["capture"]["probe"]["rows"] == ref_batch[3]["capture"]["probe"]["rows"] > 0
    assert batch[3]["capture"]["probe"]["logit"] == pytest.approx(ref_batch[3]["capture"]["probe"]["logit"], abs=1e-4)
    workers = got["rpc_after"]["vllm_steer_status"]
    rows = [w["capture"]["rows"] for w in workers]
    if kind == "tp2":  # TP rank 1 holds the same residual: it captures nothing
        assert rows[0] > 0 and rows[1] == 0
    else:  # each stage captures its own sites
        assert all(r > 0 for r in rows) and sum(rows) == ref["rpc_after"]["vllm_steer_status"][0]["capture"]["rows"]


def test_pipeline_parallel_refuses_a_driver_spec_past_the_first_stage(runs):
    message = runs["pp2"][0]["calls"][2]
    assert "capture.probe.layers" in message and "post_mlp.1 is on a later pipeline stage" in message
