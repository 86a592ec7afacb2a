"""The ``norm`` strength unit (``core.site_norms``, ``frontend.site_norms``), ``vllm-steer calibrate`` and
``vllm-steer sweep``. Parsing and file forms without an engine; on the shared SmolLM2 server: a ``norm``
strength (a module's, and inline vectors' through ``steer.site_norms``) gives the same rows (config key),
tokens and logprobs as the same vector scaled by hand; the 400s; extraction stores the norms it saw;
calibrate's norms equal transformers' hidden states'; sweep writes its tables and its PNG (a line per metric)."""

from __future__ import annotations

import csv
import io
import json

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import save

from tests import hf_oracle
from tests.conftest import API_KEY, SERVER_NORMS
from tests.test_png_chart import read_png
from vllm_steer import cli
from vllm_steer.client import pack
from vllm_steer.core.config import SteerConfig, SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.site_norms import METADATA_KEY, norm_factor, parse_norms, read_file
from vllm_steer.extract.sweep import COLORS
from vllm_steer.frontend.module_registration import module_from_file, module_from_json
from vllm_steer.frontend.site_norms import normed_tiers, server_norms
from vllm_steer.frontend.spec import ModelShape, parse_spec

HIDDEN = 8
NORMS = {("post_mlp", 1): 10.0, ("post_mlp", 2): 20.0}
SHAPE = ModelShape(4, HIDDEN, ("pre_attn", "post_attn", "post_mlp"), None, 1 << 20, site_norms=NORMS)
VEC = (np.arange(HIDDEN, dtype=np.float32) - 3.5) * 0.7


def _by_hand(v: np.ndarray, norm: float, typical: float) -> np.ndarray:
    """The documented rule: factor norm * typical / |v| in float64, applied in float32."""
    return v * np.float32(norm * typical / np.linalg.norm(v.astype(np.float64)))


# ---- no engine -------------------------------------------------------------------------
def test_inline_norm_scales_each_vector_to_a_fraction_of_its_sites_typical_norm():
    packed = {**pack(np.stack([VEC, 2 * VEC]), [1, 2]), "norm": 0.25}
    got = parse_spec({"steering_vectors": {"post_mlp": packed}}, SHAPE).tiers["steering_vectors"]["post_mlp"]
    assert np.array_equal(got[1], _by_hand(VEC, 0.25, 10.0)) and np.array_equal(got[2], _by_hand(2 * VEC, 0.25, 20.0))
    assert np.linalg.norm(got[1]) == pytest.approx(2.5, rel=1e-6) and np.linalg.norm(got[2]) == pytest.approx(5.0, rel=1e-6)
    floats = parse_spec({"decode_steering_vectors": {"post_mlp": {"norm": -0.5, "2": VEC.tolist()}}}, SHAPE)
    assert np.array_equal(floats.tiers["decode_steering_vectors"]["post_mlp"][2], _by_hand(VEC, -0.5, 20.0))
    zero = parse_spec({"steering_vectors": {"post_mlp": {"norm": 0.3, "1": [0.0] * HIDDEN}}}, SHAPE)
    assert not zero.tiers["steering_vectors"]["post_mlp"][1].any()  # a zero vector stays zero
    assert norm_factor(np.zeros(3), 5.0) == 0


@pytest.mark.parametrize("fields,field,words", [
    ({"steering_vectors": {"pre_attn": {"norm": 0.1, "1": VEC.tolist()}}}, "steering_vectors.pre_attn.norm",
     ["pre_attn.1", "vllm-steer calibrate", "--hooks pre_attn", "steer.site_norms"]),
    ({"steering_vectors": {"post_mlp": {**pack(VEC, [1]), "norm": 0.1, "scales": [2.0]}}},
     "steering_vectors.post_mlp.norm", ["not both"]),
    ({"steering_vectors": {"post_mlp": {"norm": "big", "1": VEC.tolist()}}}, "steering_vectors.post_mlp.norm",
     ["finite number"]),
    ({"steering_module": {"name": "m", "norm": 0.1, "scale": 2.0}}, "steering_module.norm", ["not both"]),
    ({"steering_module": {"name": "m", "norm": float("inf")}}, "steering_module.norm", ["finite number"]),
])
def test_bad_norm_strengths_name_the_field(fields, field, words):
    with pytest.raises(SteeringSpecError) as e:
        parse_spec(fields, SHAPE)
    assert e.value.field == field and all(w in str(e.value) for w in words), str(e.value)


def test_a_server_without_site_norms_refuses_inline_norm_strengths():
    bare = ModelShape(4, HIDDEN, ("post_mlp",), None, 1 << 20)
    with pytest.raises(SteeringSpecError, match="no typical residual norm for site post_mlp.1"):
        parse_spec({"steering_vectors": {"post_mlp": {"norm": 0.1, "1": VEC.tolist()}}}, bare)


def test_a_modules_own_norms_come_first_then_the_servers():
    module = module_from_json({"name": "m", "steering_vectors": {"post_mlp": {"1": VEC.tolist(), "2": VEC.tolist()}},
                               "site_norms": {"post_mlp.1": 3.0}}, SHAPE)
    assert module.site_norms == {("post_mlp", 1): 3.0} and module.summary()["site_norms"] == {"post_mlp.1": 3.0}
    got = normed_tiers(module.tiers, 0.5, module, NORMS)["steering_vectors"]["post_mlp"]
    assert np.array_equal(got[1], _by_hand(VEC, 0.5, 3.0)) and np.array_equal(got[2], _by_hand(VEC, 0.5, 20.0))
    with pytest.raises(SteeringSpecError, match="neither in module 'm'") as e:
        normed_tiers(module.tiers, 0.5, module, None)
    assert e.value.field == "steering_module.norm"


def test_module_files_carry_their_norms_and_a_registration_may_override_them():
    data = save({"post_mlp.1": VEC}, metadata={METADATA_KEY: json.dumps({"post_mlp.1": 7.5})})
    assert module_from_file("f", data, "f.safetensors", SHAPE).site_norms == {("post_mlp", 1): 7.5}
    calibrated = json.dumps({"format": "vllm-steer-site-norms/1", "site_norms": {"post_mlp.1": 9.0}})
    assert module_from_file("f", data, "f.safetensors", SHAPE, site_norms=calibrated).site_norms == {("post_mlp", 1): 9.0}
    with pytest.raises(SteeringSpecError) as e:
        module_from_file("f", data, "f.safetensors", SHAPE, site_norms='{"post_mlp.9": 1.0}')
    assert e.value.field == "site_norms.post_mlp.9" and "out of range" in str(e.value)


def test_a_modules_norms_reach_the_other_api_processes_through_the_registry_meta():
    from vllm_steer.core.payload import tiers_to_wire
    from vllm_steer.frontend.module_registration import _register_args
    from vllm_steer.frontend.module_store import module_from_entry

    module = module_from_json({"name": "m", "steering_vectors": {"post_mlp": {"1": VEC.tolist()}},
                               "site_norms": {"post_mlp.1": 3.25}}, SHAPE)
    meta = _register_args(module, False, None)[4]["meta"]  # what the engine core's registry keeps
    other = module_from_entry("m", {"wire": tiers_to_wire(module.tiers), "version": 7, "meta": meta}, HIDDEN)
    assert other.site_norms == {("post_mlp", 1): 3.25}


@pytest.mark.parametrize("raw,field", [({"post_mlp.1": -1.0}, "site_norms.post_mlp.1"),
                                       ({"post_mlp.1": True}, "site_norms.post_mlp.1"),
                                       ({"mid.1": 1.0}, "site_norms.mid.1"), ({}, "site_norms"), ([1.0], "site_norms")])
def test_bad_norm_files_name_the_entry(raw, field):
    with pytest.raises(SteeringSpecError) as e:
        parse_norms(raw, "site_norms", 4)
    assert e.value.field == field


def test_the_servers_norms_file_is_read_once_and_a_bad_one_names_the_key(tmp_path):
    good = tmp_path / "n.json"
    good.write_text(json.dumps({"site_norms": {"blocks.2.hook_resid_post": 12.5}}))
    assert server_norms(SteerConfig(site_norms=str(good)), 4) == {("post_mlp", 2): 12.5}
    assert read_file(good) == {("post_mlp", 2): 12.5}
    assert server_norms(SteerConfig(), 4) is None
    with pytest.raises(SteerConfigError, match="steer.site_norms: cannot read"):
        server_norms(SteerConfig(site_norms=str(tmp_path / "missing.json")), 4)
    good.write_text(json.dumps({"site_norms": {"post_mlp.7": 1.0}}))
    with pytest.raises(SteerConfigError, match=r"steer.site_norms.post_mlp.7: layer 7 out of range"):
        server_norms(SteerConfig(site_norms=str(good)), 4)


# ---- the shared SmolLM2 server -----------------------------------------------------------
PROMPT = "The most important thing about the ocean is"


def _complete(base: str, model: str, **fields) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                   "temperature": 0, "logprobs": 3, **fields}, timeout=240)
    return {"status": r.status_code, **r.json()}


def _same_output(a: dict, b: dict) -> None:
    assert a["status"] == b["status"] == 200, (a, b)
    assert a["steering"]["decode"] == b["steering"]["decode"]  # the same config key: the same rows, bit for bit
    assert a["steering"]["sites"] == b["steering"]["sites"]
    if "module" in a["steering"]:  # a module reference with a norm strength says so (frontend.applied_report)
        assert a["steering"]["module"]["norm"] > 0 and "scale" not in a["steering"]["module"]
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    assert la["tokens"] == lb["tokens"]
    assert np.allclose(la["token_logprobs"], lb["token_logprobs"], atol=1e-5)


def test_norm_strengths_equal_the_vector_scaled_by_hand_and_extraction_stores_its_norms(api_server):
    from tests.test_extract import PAIRS
    from vllm_steer.extract import extract

    base, model = api_server[0], api_server[1]
    got = extract(base, PAIRS[:3], layers=[4, 9], method="mean_diff", reduce="last")
    assert sorted(got.site_norms) == [("post_mlp", 4), ("post_mlp", 9)]
    assert json.loads(got.metadata()[METADATA_KEY]) == {"post_mlp.4": pytest.approx(got.site_norms[("post_mlp", 4)]),
                                                        "post_mlp.9": pytest.approx(got.site_norms[("post_mlp", 9)])}
    hf, tok = hf_oracle.load(model)
    with torch.no_grad():  # the statistic: mean over the texts of |residual at the last token|
        hs = [hf(torch.tensor([tok(p[s])["input_ids"]]), output_hidden_states=True).hidden_states
              for p in PAIRS[:3] for s in ("positive", "negative")]
    for layer in (4, 9):
        want = np.mean([float(h[layer + 1][0, -1].double().norm()) for h in hs])
        assert got.site_norms[("post_mlp", layer)] == pytest.approx(want, rel=1e-4)
    name = "strength-joy"
    summary = got.register(base, name, api_key=API_KEY, replace=True)  # the file carries the norms
    try:
        assert summary.site_norms == {k: pytest.approx(v, rel=1e-5) for k, v in
                                         json.loads(got.metadata()[METADATA_KEY]).items()}
        norm = 0.4
        by_norm = _complete(base, model, steering_module={"name": name, "norm": norm})
        typical = {l: summary.site_norms[f"post_mlp.{l}"] for l in (4, 9)}
        # the module's rows scaled by hand (float32 as the server reads them)
        hand = {str(l): _by_hand(got.vectors["post_mlp"][l], norm, typical[l]).tolist() for l in (4, 9)}
        _same_output(by_norm, _complete(base, model, steering_vectors={"post_mlp": hand}))
        plain = _complete(base, model)
        assert plain["choices"][0]["text"] != by_norm["choices"][0]["text"]  # it steered
        # inline vectors read the server's steer.site_norms
        v = got.vectors["post_mlp"][9]
        inline = _complete(base, model, steering_vectors={"post_mlp": {**pack(v, [9]), "norm": norm}})
        by_hand = _complete(base, model, steering_vectors={"post_mlp": {"9": _by_hand(v, norm, SERVER_NORMS["post_mlp.9"]).tolist()}})
        _same_output(inline, by_hand)
        # a site neither the module nor the server has a norm for
        no_norm = _complete(base, model, steering_vectors={"pre_attn": {"norm": 0.1, "3": v.tolist()}})
        assert no_norm["status"] == 400 and no_norm["error"]["param"] == "steering_vectors.pre_attn.norm"
        assert "vllm-steer calibrate" in no_norm["error"]["message"]
        both = _complete(base, model, steering_module={"name": name, "norm": 0.1, "scale": 1.0})
        assert both["status"] == 400 and both["error"]["param"] == "steering_module.norm"
        _sweep_writes_its_tables(base, name, api_server)
    finally:
        httpx.delete(f"{base}/v1/steering/modules/{name}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def _sweep_writes_its_tables(base: str, name: str, api_server) -> None:
    out = api_server[3].parent / "sweep"
    prompts = out.with_suffix(".txt")
    prompts.write_text(PROMPT + "\n")
    assert cli.main(["sweep", "--server", base, "--module", name, "--strengths", "0,0.4", "--max-tokens", "4",
                     "--prompts", str(prompts), "-o", str(out)]) == 0
    rows = list(csv.reader(io.StringIO(out.with_name("sweep.csv").read_text())))
    assert rows[0] == ["strength", "prompt", "fluency", "shift", "distinct", "text"] and len(rows) == 3
    cells = rows[1:]
    assert [float(c[0]) for c in cells] == [0.0, 0.4]
    # at strength 0 the steered text is the unsteered one: both scores are that text's own log-prob
    assert float(cells[0][2]) == pytest.approx(float(cells[0][3]), abs=1e-3) and float(cells[0][2]) < 0
    assert float(cells[1][3]) < float(cells[0][3])  # steering makes the unsteered text less likely
    md = out.with_name("sweep.md").read_text()
    assert md.startswith("| norm | fluency | shift | distinct |") and len(md.splitlines()) == 4
    img = read_png(out.with_name("sweep.png").read_bytes())  # no plotting library: extract.png_chart
    assert img.shape == (12 + 2 * 220 + 18 + 24, 640, 3)
    for color in COLORS.values():  # fluency, shift and distinct each drew its line
        assert (img == np.asarray(color, np.uint8)).all(axis=2).sum() > 100, color


def test_calibrate_writes_the_norms_transformers_gives(api_server, tmp_path):
    base, model = api_server[0], api_server[1]
    prompts = ["The cat sat on", "Water boils at a temperature of", "Hello there, my friend"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "norms.json"
    assert cli.main(["calibrate", "--server", base, "--prompts", str(tmp_path / "p.txt"), "--layers", "2,11",
                     "--hooks", "pre_attn,post_mlp", "-o", str(out)]) == 0
    obj = json.loads(out.read_text())
    assert obj["format"] == "vllm-steer-site-norms/1" and obj["texts"] == 3 and obj["model"]
    assert sorted(obj["site_norms"]) == ["post_mlp.11", "post_mlp.2", "pre_attn.11", "pre_attn.2"]
    hf, tok = hf_oracle.load(model)
    with torch.no_grad():
        hs = [hf(torch.tensor([tok(p)["input_ids"]]), output_hidden_states=True).hidden_states for p in prompts]
    for layer in (2, 11):
        for hook, idx in (("pre_attn", layer), ("post_mlp", layer + 1)):
            want = np.mean([float(h[idx][0, -1].double().norm()) for h in hs])
            assert obj["site_norms"][f"{hook}.{layer}"] == pytest.approx(want, rel=1e-4)
    assert read_file(out)[("pre_attn", 11)] == obj["site_norms"]["pre_attn.11"]  # what steer.site_norms reads
    down = cli.main(["calibrate", "--server", "http://127.0.0.1:9", "-o", str(tmp_path / "x.json")])
    assert down == 2 and not (tmp_path / "x.json").exists()
