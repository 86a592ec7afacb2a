"""Request API over HTTP (real OpenAI server, multi-process): floats vs packed, vllm_xargs, chat,
streaming, the applied-config response field, and a clear 400 for every kind of bad input."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
import openai
from openai import BadRequestError, OpenAI

from tests.server import log_tail, scrape_metrics
from tests.steering_cases import vector
from vllm_steer.client import pack

HIDDEN, LAYER = 576, 14
from tests.conftest import API_SERVER_CAP as CAP  # noqa: E402
from tests.conftest import LONG_STREAM_TOKENS  # noqa: E402


def bf16_exact(v: np.ndarray) -> np.ndarray:
    """Round to bf16 so every wire dtype represents the vector exactly."""
    return torch.from_numpy(v).to(torch.bfloat16).to(torch.float32).numpy()


VEC = bf16_exact(vector(HIDDEN, 3, 60.0))


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server[0]}/v1", api_key="EMPTY")


def complete(client, server, **body):
    return client.completions.create(model=server[1], prompt="The capital of France is", max_tokens=10,
                                     temperature=0, extra_body=body or None)


def test_floats_and_packed_in_every_dtype_give_identical_output_and_hash(client, server):
    plain = complete(client, server)
    assert "steering" not in (plain.model_extra or {})
    floats = complete(client, server, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}})
    packed = [complete(client, server, steering_vectors={"post_mlp": pack(VEC[None], [LAYER], dt)})
              for dt in ("float32", "float16", "bfloat16")]
    applied = floats.model_extra["steering"]
    assert applied["prefill"] == applied["decode"] and len(applied["prefill"]) == 32
    assert floats.choices[0].text != plain.choices[0].text
    for p in packed:
        assert p.choices[0].text == floats.choices[0].text
        assert p.model_extra["steering"] == applied


def test_vllm_xargs_json_string_and_phase_tiers(client, server):
    top = complete(client, server, decode_steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}})
    xargs = complete(client, server, vllm_xargs={"decode_steering_vectors": json.dumps({"post_mlp": {str(LAYER): VEC.tolist()}})})
    assert xargs.choices[0].text == top.choices[0].text
    assert top.model_extra["steering"]["prefill"] is None and top.model_extra["steering"]["decode"]


def test_transformer_lens_site_names_steer_and_capture_as_ours(server):
    """A TransformerLens site key steers exactly as our hook form (the same tokens, the same config key),
    and a capture naming sites (either spelling) gets exactly those sites, with the layers x hooks form's
    rows; a driver consumer given them (the probe, at its global spec's site) answers as its global spec."""
    from tests.conftest import PROBE_LAYER
    from vllm_steer.capture.filesystem import load_request

    base, model, _, captures = server

    def run(**fields):
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
            "return_token_ids": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    plain = run()
    ours = run(steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}})
    tl = run(steering_vectors={f"blocks.{LAYER}.hook_resid_post": VEC.tolist()})
    tokens = [r["choices"][0]["token_ids"] for r in (plain, ours, tl)]
    assert tokens[2] == tokens[1] != tokens[0]
    assert tl["steering"] == ours["steering"]

    named = run(capture={"fs": {"sites": ["blocks.3.hook_resid_post", "pre_attn.5"], "positions": "all_prompt"},
                         "probe": {"sites": [f"blocks.{PROBE_LAYER}.hook_resid_post"], "positions": "last_prompt"}})
    grid = run(capture={"fs": {"layers": [3, 5], "hooks": ["pre_attn", "post_mlp"], "positions": "all_prompt"}})
    got, want = (load_request(str(captures), f"{r['id']}-0") for r in (named, grid))
    assert sorted(got) == [(3, "post_mlp"), (5, "pre_attn")] and len(want) == 4
    for site, (positions, rows) in got.items():
        np.testing.assert_array_equal(positions, want[site][0])
        np.testing.assert_array_equal(rows, want[site][1])
    probe, default = named["capture"]["probe"], plain["capture"]["probe"]
    assert probe["rows"] == default["rows"] == 1
    assert probe["logit"] == pytest.approx(default["logit"], rel=1e-5, abs=1e-5)


def test_chat_streaming_and_non_streaming_agree_and_report_steering(client, server):
    body = {"steering_vectors": {"post_mlp": pack(VEC[None], [LAYER])}}
    msgs = [{"role": "user", "content": "Say something about the sea."}]
    full = client.chat.completions.create(model=server[1], messages=msgs, max_tokens=8, temperature=0, extra_body=body)
    chunks = list(client.chat.completions.create(model=server[1], messages=msgs, max_tokens=8, temperature=0,
                                                 extra_body=body, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert {json.dumps(c.model_extra.get("steering"), sort_keys=True) for c in chunks} == {
        json.dumps(full.model_extra["steering"], sort_keys=True)}


def _packed(**over):
    return {"post_mlp": {**pack(VEC[None], [LAYER]), **over}}


BAD = [
    ({"steering_vectors": {"mid_mlp": {"1": [0.0] * HIDDEN}}}, "steering_vectors.mid_mlp"),
    ({"steering_vectors": {"post_mlp": {"30": [0.0] * HIDDEN}}}, "steering_vectors.post_mlp.30"),
    ({"steering_vectors": {"post_mlp": {"1": [0.0] * 7}}}, "steering_vectors.post_mlp.1"),
    ({"steering_vectors": _packed(shape=[2, HIDDEN])}, "steering_vectors.post_mlp.layer_indices"),
    ({"steering_vectors": _packed(data=base64.b64encode(b"\0" * 10).decode())}, "steering_vectors.post_mlp.data"),
    ({"steering_vectors": _packed(data="not base64!")}, "steering_vectors.post_mlp.data"),
    ({"steering_vectors": _packed(dtype="int4")}, "steering_vectors.post_mlp.dtype"),
    ({"steering_vectors": {"post_mlp": pack(np.full((1, HIDDEN), np.nan, np.float32), [LAYER])}}, "steering_vectors.post_mlp.data"),
    ({"steering_vectors": _packed(scales=[1.0, 2.0])}, "steering_vectors.post_mlp.scales"),
    ({"steering_module": {"name": "no-such-module"}}, "steering_module.name"),
    ({"steering_vectors": {"post_mlp": pack(np.ones((25, HIDDEN), np.float32), list(range(25)))}}, "steering_vectors.post_mlp.data"),
    ({"prefill_steering_vectors": {"post_mlp": {str(i): [1.0] * HIDDEN for i in range(25)}}}, "prefill_steering_vectors"),
    ({"vllm_xargs": {"steering_vectors": "{not json"}}, "vllm_xargs.steering_vectors"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[b[1] + f"-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(client, server, body, field):
    with pytest.raises(BadRequestError) as e:
        complete(client, server, **body)
    err = e.value.body if isinstance(e.value.body, dict) else {}
    assert e.value.status_code == 400
    assert field in str(err.get("message", "")) or err.get("param") == field, err
    ok = complete(client, server, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}})
    assert ok.choices[0].text


def test_raw_json_body_and_status_after_errors(server):
    base, model = server[0], server[1]
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
        "steering_vectors": {"pre_attn": {"3": [0.5] * HIDDEN}}})
    assert r.status_code == 200 and r.json()["steering"]["prefill"]
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": model, "prompt": "Hello", "max_tokens": 4, "steering_vectors": {"pre_attn": {"3": [0.5]}}})
    assert r.status_code == 400 and "steering_vectors.pre_attn.3" in r.json()["error"]["message"]
    status = httpx.get(f"{base}/v1/steering", timeout=30).json()
    assert status["workers"][0]["steering"] is True


def test_a_body_over_the_cap_is_a_413_before_it_is_read(server):
    """steer.max_body_bytes (default 2 * max_request_bytes + 1 MiB): refused on the declared length,
    and on a chunked body as it arrives; the server keeps serving."""
    base, model = server[0], server[1]
    cap = 2 * CAP + (1 << 20)
    pad = {"model": model, "prompt": "Hello", "max_tokens": 2, "user": "x" * (cap + 10)}
    body = json.dumps(pad).encode()
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["param"] == "body" and str(cap) in r.json()["error"]["message"]

    def chunks():  # no content-length: transfer-encoding chunked
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    r = httpx.post(f"{base}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": model, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200


def test_applied_keys_are_in_the_server_log(server, client):
    res = complete(client, server, steering_vectors={"post_attn": {"2": VEC.tolist()}})
    key = res.model_extra["steering"]["prefill"]
    assert f"prefill={key}" in server[2].read_text()


def _big_body(model: str, cap: int) -> bytes:
    return json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2, "user": "x" * (8 * cap)}).encode()


def test_a_413_reaches_every_ordinary_client(server):
    """A body several times the cap (larger than the socket buffers): curl, httpx, urllib and the
    openai client each read the 413 instead of a connection reset (the server drains the body)."""
    import shutil
    import subprocess
    import urllib.error
    import urllib.request

    base, model = server[0], server[1]
    cap = 2 * CAP + (1 << 20)
    body = _big_body(model, cap)
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413 and json.loads(e.value.read())["error"]["param"] == "body"
    with pytest.raises(openai.APIStatusError) as e:
        openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).completions.create(
            model=model, prompt="Hello", max_tokens=2, user="x" * (8 * cap))
    assert e.value.status_code == 413
    if shutil.which("curl"):  # curl sends Expect: 100-continue: answered before the body is sent
        out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                              "content-type: application/json", "--data-binary", "@-", f"{base}/v1/completions"],
                             input=body, capture_output=True, timeout=60)
        assert out.stdout == b"413", out
    assert httpx.post(f"{base}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_msgpack_body_with_raw_bytes_equals_the_json_body(server):
    """The binary wire form: a msgpack body whose packed data is raw bytes (no base64)."""
    from vllm_steer.client import MSGPACK_CONTENT_TYPE, msgpack_body

    base, model = server[0], server[1]
    common = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    as_json = httpx.post(f"{base}/v1/completions", timeout=60, json={
        **common, "steering_vectors": {"post_mlp": pack(VEC[None], [LAYER], "bfloat16")}})
    body = msgpack_body({**common, "steering_vectors": {"post_mlp": pack(VEC[None], [LAYER], "bfloat16", binary=True)}})
    as_msgpack = httpx.post(f"{base}/v1/completions", timeout=60, content=body,
                            headers={"content-type": MSGPACK_CONTENT_TYPE})
    assert as_json.status_code == as_msgpack.status_code == 200, as_msgpack.text
    assert as_msgpack.json()["choices"][0]["text"] == as_json.json()["choices"][0]["text"]
    assert as_msgpack.json()["steering"] == as_json.json()["steering"]
    bad = httpx.post(f"{base}/v1/completions", timeout=60, content=b"\xc1not msgpack",
                     headers={"content-type": MSGPACK_CONTENT_TYPE})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"


STREAM_BAD = [
    ({"steering_vectors": {"post_mlp": {"1": [0.0] * 7}}}, "steering_vectors.post_mlp.1"),
    ({"steering_module": {"name": "no-such-module"}}, "steering_module.name"),
    ({"capture": {"nobody": {"layers": [1]}}}, "capture.nobody"),
    ({"vllm_xargs": {"steering_vectors": "[" * 5000 + "]" * 5000}}, "vllm_xargs.steering_vectors"),
    ({"vllm_xargs": {"capture": json.dumps({"fs": {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}})}},
     "vllm_xargs.capture"),
    ({"vllm_steer_prepared": "0123"}, "vllm_steer_prepared"),
    ({"vllm_xargs": {"vllm_steer_rows": "0123"}}, "vllm_steer_rows"),  # where a payload's large rows travel
]


@pytest.mark.parametrize("body, field", STREAM_BAD, ids=[b[1] + f"-{i}" for i, b in enumerate(STREAM_BAD)])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_input_is_refused_before_a_stream_starts(server, body, field, route):
    """stream: true gets the same 400 as a plain request, before any event (not 200 + an error event)."""
    base, model = server[0], server[1]
    req = {"model": model, "max_tokens": 4, "stream": True, **body}
    if route == "chat":
        url, req["messages"] = f"{base}/v1/chat/completions", [{"role": "user", "content": "Hi"}]
    else:
        url, req["prompt"] = f"{base}/v1/completions", "Hello"
    with httpx.stream("POST", url, json=req, timeout=60) as r:
        text = r.read().decode()
    assert r.status_code == 400, text[:500]
    assert "data:" not in text
    err = json.loads(text)["error"]
    assert err["param"] == field or field in err["message"], err
    plain = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert plain.status_code == 200


def test_sse_splice_touches_event_starts_only():
    """The steering field goes after the ``{`` of each event, never into generated text that
    happens to contain ``data: {``, and an empty event object gets no dangling comma."""
    import json

    from vllm_steer.server.response_field import _rewrite_sse, _steering_bytes

    splice = _steering_bytes({"prefill": "p", "decode": None})
    text = json.dumps({"text": "data: {\n}", "n": 1})
    chunk = f"data: {text}\n\ndata: {{}}\n\ndata: [DONE]\n\n".encode()
    events = [line[6:] for line in _rewrite_sse(chunk, splice).split(b"\n") if line.startswith(b"data: {")]
    assert [json.loads(e) for e in events] == [
        {"steering": {"prefill": "p", "decode": None}, "text": "data: {\n}", "n": 1},
        {"steering": {"prefill": "p", "decode": None}},
    ]


def test_json_body_fields_are_spliced_as_the_parsed_body_would_have_them():
    """A non-streaming body gets ``steering`` and ``capture`` spliced before its closing brace: the same object
    as parsing and adding them (vLLM's own text kept byte for byte, non-ASCII and all); numpy scalars in a
    consumer's result become numbers; an empty object or a non-object body goes through ``json``."""
    import json

    import numpy as np

    from vllm_steer.server.response_field import with_fields

    applied = {"prefill": "p", "decode": "d"}
    raw = json.dumps({"id": "c", "choices": [{"text": "h\u00e9 } {", "index": 0}], "usage": None}).encode() + b"\n"
    capture = {"activations": {"count": [np.int64(3)], "mean": np.float32(0.5), "data": "QUJD"}}
    out = with_fields(raw, applied, capture)
    assert out.startswith(raw.rstrip()[:-1])
    assert json.loads(out) == {**json.loads(raw), "steering": {"prefill": "p", "decode": "d"},
                               "capture": {"activations": {"count": [3], "mean": 0.5, "data": "QUJD"}}}
    assert json.loads(with_fields(raw, {}, {"x": 1})) == {**json.loads(raw), "capture": {"x": 1}}
    assert with_fields(raw, {}, None) == raw  # nothing to add: untouched
    assert json.loads(with_fields(b"{ }", applied)) == {"steering": {"prefill": "p", "decode": "d"}}
    assert with_fields(b"[1, 2]", applied) == b"[1, 2]"


def test_sae_clamps_through_the_openai_routes(server):
    """The shared server's SAE ("fz", conftest): listed, a clamp steers completions and chat alike
    (the same request twice: the same text), and a request without it is untouched."""
    from tests.conftest import SAE_CLAMPABLE, SAE_SITE

    base, model = server[0], server[1]
    listed = httpx.get(f"{base}/v1/steering/sae", timeout=30).json()["data"]
    assert [(s["name"], s["sites"], s["clampable"], s["modes"]) for s in listed] == [
        ("fz", [SAE_SITE], SAE_CLAMPABLE, ["delta"])]
    sae = {"name": "fz", "clamps": [{"feature": f, "kind": "set", "value": 60.0} for f in (1, 2, 3, 4)]}

    def text(**fields):
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    plain, clamped = text(), text(sae=sae)
    assert clamped != plain and text(sae=sae) == clamped and text() == plain
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 8, "temperature": 0, "sae": sae,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["steering"]["prefill"] is not None


def test_neuronpedia_feature_steering_is_an_add_of_strength_times_the_decoder_row(server):
    """``"sae": {"features": [{"sae", "index", "strength"}]}`` (Neuronpedia's shape) is the same request
    as add clamps (the same config key), and moves the stream by strength x W_dec[index]: the same
    tokens as that vector sent inline at the SAE's site. Bad items are 400s naming the item's key."""
    from tests.conftest import SAE_D, SAE_SEED, SAE_SITE
    from tests.sae_writers import random_sae

    base, model = server[0], server[1]
    features = [{"sae": "fz", "index": 3, "strength": 8.0}, {"sae": "fz", "index": 17, "strength": -6.0}]

    def complete(**fields):
        return httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, **fields})

    sugar = complete(sae={"features": features}).json()
    clamps = complete(sae={"name": "fz", "clamps": [{"feature": 3, "kind": "add", "value": 8.0},
                                                    {"feature": 17, "kind": "add", "value": -6.0}]}).json()
    w_dec = random_sae(HIDDEN, SAE_D, "jumprelu", seed=SAE_SEED).w_dec
    hook, layer = SAE_SITE.split(".")
    inline = complete(steering_vectors={hook: {layer: (8.0 * w_dec[3] - 6.0 * w_dec[17]).tolist()}}).json()
    plain = complete().json()
    assert sugar["steering"] == clamps["steering"]
    assert sugar["choices"][0]["text"] == clamps["choices"][0]["text"] == inline["choices"][0]["text"]
    assert sugar["choices"][0]["text"] != plain["choices"][0]["text"]
    for bad, field, words in [
        ({"features": [{"sae": "nope", "index": 3, "strength": 1.0}]}, "sae.features[0].sae", "unknown SAE 'nope'"),
        ({"features": [features[0], {"sae": "fz", "index": 40, "strength": 1.0}]}, "sae.features[1].index",
         "feature 40 is not clampable"),
        ({"features": [{"sae": "fz", "index": 3, "strength": "x"}]}, "sae.features[0].strength", ""),
        ({"features": [features[0], features[0]]}, "sae.features[1].index", "given twice"),
        ({"features": [], "name": "fz"}, "sae", "unknown keys ['name']"),
        ({"features": []}, "sae.features", "expected a non-empty list"),
    ]:
        r = complete(sae=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert words in r.json()["error"]["message"], r.text


def _metric(base: str, name: str, **labels) -> float:
    """The value of one sample on vLLM's /metrics (0 when absent); labels in any order."""
    import re

    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and m[1] == name and dict(re.findall(r'(\w+)="([^"]*)"', m[2] or "")) == labels:
            return float(m[3])
    return 0.0


def test_prometheus_counts_steered_and_refused_requests(server):
    base, model = server[0], server[1]
    before = {k: _metric(base, "vllm_steer_requests_total", kind=k) for k in ("vectors", "sae")}
    refused = _metric(base, "vllm_steer_rejected_total", status="400", field="sae")
    timed = _metric(base, "vllm_steer_prepare_seconds_count")
    body = {"model": model, "prompt": "Hi", "max_tokens": 2,
            "steering_vectors": {"post_mlp": {"3": [0.5] * 576}},
            "sae": {"name": "fz", "clamps": [{"feature": 1, "kind": "set", "value": 3.0}]}}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 200
    bad = {**body, "sae": {"name": "fz", "clamps": [{"feature": "one", "kind": "set", "value": 3.0}]}}
    assert httpx.post(f"{base}/v1/completions", json=bad, timeout=120).status_code == 400
    assert _metric(base, "vllm_steer_requests_total", kind="vectors") == before["vectors"] + 1
    assert _metric(base, "vllm_steer_requests_total", kind="sae") == before["sae"] + 1
    assert _metric(base, "vllm_steer_rejected_total", status="400", field="sae") == refused + 1
    assert _metric(base, "vllm_steer_prepare_seconds_count") == timed + 2  # refused ones are timed too


def test_prometheus_engine_metrics_follow_rows_uploads_and_captures(server):
    """Engine values on /metrics (fetched per scrape): capacity, modules, rows in use while a steered
    stream runs and after it is closed, one upload of a new config's rows (bytes: every hook's whole
    row), none when the same config comes back while its row is resident, and captured rows (the
    probe's global spec captures every request)."""
    import threading
    import time

    base, model = server[0], server[1]
    workers = httpx.get(f"{base}/v1/steering", timeout=30).json()["workers"]
    modules = httpx.get(f"{base}/v1/steering/modules", timeout=30).json()["data"]
    n_layers = json.load(open(f"{model}/config.json"))["num_hidden_layers"]
    before = scrape_metrics(base)
    assert before["vllm_steer_rows_capacity"] == 15  # max_configs 16, row 0 is the zero row
    assert before["vllm_steer_modules"] == len(modules) >= 1 and before["vllm_steer_saes"] == 1
    assert before["vllm_steer_requests_waiting_for_row"] == 0
    assert before["vllm_steer_engine_metrics_updated_seconds"] > 0 and before["vllm_steer_preemptions_total"] >= 0
    # at rest: the preloaded module's rows are cached, not held (rows in use are running requests' only)
    assert before["vllm_steer_rows_in_use_peak"] >= 1 and before["vllm_steer_rows_in_use"] == 0

    rng = np.random.default_rng()  # a config no earlier request had: its row must be written
    vectors = {h: {"3": rng.standard_normal(HIDDEN).astype(np.float32).tolist()}
               for h in ("pre_attn", "post_attn", "post_mlp")}
    body = {"model": model, "prompt": "Hi", "max_tokens": LONG_STREAM_TOKENS, "ignore_eos": True, "stream": True,
            "steering_vectors": vectors}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events, done = [], threading.Event()

        def read() -> None:  # a client that reads its stream (an unread one may be cut off)
            try:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(line)
            except httpx.HTTPError:  # closed by the test when it leaves the block
                pass
            done.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.time() + 60
        while not events:
            assert time.time() < deadline and not done.is_set(), "no token streamed"
            time.sleep(0.05)
        # tokens are streaming: the request holds its row. A scrape may serve the answer to a question
        # asked before (one in flight per process, 2 s wait): ask until it is in.
        while (during := scrape_metrics(base))["vllm_steer_rows_in_use"] != before["vllm_steer_rows_in_use"] + 1:
            assert time.time() < deadline and not done.is_set(), (
                f"rows in use stayed at {during['vllm_steer_rows_in_use']}; stream done: {done.is_set()} "
                f"after {len(events)} events; the server log ends:\n{log_tail(server[2])}")
            time.sleep(0.2)
    # leaving the block closed the stream: vLLM aborts the request and its row is released
    assert during["vllm_steer_rows_in_use_peak"] >= during["vllm_steer_rows_in_use"]
    assert during["vllm_steer_row_uploads_total"] == before["vllm_steer_row_uploads_total"] + 1
    row_bytes = len(workers) * 3 * n_layers * HIDDEN * 4  # every hook touched: its whole float32 row
    assert during["vllm_steer_row_upload_bytes_total"] == before["vllm_steer_row_upload_bytes_total"] + row_bytes

    deadline = time.time() + 60  # the worker hears of the aborted request at the next step
    while (after := scrape_metrics(base))["vllm_steer_rows_in_use"] != before["vllm_steer_rows_in_use"]:
        assert time.time() < deadline, f"rows in use stayed at {after['vllm_steer_rows_in_use']}"
        time.sleep(0.5)
    assert after["vllm_steer_capture_rows_total"] > before["vllm_steer_capture_rows_total"]
    assert after["vllm_steer_capture_dropped_finishes_total"] == 0  # exported; no consumer here is stuck
    again = {"model": model, "prompt": "Hi", "max_tokens": 2, "steering_vectors": vectors}
    assert httpx.post(f"{base}/v1/completions", json=again, timeout=120).status_code == 200
    last = scrape_metrics(base)  # the same config again: its row was still resident, nothing is written
    assert last["vllm_steer_row_uploads_total"] == after["vllm_steer_row_uploads_total"]
    assert last["vllm_steer_row_upload_bytes_total"] == after["vllm_steer_row_upload_bytes_total"]


# ---- one pass (issue 41): no engine, the real middleware and a handler doing vLLM's part ----------------------


def _through_api_process(body: bytes, msgpack: bool = False) -> tuple[dict, dict, dict]:
    """(what vLLM's handler parsed, the engine request's extra_args, call counts of the vector parsers) of one
    request through ``SteeringRequestMiddleware``, vLLM's request model and ``process_inputs``' preparation."""
    import asyncio
    from types import SimpleNamespace
    from unittest import mock

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_steer.frontend import prepare, spec
    from vllm_steer.frontend.prepare import SteeringFrontend, _prepared
    from vllm_steer.server.openai_fields import endpoint_attached, patch_openai_requests
    from vllm_steer.server.request_body import SteeringRequestMiddleware

    patch_openai_requests()
    endpoint_attached()
    mc = SimpleNamespace(dtype=torch.float32, hf_text_config=SimpleNamespace(num_hidden_layers=4),
                         get_hidden_size=lambda: 64)
    fe = SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": {}}))
    app = SimpleNamespace(state=SimpleNamespace(steer_config=fe.cfg, steer_frontend=fe,
                                                steer_engine_client=SimpleNamespace(collective_rpc=None)))
    seen: dict = {}
    calls = {"engine_extra_args": 0, "packed_data": 0, "parse_vector": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    async def vllm_handler(scope, receive, send):
        message = await receive()
        seen["body"] = message["body"]
        request = CompletionRequest.model_validate(json.loads(message["body"]))
        params = request.to_sampling_params(8, {})
        seen["extra_args"] = _prepared(fe, params.extra_args or {}, "req-0").extra_args
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        seen.setdefault("status", message.get("status"))

    ctype = b"application/msgpack" if msgpack else b"application/json"
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "app": app,
             "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]}
    with mock.patch.object(SteeringFrontend, "engine_extra_args",
                           counting("engine_extra_args", SteeringFrontend.engine_extra_args)), \
            mock.patch.object(spec, "_packed_data", counting("packed_data", spec._packed_data)), \
            mock.patch.object(spec, "parse_vector", counting("parse_vector", spec.parse_vector)):
        asyncio.run(SteeringRequestMiddleware(vllm_handler)(scope, receive, send))
    assert seen["status"] == 200, seen
    assert prepare.PREPARED.payloads() == []  # the token lived only while its request was added
    return json.loads(seen["body"]), seen["extra_args"], calls


@pytest.mark.parametrize("form", ["packed JSON", "packed msgpack", "floats JSON", "large packed JSON"])
def test_vectors_are_parsed_once_and_never_reach_vllm(form):
    """The steering fields are decoded and prepared once, in the middleware (on the loop for a small body,
    in the pool for a large one); vLLM's handler parses a body without them and ``process_inputs`` only
    attaches the prepared payload."""
    import msgspec

    from vllm_steer.core.payload import PAYLOAD_KEY, decode_payload
    from vllm_steer.server.request_body import INLINE_BYTES

    rng = np.random.default_rng(5)
    rows = rng.standard_normal((4 if form.startswith("large") else 2, 64)).astype(np.float32)
    layers = list(range(len(rows)))
    if form.startswith("floats"):
        vectors = {"post_mlp": {str(l): rows[l].tolist() for l in layers}}
    else:
        vectors = {"post_mlp": pack(rows, layers, "float32"), "pre_attn": pack(rows, layers, "float32")}
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "steering_vectors": vectors}
    if form.startswith("large"):  # past INLINE_BYTES: prepared in the pool
        body["prompt"] = [1] * (INLINE_BYTES // 2)
    msgpack = form.endswith("msgpack")
    if msgpack:
        body["steering_vectors"] = {h: {**p, "data": base64.b64decode(p["data"])} for h, p in vectors.items()}
    raw = msgspec.msgpack.encode(body) if msgpack else json.dumps(body).encode()
    assert (len(raw) > INLINE_BYTES) == form.startswith("large")
    parsed, extra, calls = _through_api_process(raw, msgpack)
    assert "steering_vectors" not in parsed and set(parsed["vllm_xargs"]) == {"vllm_steer_prepared"}
    assert calls["engine_extra_args"] == 1
    if form.startswith("floats"):
        assert calls == {"engine_extra_args": 1, "packed_data": 0, "parse_vector": len(layers)}
    else:
        assert calls == {"engine_extra_args": 1, "packed_data": 2, "parse_vector": 0}  # one per hook
    payload = decode_payload(extra[PAYLOAD_KEY])
    assert set(extra) == {PAYLOAD_KEY} and payload.prefill == payload.decode
    hooks = ("post_mlp",) if form.startswith("floats") else ("pre_attn", "post_mlp")
    for hook in hooks:
        ids, got = payload.configs[payload.prefill][hook]
        assert list(ids) == layers
        np.testing.assert_array_equal(np.frombuffer(got, dtype=np.float32).reshape(rows.shape), rows)


def test_a_misspelled_steering_field_is_a_400_with_did_you_mean_and_extras_pass(server):
    """A near-miss alone in a body (no real steering field for the marker scan to find), at the top level or in
    vllm_xargs, on both routes and streaming, is refused naming it; vLLM-accepted extras still pass."""
    base, model = server[0], server[1]
    refused = {f: _metric(base, "vllm_steer_rejected_total", status="400", field=f) for f in ("other", "vllm_xargs")}
    cases = [("/v1/completions", {"prompt": "Hi", "steering_vector": {"post_mlp": {"3": [0.5] * 576}}},
              "steering_vector", "steering_vectors"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "capure": {}},
              "capure", "capture"),
             ("/v1/completions", {"prompt": "Hi", "vllm_xargs": {"steering_modul": '{"name": "preloaded"}'}},
              "vllm_xargs.steering_modul", "steering_module")]
    for route, body, param, meant in cases:
        r = httpx.post(f"{base}{route}", timeout=60, json={"model": model, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and f"did you mean `{meant}`?" in error["message"]
    for field, more in (("other", 2), ("vllm_xargs", 1)):  # counted under the top-level key's label
        assert _metric(base, "vllm_steer_rejected_total", status="400", field=field) == refused[field] + more
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": "Hi", "max_tokens": 2, "user": "u", "metadata": {"k": "v"}, "x-vendor-trace": "t",
        "vllm_xargs": {"tenant": "a"}})
    assert r.status_code == 200 and "steering" not in r.json()
