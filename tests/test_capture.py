"""Activation capture on real SmolLM2 (float32, CPU lane): the filesystem consumer's files match
transformers' hidden states at every hook, steering does not change what its own hook captures,
a bad capture spec is refused, and extraction on the in-process LLM matches transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import hf_oracle
from tests.engine_job import run_job
from tests.steering_cases import floats, params, vector
from vllm_steer.capture.activations import decode_result
from vllm_steer.capture.filesystem import load_request

HIDDEN, LAYERS = 576, 30
PROMPT = "The robot looked at the sea and"
ALL = {"layers": "all", "hooks": "all", "positions": "all_prompt"}
SLOW_TIMEOUT_S = 1.5  # steer.capture_result_timeout_s of this engine
POOL_ROWS = 256  # steer.capture_max_rows of this engine
EXTRACT_PAIRS = [{"positive": "I love this wonderful day", "negative": "I hate this terrible day"},
                 {"positive": "What a happy surprise", "negative": "What an awful surprise",
                  "prompt": "Describe the gift. "}]
EXTRACT_LAYERS = [3, 10, 20]
MIXED_PROMPTS = ["A quiet morning in the", "Seven cats sat on", "Tell me about rivers", "Once upon a time a"]
MIXED_SITES = {"layers": [2, 15], "hooks": ["pre_attn", "post_mlp"]}
# one batch: device-reduced activations beside the filesystem consumer on the same cells (0, 1: the
# reduction reads the consumer's rows) and alone (2, 3: last planned straight to its slot)
MIXED = [{"activations": {**MIXED_SITES, "positions": "all", "reduce": "mean"}, "fs": {**MIXED_SITES, "positions": "all"}},
         {"activations": {**MIXED_SITES, "positions": "all", "reduce": "last"}, "fs": {**MIXED_SITES, "positions": "all"}},
         {"activations": {**MIXED_SITES, "positions": "all_prompt", "reduce": "last"}},
         {"activations": {**MIXED_SITES, "positions": "all_prompt", "reduce": "mean"}}]


@pytest.fixture(scope="module")
def capture_run(smollm2_path, probe_plugin, tmp_path_factory):
    root = tmp_path_factory.mktemp("captures")
    _, tok = hf_oracle.load(smollm2_path)
    ids = tok(PROMPT)["input_ids"]
    long_ids = tok(PROMPT * 12)["input_ids"]
    mixed_ids = [tok(p)["input_ids"] for p in MIXED_PROMPTS]
    steer = floats("post_mlp", 10, vector(HIDDEN, 5, 60.0))
    steer["pre_attn"] = floats("pre_attn", 20, vector(HIDDEN, 6, 60.0))["pre_attn"]
    reqs = [params(4, capture={"fs": ALL, "logging": ALL}),
            params(4, capture={"fs": ALL}, steering_vectors=steer),
            params(6, capture={"fs": {"layers": [3], "hooks": ["post_attn"], "positions": "all_generated"},
                               "probe": {"layers": [20], "hooks": ["post_mlp"], "positions": "last_prompt"}})]
    job = {"model": smollm2_path,
           "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "distributed_executor_backend": "uni",
                          "block_size": 32, "enable_prefix_caching": True,
                          "additional_config": {"steer": {"max_configs": 4, "capture": [
                              {"name": "filesystem", "instance": "fs", "params": {"root": str(root), "threads": 2}},
                              "logging", "probe:dim=576,seed=3", "slow", "activations"],
                              "capture_result_timeout_s": SLOW_TIMEOUT_S,
                              # a pool smaller than the first request's prompt x 90 sites: its prefill is chunked
                              # to fit (engine.capture_budget), so every row is still there (no dropped_rows)
                              "capture_max_rows": POOL_ROWS}}},
           "calls": [{"prompts": [{"prompt_token_ids": ids}], "params": [p]} for p in reqs]
           # a long prompt seen once without capture (its blocks get cached), then captured
           + [{"prompts": [{"prompt_token_ids": long_ids}], "params": [p]}
              for p in (params(2), params(2, capture={"fs": {"layers": [0], "hooks": ["pre_attn"]}}))]
           # a driver slower than the timeout: collect() answers at the timeout with an error for it
           + [{"prompts": [{"prompt_token_ids": ids}], "params": [params(2, capture={"slow": {
               "layers": [0], "hooks": ["pre_attn"], "positions": "last_prompt", "sleep_s": 4 * SLOW_TIMEOUT_S}})]}]
           # the workers' counters, then extraction on the in-process LLM (plain and chat-templated texts)
           + [{"llm_call": "tests.test_capture:worker_status"}]
           + [{"llm_call": "vllm_steer.extract:extract", "kwargs": {"pairs": EXTRACT_PAIRS, "layers": EXTRACT_LAYERS,
                                                                   "hooks": ["pre_attn", "post_mlp"], "chat": chat}}
              for chat in (False, True)]
           + [{"prompts": [{"prompt_token_ids": i} for i in mixed_ids], "params": [params(5, capture=c) for c in MIXED]},
              {"llm_call": "tests.test_capture:worker_status"},
              {"llm_call": "tests.test_capture:generated_capture_then_publish", "kwargs": {"ids": ids}},
              {"llm_call": "tests.test_capture:nowait_while_consumers_stopped", "kwargs": {"ids": ids,
                                                                                          "root": str(root)}}],
           "collect_capture": True}
    res = run_job(job, tmp_path_factory.mktemp("capjob"))
    res["rpc_after"] = {"vllm_steer_status": res["calls"][-7]}
    res["mixed"] = (mixed_ids, res["calls"][-4], res["calls"][-3])
    return root, ids, [c[0] for c in res["calls"][:-7]], res, len(long_ids)


def worker_status(llm) -> list:
    """The workers' ``vllm_steer_status`` (an engine_job llm_call, before the extraction calls)."""
    return llm.collective_rpc("vllm_steer_status")


GENERATED = {"layers": [4, 12], "hooks": ["post_mlp"], "positions": "all_generated"}
GENERATED_MAX_TOKENS = 4


def generated_capture_then_publish(llm, ids: list[int]) -> dict:
    """A request capturing generated positions, run to ``max_tokens`` (an engine_job llm_call): how many
    requests the workers still had to end when ``collect``'s publish came (the in-process engine is not
    stepped after its last output, so a capture the runner only ends on hearing of the request's end waits
    for it), and the result."""
    from vllm import SamplingParams

    from vllm_steer.capture.collect import PUBLISH, collect
    from vllm_steer.core.rpc import CapturePublish, call_args

    capture = {"activations": {**GENERATED, "reduce": "last"}, "fs": GENERATED}
    outs = llm.generate([{"prompt_token_ids": ids}], [SamplingParams(**params(GENERATED_MAX_TOKENS, capture=capture))],
                        use_tqdm=False)
    ended = llm.collective_rpc(PUBLISH, args=call_args(CapturePublish([o.request_id for o in outs])))
    collect(llm, outs)
    return {"ended_by_publish": ended, "request_id": outs[0].request_id, "capture": outs[0].capture,
            "tokens": list(outs[0].outputs[0].token_ids)}


def _capture_host_pid() -> int:
    """The consumers' process under this process (the in-process LLM's engine core runs it)."""
    import os

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])

    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if b"vllm_steer.runtime.capture_host" not in fh.read():
                    continue
            pid = int(entry)
            while pid > 1 and pid != me:
                pid = parent(pid)
        except (OSError, ValueError, IndexError):
            continue
        if pid == me:
            return int(entry)
    raise RuntimeError("no capture host process under this one")


NOWAIT = {"layers": [1], "hooks": ["post_mlp"], "positions": "all", "wait": False}


def nowait_while_consumers_stopped(llm, ids: list[int], root: str) -> dict:
    """A request capturing only to the filesystem consumer with ``"wait": false`` while the consumers' process is
    stopped (SIGSTOP; an engine_job llm_call): ``collect`` (with a 60 s timeout) returns without waiting for it, the
    files are not there yet, and they are published once it runs again."""
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from vllm import SamplingParams

    from vllm_steer.capture.collect import collect

    host = _capture_host_pid()
    os.kill(host, signal.SIGSTOP)
    try:
        outs = llm.generate([{"prompt_token_ids": ids}], [SamplingParams(**params(3, capture={"fs": NOWAIT}))],
                            use_tqdm=False)
        t0 = time.monotonic()
        collect(llm, outs, timeout=60.0)
        collect_s = time.monotonic() - t0
        rid = outs[0].request_id

        def published() -> bool:
            return any(json.loads(p.read_text()).get("external_id") == rid for p in Path(root).rglob("request.json"))

        before = published()
    finally:
        os.kill(host, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while not published() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"collect_s": collect_s, "capture": outs[0].capture, "published_while_stopped": before,
            "published_after": published(), "request_id": rid}


@torch.no_grad()
def hf_streams(path: str, ids: list[int]) -> dict[tuple[int, str], np.ndarray]:
    """Reference residual streams from transformers: output_hidden_states for pre_attn/post_mlp,
    and layer input + attention output (forward hooks) for post_attn."""
    model, _ = hf_oracle.load(path)
    layer_in, attn_out, handles = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, k, i=i: layer_in.__setitem__(i, (a[0] if a else k["hidden_states"])[0].clone()), with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: attn_out.__setitem__(i, o[0][0].clone())))
    layer_out = {}
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, o, i=i: layer_out.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].clone())))
    try:
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        for h in handles:
            h.remove()
    out = {}
    for i in range(len(model.model.layers)):
        out[(i, "pre_attn")] = hs[i][0].numpy()
        out[(i, "post_attn")] = (layer_in[i] + attn_out[i]).numpy()
        out[(i, "post_mlp")] = (hs[i + 1][0] if i + 1 < len(model.model.layers) else layer_out[i]).numpy()
    return out


def test_captured_residuals_match_transformers_at_every_hook(capture_run, smollm2_path):
    root, ids, results, *_ = capture_run
    got = load_request(str(root), results[0]["request_id"])
    ref = hf_streams(smollm2_path, ids)
    assert len(got) == LAYERS * 3 and len(ids) * LAYERS * 3 > POOL_ROWS  # more rows than one step's pool holds
    for key, (positions, rows) in got.items():
        np.testing.assert_array_equal(positions, np.arange(len(ids)))
        np.testing.assert_allclose(rows, ref[key], rtol=1e-4, atol=2e-3, err_msg=str(key))


def test_steering_does_not_change_its_own_hook_or_upstream_capture(capture_run):
    root, _, results, *_ = capture_run
    plain = load_request(str(root), results[0]["request_id"])
    steered = load_request(str(root), results[1]["request_id"])
    assert results[1]["token_ids"] != results[0]["token_ids"]
    # steered at post_mlp of layer 10 and pre_attn of layer 20: those sites and everything before
    # them read the pristine stream; the stream after a steered site differs
    for layer in range(11):  # up to and including the steered site (10, post_mlp)
        for hook in ("pre_attn", "post_attn", "post_mlp"):
            np.testing.assert_array_equal(plain[(layer, hook)][1], steered[(layer, hook)][1], err_msg=f"{layer} {hook}")
    assert not np.array_equal(plain[(11, "pre_attn")][1], steered[(11, "pre_attn")][1])


def test_generated_positions_and_selected_sites_only(capture_run):
    root, ids, results, res, _ = capture_run
    got = load_request(str(root), results[2]["request_id"])
    assert list(got) == [(3, "post_attn")]
    positions, rows = got[(3, "post_attn")]
    # 6 generated tokens; the last one is sampled but never fed back, so 5 residual rows
    np.testing.assert_array_equal(positions, np.arange(len(ids), len(ids) + 5))
    assert rows.shape == (5, HIDDEN)
    (worker,) = res["rpc_after"]["vllm_steer_status"]
    assert worker["capture"]["consumer_errors"] == 0 and worker["capture"]["dropped_rows"] == 0


def test_rows_wanted_by_two_consumers_are_gathered_once_and_logged(capture_run):
    _, ids, results, res, n_long = capture_run
    (worker,) = res["rpc_after"]["vllm_steer_status"]
    n = len(ids)
    # request 0: fs + logging want the same 90 sites x n prompt tokens; request 1: fs, the same;
    # request 2: 5 generated rows for fs + 1 row for the probe; request 4: the long prompt at one site
    # request 5: one row for the slow consumer
    assert worker["capture"]["rows"] == 90 * n + 90 * n + 5 + 1 + n_long + 1
    assert f"vllm-steer capture logging: request {results[0]['request_id']}" in res["log"]


def test_driver_result_comes_back_in_the_python_output_and_sidecars_describe_the_files(capture_run, smollm2_path):
    root, ids, results, *_ = capture_run
    assert set(results[2]["capture"]) == {"probe"} and results[2]["capture"]["probe"]["rows"] == 1
    assert results[0]["capture"] == {}  # fs and logging return nothing
    import json

    d = next(p.parent for p in root.rglob("request.json") if json.loads(p.read_text())["external_id"] == results[0]["request_id"])
    meta = json.loads((d / "request.json").read_text())
    assert meta["prompt_len"] == len(ids)
    side = json.loads((d / "3_post_attn.json").read_text())
    assert side["dtype"] == "float32" and side["shape"] == [len(ids), HIDDEN]
    assert side["positions_range"] == [0, len(ids)]  # every prompt position: the compact form


def test_capturing_the_prompt_bypasses_prefix_cache_hits(capture_run):
    root, _, results, _, n_long = capture_run
    assert results[3]["num_cached_tokens"] == 0 and results[4]["num_cached_tokens"] == 0
    positions, rows = load_request(str(root), results[4]["request_id"])[(0, "pre_attn")]
    np.testing.assert_array_equal(positions, np.arange(n_long))  # every prompt position, none cached


def test_collect_returns_at_the_timeout_with_an_error_for_a_slow_driver(capture_run):
    _, _, results, *_ = capture_run
    # collect() did not wait for the consumer's 6 s sleep (its result would be {"slept_s": 6.0})
    assert results[5]["capture"] == {"slow": {
        "error": "timeout", "message": f"no result within {SLOW_TIMEOUT_S:g} s (steer.capture_result_timeout_s)"}}


@pytest.mark.parametrize("chat", [False, True])
def test_extraction_on_the_in_process_llm_matches_transformers(capture_run, smollm2_path, chat):
    """``extract(llm, ...)``: the mean difference of the last tokens' residuals, as transformers computes
    it on the same texts (chat: the model's template; a pair with a prompt continues the answer)."""
    got = capture_run[3]["calls"][-5 if chat else -6]
    ref = hf_oracle.mean_diff_of_last_tokens(smollm2_path, EXTRACT_PAIRS, chat, EXTRACT_LAYERS)
    for site, r in ref.items():
        hook, layer = site.split(".")
        v = got.vectors[hook][int(layer)].astype(np.float64)
        assert np.linalg.norm(v - r) / np.linalg.norm(r) < 1e-3, site


def test_device_reduced_last_and_mean_equal_the_per_step_rows_and_transformers(capture_run, smollm2_path):
    """One batch, ``activations`` reduced on the device (its accumulator rows): with the filesystem consumer
    on the same cells its result equals the mean / last of the files' rows (the per-step path); alone,
    the prompt's mean / last of transformers' streams."""
    root, _, _, res, _ = capture_run
    mixed_ids, outs, status = res["mixed"]
    for k, (out, spec, ids) in enumerate(zip(outs, MIXED, mixed_ids)):
        result = out["capture"]["activations"]
        got = decode_result(result)
        assert sorted(got) == sorted(f"{h}.{l}" for h in MIXED_SITES["hooks"] for l in MIXED_SITES["layers"])
        reduce = spec["activations"]["reduce"]
        if "fs" in spec:
            rows_of = {f"{h}.{l}": r for (l, h), (_, r) in load_request(str(root), out["request_id"]).items()}
        else:
            ref = hf_streams(smollm2_path, ids)
            rows_of = {f"{h}.{l}": ref[(l, h)] for h in MIXED_SITES["hooks"] for l in MIXED_SITES["layers"]}
        for name, vec in got.items():
            rows = rows_of[name].astype(np.float64)
            want = rows.mean(axis=0) if reduce == "mean" else rows[-1]
            tol = dict(rtol=1e-5, atol=1e-4) if "fs" in spec else dict(rtol=1e-4, atol=2e-3)
            np.testing.assert_allclose(vec, want, **tol, err_msg=f"request {k} {name}")
            assert result["count"][result["sites"].index(name)] == len(rows)
        assert result["dropped_rows"] == 0
    (worker,) = status
    cap = worker["capture"]
    assert cap["reduced_requests"] >= 4 and cap["reduce_fallbacks"] == 0  # + extraction's texts
    assert cap["plans_in_forward"] > 0  # the CPU's eager steps were planned by their first capturing op (the values
    # above, transformers' own, came through that path)


def test_a_generated_capture_ends_with_its_last_token_not_with_the_publish(capture_run, smollm2_path):
    """A request capturing generated positions that runs to ``max_tokens`` is ended by the worker in the step that
    samples its last token: ``collect``'s publish after ``generate`` finds nothing left to end (before, the runner
    heard of the end one step later, which an in-process engine never runs). Its result and files hold every fed
    generated position (prompt .. prompt + max_tokens - 2), as transformers computes them."""
    root, ids, _, res, _ = capture_run
    got = res["calls"][-2]
    assert got["ended_by_publish"] == [0]
    n = GENERATED_MAX_TOKENS - 1  # the last sampled token is never fed
    full = ids + got["tokens"][:n]
    ref = hf_streams(smollm2_path, full)
    result = got["capture"]["activations"]
    assert result["count"] == [n, n] and result["dropped_rows"] == 0
    files = load_request(str(root), got["request_id"])
    for layer in GENERATED["layers"]:
        positions, rows = files[(layer, "post_mlp")]
        np.testing.assert_array_equal(positions, np.arange(len(ids), len(ids) + n))
        np.testing.assert_allclose(rows, ref[(layer, "post_mlp")][len(ids):], rtol=1e-4, atol=2e-3)
        np.testing.assert_allclose(decode_result(result)[f"post_mlp.{layer}"], rows[-1], rtol=1e-5, atol=1e-5)


def test_a_response_that_does_not_wait_for_its_files_never_waits_for_the_consumers(capture_run, smollm2_path):
    """``"wait": false`` to the filesystem consumer alone, the consumers' process stopped: ``collect`` returns at
    once (it waited for that process's answer, up to its timeout, before), with no capture result; the files are
    published once the process runs again, holding every position's rows as transformers computes them."""
    root, ids, _, res, _ = capture_run
    got = res["calls"][-1]
    assert got["collect_s"] < 10.0 and got["capture"] == {}, got
    assert got["published_while_stopped"] is False and got["published_after"] is True
    positions, rows = load_request(str(root), got["request_id"])[(1, "post_mlp")]
    np.testing.assert_array_equal(positions, np.arange(len(ids) + 2))  # prompt and the 2 fed generated tokens
    ref = hf_streams(smollm2_path, ids)
    np.testing.assert_allclose(rows[: len(ids)], ref[(1, "post_mlp")], rtol=1e-4, atol=2e-3)
