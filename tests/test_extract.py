"""Extraction (``vllm_steer.extract``, ``vllm-steer extract``) against the shared SmolLM2 server: the
vectors equal those computed from transformers' ``output_hidden_states`` on the same texts; steering
with one moves the model toward the positive side; the command writes safetensors / GGUF files that
hold the same vectors and registers a module; bad inputs are clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests import hf_oracle
from tests.conftest import API_KEY
from vllm_steer.extract import ExtractError, extract

PAIRS = [
    {"positive": "I love this day, everything is wonderful", "negative": "I hate this day, everything is terrible"},
    {"positive": "What a delightful, happy surprise", "negative": "What a miserable, awful surprise"},
    {"positive": "She smiled with joy at the gift", "negative": "She frowned in anger at the gift"},
    {"positive": "The food was delicious and lovely", "negative": "The food was disgusting and vile"},
    {"positive": "We had a great, cheerful time", "negative": "We had a bad, gloomy time"},
    {"positive": "He felt glad and grateful", "negative": "He felt sad and bitter"},
]
# the same texts extracted twice on the shared server: float32 sums over other batch shapes (CI saw up to 3.3e-6
# on entries of ~1); a wrong layer, site or pair moves entries by O(0.1)
RERUN_ATOL = 5e-5
LAYERS = [3, 10, 20]  # not the last: transformers' last hidden state has the final norm applied


def _hf_rows(model: str, text: str, reduce: str) -> dict[str, np.ndarray]:
    hf, tok = hf_oracle.load(model)
    with torch.no_grad():
        hs = hf(torch.tensor([tok(text)["input_ids"]]), output_hidden_states=True).hidden_states
    pick = (lambda h: h[0, -1]) if reduce == "last" else (lambda h: h[0].mean(dim=0))
    rows = {}
    for layer in LAYERS:
        rows[f"pre_attn.{layer}"] = pick(hs[layer]).double().numpy()  # the input of layer L
        rows[f"post_mlp.{layer}"] = pick(hs[layer + 1]).double().numpy()  # the output of layer L
    return rows


def _cos(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("method,reduce", [("mean_diff", "last"), ("mean_diff", "mean"), ("pca", "last")])
def test_vectors_match_transformers_hidden_states(api_server, method, reduce):
    base, model = api_server[0], api_server[1]
    got = extract(base, PAIRS, layers=LAYERS, hooks=["pre_attn", "post_mlp"], method=method, reduce=reduce)
    assert got.pairs == len(PAIRS) and sorted(got.vectors) == ["post_mlp", "pre_attn"]
    hf = [_hf_rows(model, p[side], reduce) for p in PAIRS for side in ("positive", "negative")]
    for hook in ("pre_attn", "post_mlp"):
        assert sorted(got.vectors[hook]) == LAYERS
        for layer in LAYERS:
            pos = np.stack([r[f"{hook}.{layer}"] for r in hf[0::2]])
            neg = np.stack([r[f"{hook}.{layer}"] for r in hf[1::2]])
            v = got.vectors[hook][layer].astype(np.float64)
            if method == "mean_diff":
                ref = pos.mean(axis=0) - neg.mean(axis=0)
                assert np.linalg.norm(v - ref) / np.linalg.norm(ref) < 1e-3, (hook, layer)
            else:  # repeng: unit norm, the first component of the centered differences, positives higher
                d = pos - neg
                ref = np.linalg.svd(d - d.mean(axis=0), full_matrices=False)[2][0]
                ref = ref if np.mean(pos @ ref > neg @ ref) >= 0.5 else -ref
                assert abs(np.linalg.norm(v) - 1) < 1e-4
            assert _cos(v, ref) >= 0.999, (hook, layer, _cos(v, ref))


@pytest.mark.parametrize("pairs", [PAIRS[:3], [{**p, "prompt": "Say how you feel. "} for p in PAIRS[:3]]])
def test_chat_templated_extraction_matches_transformers_on_the_templated_text(api_server, pairs):
    base, model = api_server[0], api_server[1]
    got = extract(base, pairs, layers=LAYERS, hooks=["pre_attn", "post_mlp"], chat=True)
    for site, ref in hf_oracle.mean_diff_of_last_tokens(model, pairs, True, LAYERS).items():
        hook, layer = site.split(".")
        v = got.vectors[hook][int(layer)].astype(np.float64)
        assert np.linalg.norm(v - ref) / np.linalg.norm(ref) < 1e-3, site


def _logprob(base, model, prompt_ids, cont_ids, **steer) -> float:
    """Mean log-probability of ``cont_ids`` after ``prompt_ids`` (vLLM's prompt logprobs)."""
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt_ids + cont_ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0, **steer})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ids = prompt_ids + cont_ids
    return float(np.mean([plp[i][str(ids[i])]["logprob"] for i in range(len(prompt_ids), len(ids))]))


def test_steering_with_the_extracted_vector_moves_toward_the_positive_side(api_server):
    base, model = api_server[0], api_server[1]
    got = extract(base, PAIRS, layers="6-14", method="mean_diff", reduce="last")
    name = "extracted-joy"
    got.register(base, name, api_key=API_KEY, replace=True)
    try:
        _, tok = hf_oracle.load(model)
        prompt = tok("Today the weather is bad and I feel")["input_ids"]
        pos, neg = tok(" happy and joyful")["input_ids"], tok(" sad and angry")["input_ids"]

        def gap(scale):
            steer = {} if scale == 0 else {"steering_module": {"name": name, "scale": scale}}
            return _logprob(base, model, prompt, pos, **steer) - _logprob(base, model, prompt, neg, **steer)

        plain, toward, away = gap(0), gap(2.0), gap(-2.0)
        print(f"log p(positive) - log p(negative): unsteered {plain:.3f}, +2 {toward:.3f}, -2 {away:.3f}")
        assert toward > plain + 0.5 and away < plain - 0.5
    finally:
        httpx.delete(f"{base}/v1/steering/modules/{name}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("vllm-steer")
    return subprocess.run([str(exe), "extract", *args], capture_output=True, text=True, timeout=300)


def test_the_command_writes_module_files_and_registers(api_server, tmp_path):
    import gguf
    from safetensors.numpy import load_file

    base, model = api_server[0], api_server[1]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    ref = extract(base, PAIRS, layers=[8, 9, 10])
    out = _cli("--server", base, "--pairs", str(pairs), "--layers", "8-10", "-o", str(tmp_path / "v.gguf"))
    assert out.returncode == 0, out.stderr
    assert "activations: 12/12 requests" in out.stderr
    reader = gguf.GGUFReader(str(tmp_path / "v.gguf"))
    got = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors}
    assert sorted(got) == ["direction.10", "direction.8", "direction.9"]
    for layer in (8, 9, 10):
        np.testing.assert_allclose(got[f"direction.{layer}"], ref.vectors["post_mlp"][layer], rtol=1e-5,
                                   atol=RERUN_ATOL)
    pos, neg = tmp_path / "pos.txt", tmp_path / "neg.txt"
    pos.write_text("".join(p["positive"] + "\n" for p in PAIRS))
    neg.write_text("".join(p["negative"] + "\n" for p in PAIRS))
    out = _cli("--server", base, "--positive", str(pos), "--negative", str(neg), "--layers", "8-10",
               "--hooks", "hook_resid_post,post_attn", "-o", str(tmp_path / "v.safetensors"),
               "--api-key", API_KEY, "--register", "cli-extracted", "--replace")
    assert out.returncode == 0, out.stderr
    tensors = load_file(str(tmp_path / "v.safetensors"))
    assert sorted(tensors) == sorted(f"{h}.{l}" for h in ("post_attn", "post_mlp") for l in (8, 9, 10))
    np.testing.assert_allclose(tensors["post_mlp.9"], ref.vectors["post_mlp"][9], rtol=1e-5, atol=RERUN_ATOL)
    r = httpx.get(f"{base}/v1/steering/modules/cli-extracted", timeout=30)
    assert r.status_code == 200 and r.json()["layers"] == [8, 9, 10], r.text
    httpx.delete(f"{base}/v1/steering/modules/cli-extracted", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    # --emit ablate: a module that removes each extracted direction (project.<site>), used like the same inline
    out = _cli("--server", base, "--pairs", str(pairs), "--layers", "8-10", "--emit", "ablate", "--api-key", API_KEY,
               "-o", str(tmp_path / "a.safetensors"), "--register", "cli-ablate", "--replace")
    assert out.returncode == 0 and "3 directions to ablate" in out.stderr, out.stderr
    tensors = load_file(str(tmp_path / "a.safetensors"))
    assert sorted(tensors) == [f"project.post_mlp.{l}" for l in (10, 8, 9)]
    np.testing.assert_allclose(tensors["project.post_mlp.9"], ref.vectors["post_mlp"][9], rtol=1e-5, atol=RERUN_ATOL)
    r = httpx.get(f"{base}/v1/steering/modules/cli-ablate", timeout=30)
    assert r.status_code == 200 and r.json()["projections"] == {"steering_projections": {
        f"post_mlp.{l}": ["ablate"] for l in (8, 9, 10)}} and r.json()["layers"] == [], r.text
    inline = {"steering_projections": {f"post_mlp.{l}": [{"direction": tensors[f"project.post_mlp.{l}"].tolist(),
                                                          "mode": "ablate"}] for l in (8, 9, 10)}}
    texts = [httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": "I think that", "max_tokens": 8, "temperature": 0, **body}).json()
        for body in ({"steering_module": "cli-ablate"}, inline)]
    assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]
    assert [t["steering"]["decode"] for t in texts[0:1]] == [texts[1]["steering"]["decode"]]
    assert texts[0]["steering"]["projections"] == texts[1]["steering"]["projections"] == 3
    assert texts[0]["steering"]["module"]["name"] == "cli-ablate"
    httpx.delete(f"{base}/v1/steering/modules/cli-ablate", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


@pytest.mark.parametrize("args,words", [
    (["--layers", "8-40"], "capture.activations.layers: layer 30 out of range (the model has 30 layers)"),
    (["--hooks", "post_ffn"], "hooks: expected some of"),
    (["--hooks", "post_attn", "-o", "{tmp}/v.gguf"], "a GGUF control vector holds post_mlp vectors only"),
    (["--pairs", "{tmp}/empty.jsonl"], "no pairs"),
    (["--pairs", "{tmp}/bad.jsonl"], "bad.jsonl:1.negative: expected a non-empty string"),
    (["-o", "{tmp}/v.npy"], "the output must end in .safetensors or .gguf"),
    (["--emit", "ablate", "-o", "{tmp}/v.gguf"], "--emit ablate writes .safetensors"),
])
def test_bad_inputs_are_clear_errors(api_server, tmp_path, args, words):
    (tmp_path / "pairs.jsonl").write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps(PAIRS[1]) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"positive": "x", "negative": ""}) + "\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    defaults = {"--pairs": str(tmp_path / "pairs.jsonl"), "-o": str(tmp_path / "v.safetensors")}
    for k, v in defaults.items():
        if k not in args:
            args += [k, v]
    out = _cli("--server", api_server[0], *args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr, out.stderr
    assert not (tmp_path / "v.safetensors").exists() and not (tmp_path / "v.gguf").exists()


def test_registering_vectors_of_another_hidden_size_names_it(api_server):
    from vllm_steer.extract import Extraction

    other = Extraction({"post_mlp": {3: np.ones(100, np.float32)}}, "mean_diff", "last", 2, "another-model")
    with pytest.raises(ExtractError, match=r"registering module 'wrong' failed \(400\).*expected 576 values \(hidden size\), got 100"):
        other.register(api_server[0], "wrong", api_key=API_KEY)


def test_rows_dropped_by_a_full_capture_pool_fail_the_extraction_instead_of_averaging_fewer():
    """The consumer reports what the engine dropped; extraction refuses such a result (a mean over fewer rows
    would be silently wrong)."""
    from vllm_steer.capture.activations import ActivationStats
    from vllm_steer.extract.sources import _rows

    consumer = ActivationStats("activations")
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    consumer.on_rows("r", 3, "post_mlp", np.array([0, 2, 1]), rows, {})
    whole = consumer.on_request_finished("r", {"params": {"reduce": "mean"}, "dropped_rows": 0})
    assert whole["dropped_rows"] == 0 and whole["count"] == [3]
    np.testing.assert_array_equal(_rows({"activations": whole}, "here")["post_mlp.3"], rows.mean(axis=0))
    consumer.on_rows("s", 3, "post_mlp", np.array([0, 2, 1]), rows, {})
    last = consumer.on_request_finished("s", {"params": {}, "dropped_rows": 0})
    np.testing.assert_array_equal(_rows({"activations": last}, "here")["post_mlp.3"], rows[1])  # position 2
    consumer.on_rows("t", 3, "post_mlp", np.array([0]), rows[:1], {})
    partial = consumer.on_request_finished("t", {"params": {"reduce": "mean"}, "dropped_rows": 2})
    with pytest.raises(ExtractError, match="the engine dropped 2 of the rows asked for .*steer.capture_max_rows"):
        _rows({"activations": partial}, "here")


def test_a_server_without_the_consumer_is_named(api_server):
    with pytest.raises(ExtractError, match="capture.missing: no capture consumer instance 'missing'"):
        extract(api_server[0], PAIRS[:1], layers=[1], instance="missing")
