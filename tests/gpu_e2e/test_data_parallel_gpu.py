"""Data parallel on two GPUs (issue 40 item 1): ``vllm serve --data-parallel-size 2``, with one API process
and with ``--api-server-count 2``. Per server: 32 concurrent requests (4 steered configs and their plain
prompts) land on both engines and each equals transformers' greedy run with the same vectors (tokens and
logprobs); a module registered over REST reaches both engines and steers as its inline vectors do, a
replacement steers as the new vectors, a delete is refused (400) through every connection; the built-in
``activations`` driver consumer's rows come back from both engines and equal transformers' residual;
``/metrics`` sums the engines (captured rows, row uploads); a runtime SAE is held and staged on both
engines (the CPU lane's ``_saes_are_shared``). Needs 2 GPUs; the CPU lane's DP test is
tests/test_parallel_ranks.py."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from tests.gpu_e2e import engine_case as ec

pytestmark = pytest.mark.skipif(not ec.CPU and torch.cuda.device_count() < 2,
                                reason="needs 2 GPUs (or VLLM_STEER_E2E_DEVICE=cpu for the CPU smoke run)")

STEPS = 12
SCALE = 0.5
LOGPROB_TOL = 0.05
NEAR_TIE = 0.01  # top-1 minus top-2 logit gap under which float32 with TF32 attention may pick either
CAPTURED = "post_mlp.1"
REL_TOL = 1e-2  # float32 with TF32 attention (tests/gpu_e2e/test_capture_vs_hf_gpu.py)
N = len(ec.STEERED_SPECS)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A random Llama whose vocabulary is the test tokenizer's (the server detokenizes), its prompts, the
    steered configs' vectors, transformers' greedy runs and residual streams (before vLLM takes the GPUs)."""
    from tests.test_capture import hf_streams

    root = tmp_path_factory.mktemp("dp")
    path = root / "llama-random"
    tok = ec.build_checkpoint(path, vocab="tokenizer")
    prompts = [tok(p)["input_ids"] for p in ec.PROMPTS[:N]]
    vecs = [ec.vectors_for(s, SCALE) for s in ec.STEERED_SPECS]
    hf = ec.oracle_runs(path, prompts, vecs, STEPS)
    layer = int(CAPTURED.split(".")[1])
    streams = [hf_streams(str(path), ids)[(layer, "post_mlp")][-1] for ids in prompts]
    return root, path, prompts, vecs, hf, streams


def _complete(base: str, model: str, ids: list[int], **fields) -> httpx.Response:
    body = {"model": model, "prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True, **fields}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=300)


def _tokens(r: httpx.Response) -> tuple[list[int], list[float]]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _matches(got: tuple[list[int], list[float]], ref: dict, what: str) -> None:
    toks, lps = got
    d = next((j for j, (a, b) in enumerate(zip(toks, ref["tokens"])) if a != b), None)
    if d is not None and ref["gaps"][d] < NEAR_TIE:  # HF's top two within TF32's rounding: compare up to there
        toks, lps, ref, d = toks[:d], lps[:d], {k: v[:d] for k, v in ref.items()}, None
    assert d is None, f"{what}: vLLM {toks} != HF {ref['tokens']} from token {d} (HF gap {ref['gaps'][d]:.4g})"
    err = max(abs(a - b) for a, b in zip(lps, ref["logprobs"]))
    assert err < LOGPROB_TOL, f"{what}: max |logprob vLLM - HF| {err:.4g}"


def _metric(base: str, name: str) -> float:
    from tests.server import scrape_metrics

    return sum(v for k, v in scrape_metrics(base).items() if k.split("{")[0] == name)


@pytest.mark.parametrize("api_servers", [1, 2])
def test_data_parallel_serves_steering_modules_capture_and_saes_on_both_engines(case, api_servers):
    from tests.server import openai_server
    from tests.test_multi_api_server import _saes_are_shared
    from vllm_steer.capture.activations import decode_result

    root, path, prompts, vecs, hf, streams = case
    model = str(path)
    steer = {"max_configs": 16, "capture": ["activations"], "sae_slots": {"post_mlp.1": 8}, "sae_root": str(root)}
    args = ["--dtype", "float32", "--data-parallel-size", "2", "--gpu-memory-utilization", "0.3",
            "--additional-config", json.dumps({"steer": steer})]
    if api_servers > 1:
        args += ["--api-server-count", str(api_servers)]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if ec.CPU:
        args.append("--enforce-eager")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    with openai_server(model, *args, log=root / f"server{api_servers}.log", timeout=600, env=env) as (base, _):
        fields = [ec.as_request_field(v) for v in vecs]
        capture = {"activations": {"sites": [CAPTURED], "positions": "last_prompt"}}
        jobs = [(i, True) for i in range(N)] + [(i, False) for i in range(N)]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(
                lambda job: _complete(base, model, prompts[job[0]], capture=capture,
                                      **({"steering_vectors": fields[job[0]]} if job[1] else {})),
                jobs * 4))
        for (i, steered), r in zip(jobs * 4, answers):
            _matches(_tokens(r), hf[("batch" if steered else "plain", i)], f"prompt {i} steered={steered}")
            if not steered:  # the captured residual at the last prompt position (before any generated token)
                got = decode_result(r.json()["capture"]["activations"])[CAPTURED]
                ref = streams[i]
                assert np.abs(got - ref).max() <= REL_TOL * np.abs(ref).max(), f"prompt {i}: capture != transformers"
        workers = httpx.get(f"{base}/v1/steering", timeout=60).json()["workers"]
        assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2, workers
        assert all(w["capture"]["rows"] > 0 for w in workers), workers  # requests ran on both engines
        assert sum(w["capture"]["rows"] for w in workers) == len(answers), workers  # one row per request
        deadline = time.time() + 30  # /metrics asks every engine; poll (a scrape may answer an earlier question)
        while _metric(base, "vllm_steer_capture_rows_total") != len(answers) and time.time() < deadline:
            time.sleep(1)
        assert _metric(base, "vllm_steer_capture_rows_total") == len(answers)

        # a module: registered once, on both engines; the same tokens as its inline vectors; replaced; deleted
        def named(i: int) -> list[httpx.Response]:  # concurrent, capturing: the workers' rows show both engines ran
            with ThreadPoolExecutor(16) as pool:
                return list(pool.map(lambda _: _complete(base, model, prompts[i], steering_module={"name": "dp"},
                                                         capture=capture), range(16)))

        def rows_per_worker() -> list[int]:
            return [w["capture"]["rows"] for w in httpx.get(f"{base}/v1/steering", timeout=60).json()["workers"]]

        body = {"name": "dp", "steering_vectors": fields[0]}
        assert httpx.post(f"{base}/v1/steering/modules", json=body, timeout=120).status_code == 201
        before = rows_per_worker()
        for r in named(0):
            _matches(_tokens(r), hf[("batch", 0)], "module dp (prompt 0's vectors)")
        assert all(a > b for a, b in zip(rows_per_worker(), before)), (before, "both engines ran the module")
        body = {"name": "dp", "steering_vectors": fields[1], "replace": True}
        assert httpx.post(f"{base}/v1/steering/modules", json=body, timeout=120).status_code in (200, 201)
        before = rows_per_worker()
        for r in named(1):
            _matches(_tokens(r), hf[("batch", 1)], "module dp replaced (prompt 1's vectors)")
        assert all(a > b for a, b in zip(rows_per_worker(), before)), (before, "both engines ran the replacement")
        assert httpx.delete(f"{base}/v1/steering/modules/dp", timeout=60).status_code == 200
        for _ in range(4):
            r = _complete(base, model, prompts[0], steering_module={"name": "dp"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "steering_module.name", r.text
        _saes_are_shared(base, model, ec.SHAPE.hidden, root)
