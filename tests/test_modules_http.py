"""Named steering modules over HTTP (real server, multi-process): register JSON / packed /
safetensors / GGUF, list, get, use at two scales in one batch, delete while in flight, auth,
malformed registrations, start-up preload, the module limits (count, bytes, body size); a module
equals the same vectors sent inline, and a reference's layer / hook selection equals those sent inline."""

from __future__ import annotations

import json
import threading

import gguf
import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from tests.conftest import API_KEY, API_SERVER_CAP, MAX_MODULES, MODULE_CAP, PRELOAD_LAYER
from tests.steering_cases import vector
from vllm_steer.client import pack

HIDDEN, LAYER = 576, 14
VEC = vector(HIDDEN, 21, 60.0)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def base(api_server):
    return api_server[0]


@pytest.fixture(scope="module")
def model(api_server):
    return api_server[1]


def complete(base, model, max_tokens=10, **body):
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, **body})
    return r


def register(base, body=None, files=None, data=None, headers=AUTH, params=None):
    if files is not None:
        return httpx.post(f"{base}/v1/steering/modules", files=files, data=data, headers=headers, params=params, timeout=60)
    return httpx.post(f"{base}/v1/steering/modules", json=body, headers=headers, params=params, timeout=60)


def gguf_control_vector(vectors: dict[int, np.ndarray]) -> bytes:
    """A control vector file as llama.cpp's cvector-generator / repeng write it."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        w = gguf.GGUFWriter(f.name, "controlvector")
        w.add_string("controlvector.model_hint", "llama")
        w.add_uint32("controlvector.layer_count", len(vectors))
        for layer, v in vectors.items():
            w.add_tensor(f"direction.{layer}", v.astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return open(f.name, "rb").read()


def test_register_json_and_use_equals_inline(base, model):
    r = register(base, {"name": "json-mod", "description": "d", "steering_vectors": {"post_mlp": {str(LAYER): VEC.tolist()}}})
    assert r.status_code == 201, r.text
    s = r.json()
    assert s["hooks"] == ["post_mlp"] and s["layers"] == [LAYER] and s["bytes"] == HIDDEN * 4
    via_module = complete(base, model, steering_module={"name": "json-mod", "scale": 1.0}).json()
    inline = complete(base, model, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}}).json()
    plain = complete(base, model).json()
    assert via_module["choices"][0]["text"] == inline["choices"][0]["text"] != plain["choices"][0]["text"]
    keys = lambda r: (r["steering"]["prefill"], r["steering"]["decode"])  # noqa: E731
    assert keys(via_module) == keys(inline)  # same config key: shares rows and cache salt
    # what was applied, said in the response (frontend.applied_report)
    assert via_module["steering"]["module"] == {"name": "json-mod", "version": s["version"], "scale": 1.0}
    assert via_module["steering"]["sites"] == inline["steering"]["sites"] == 1 and "module" not in inline["steering"]


def test_register_packed_list_and_get(base):
    r = register(base, {"name": "packed-mod", "decode_steering_vectors": {"pre_attn": pack(VEC[None], [3], "float16")}})
    assert r.status_code == 201, r.text
    listing = httpx.get(f"{base}/v1/steering/modules", timeout=30).json()
    names = {m["name"]: m for m in listing["data"]}
    assert {"packed-mod", "preloaded"} <= set(names)
    got = httpx.get(f"{base}/v1/steering/modules/packed-mod", timeout=30).json()
    assert got["tiers"] == ["decode_steering_vectors"] and got["hooks"] == ["pre_attn"] and got["in_flight"] == 0
    assert httpx.get(f"{base}/v1/steering/modules/nope", timeout=30).status_code == 404


def test_preloaded_module_from_config_is_usable(base, model):
    got = httpx.get(f"{base}/v1/steering/modules/preloaded", timeout=30).json()
    assert got["source"] == "safetensors" and got["layers"] == [PRELOAD_LAYER] and got["description"] == "from disk"
    vec = np.linspace(-1, 1, 576, dtype=np.float32) * 30
    a = complete(base, model, steering_module={"name": "preloaded"}).json()
    b = complete(base, model, steering_vectors={"post_mlp": {str(PRELOAD_LAYER): vec.tolist()}}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_safetensors_upload_with_tiers(base, model):
    data = save({f"post_mlp.{LAYER}": VEC, "decode.pre_attn.3": VEC / 2}, metadata={"description": "st"})
    r = register(base, files={"file": ("v.safetensors", data)}, data={"name": "st-mod"})
    assert r.status_code == 201, r.text
    assert r.json()["tiers"] == ["steering_vectors", "decode_steering_vectors"]
    a = complete(base, model, steering_module={"name": "st-mod"}).json()
    b = complete(base, model, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}},
                 decode_steering_vectors={"pre_attn": {"3": (VEC / 2).tolist()}}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_gguf_control_vector_direction_n_is_post_mlp_of_layer_n(base, model):
    r = register(base, files={"file": ("cv.gguf", gguf_control_vector({LAYER: VEC}))}, data={"name": "gguf-mod"})
    assert r.status_code == 201, r.text
    assert r.json()["source"] == "gguf" and r.json()["hooks"] == ["post_mlp"] and r.json()["layers"] == [LAYER]
    a = complete(base, model, steering_module={"name": "gguf-mod"}).json()
    b = complete(base, model, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_a_reference_selects_layers_and_hooks_of_a_module(base, model):
    """llama.cpp's --control-vector-layer-range for modules: a 29-layer control vector steered on layers
    5-17 equals those layers sent inline, not the whole file; a hook selection likewise."""
    vecs = {l: vector(HIDDEN, 100 + l, 15.0) for l in range(1, 30)}
    assert register(base, files={"file": ("cv.gguf", gguf_control_vector(vecs))}, data={"name": "cv29"}).status_code == 201
    mixed = {"name": "mixed", "steering_vectors": {"post_mlp": {str(LAYER): VEC.tolist()}, "pre_attn": {"3": VEC.tolist()}}}
    assert register(base, mixed).status_code == 201
    try:
        inline = {"post_mlp": {str(l): vecs[l].tolist() for l in range(5, 18)}}
        texts = {}
        for label, body in [("range", {"steering_module": {"name": "cv29", "layers": "5-17"}}),
                            ("list", {"steering_module": {"name": "cv29", "layers": list(range(5, 18))}}),
                            ("inline", {"steering_vectors": inline}), ("whole", {"steering_module": "cv29"}),
                            ("plain", {})]:
            r = complete(base, model, **body)
            assert r.status_code == 200, r.text
            texts[label] = r.json()["choices"][0]["text"]
        assert texts["range"] == texts["list"] == texts["inline"] != texts["whole"], texts
        assert texts["range"] != texts["plain"]
        a = complete(base, model, steering_module={"name": "mixed", "hooks": ["pre_attn"]}).json()
        b = complete(base, model, steering_vectors={"pre_attn": {"3": VEC.tolist()}}).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert (a["steering"]["decode"], a["steering"]["sites"]) == (b["steering"]["decode"], b["steering"]["sites"]) == (
            b["steering"]["decode"], 1)  # the selection: one of the module's pre_attn sites
        for ref, field, words in [
            ({"name": "cv29", "layers": "20-40"}, "steering_module.layers", "layer 30 out of range"),
            ({"name": "cv29", "layers": "x"}, "steering_module.layers", "expected 'all', N, A-B"),
            ({"name": "mixed", "layers": [20]}, "steering_module.layers", "the selection holds none of module 'mixed'"),
            ({"name": "cv29", "hooks": ["post_ffn"]}, "steering_module.hooks", "unknown hook point 'post_ffn'"),
        ]:
            r = complete(base, model, steering_module=ref)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and words in r.json()["error"]["message"], r.text
    finally:
        for name in ("cv29", "mixed"):
            httpx.delete(f"{base}/v1/steering/modules/{name}", headers=AUTH, timeout=30)


def test_two_scales_of_one_module_in_one_batch(base, model):
    register(base, {"name": "scaled", "steering_vectors": {"post_mlp": {str(LAYER): VEC.tolist()}}})
    results = {}

    def run(tag, **body):
        results[tag] = complete(base, model, max_tokens=16, **body).json()["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(s,), kwargs={"steering_module": {"name": "scaled", "scale": s}})
               for s in (0.5, 1.0)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    half = complete(base, model, max_tokens=16, steering_vectors={"post_mlp": {str(LAYER): (VEC * np.float32(0.5)).tolist()}}).json()
    full = complete(base, model, max_tokens=16, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}}).json()
    assert results[0.5] == half["choices"][0]["text"]
    assert results[1.0] == full["choices"][0]["text"]
    assert results[0.5] != results[1.0]


def test_409_on_existing_name_and_replace(base, model):
    body = {"name": "dup", "steering_vectors": {"post_mlp": {str(LAYER): VEC.tolist()}}}
    assert register(base, body).status_code == 201
    r = register(base, body)
    assert r.status_code == 409 and "replace=true" in r.json()["error"]["message"]
    first = complete(base, model, steering_module={"name": "dup"}).json()
    r = register(base, {**body, "steering_vectors": {"post_mlp": {str(LAYER): (-VEC).tolist()}}, "replace": True})
    assert r.status_code == 201
    second = complete(base, model, steering_module={"name": "dup"}).json()
    assert first["steering"] != second["steering"]


def stream_completion(base, model, started, out, **body):
    """A streamed completion: ``started`` is set at its first token (the request is then running),
    ``out`` gets the status and the whole text (or the error body)."""
    req = {"model": model, "prompt": "The capital of France is", "max_tokens": 300, "temperature": 0,
           "ignore_eos": True, "stream": True, **body}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=req, timeout=120) as r:
            out["status"], text = r.status_code, []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
                    started.set()
                elif line and not line.startswith("data: [DONE]"):
                    text.append(line)
            out["text"] = "".join(text)
    finally:
        started.set()


def test_delete_while_in_flight_finishes_then_refuses(base, model):
    assert register(base, {"name": "doomed", "steering_vectors": {"post_mlp": {str(LAYER): VEC.tolist()}}}).status_code == 201
    out, started = {}, threading.Event()
    t = threading.Thread(target=stream_completion, args=(base, model, started, out),
                         kwargs={"steering_module": {"name": "doomed"}})
    t.start()
    assert started.wait(120), "no token streamed within 120 s"
    # The first token has streamed, so the request is running (299 tokens to go): the scheduler counts it.
    in_flight = httpx.get(f"{base}/v1/steering/modules/doomed", timeout=30).json().get("in_flight", 0)
    assert in_flight == 1, f"in_flight {in_flight} while the request streams; the request so far: {out}"
    assert httpx.delete(f"{base}/v1/steering/modules/doomed", headers=AUTH, timeout=30).status_code == 200
    t.join()
    inline = complete(base, model, max_tokens=300, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}}).json()
    assert out["status"] == 200, out
    assert out["text"] == inline["choices"][0]["text"]
    after = complete(base, model, steering_module={"name": "doomed"})
    assert after.status_code == 400 and "unknown steering module" in after.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/steering/modules/doomed", timeout=30).status_code == 404


def test_mutations_need_the_api_key(base):
    body = {"name": "noauth", "steering_vectors": {"post_mlp": {str(LAYER): VEC.tolist()}}}
    assert register(base, body, headers={}).status_code == 401
    assert register(base, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.delete(f"{base}/v1/steering/modules/preloaded", timeout=30).status_code == 401
    assert httpx.get(f"{base}/v1/steering/modules", timeout=30).status_code == 200


GOOD_VEC = {"post_mlp": {"1": [0.5] * HIDDEN}}
BAD = [
    ({"steering_vectors": {"post_mlp": {"1": [0.0] * HIDDEN}}}, "name"),
    ({"name": "a/b", "steering_vectors": GOOD_VEC}, "name"),
    ({"name": "..", "steering_vectors": GOOD_VEC}, "name"),
    ({"name": ".hidden", "steering_vectors": GOOD_VEC}, "name"),
    ({"name": "tab\there", "steering_vectors": GOOD_VEC}, "name"),
    ({"name": "x" * 10_000, "steering_vectors": GOOD_VEC}, "name"),
    ({"name": 7, "steering_vectors": GOOD_VEC}, "name"),
    ({"name": "ok", "description": 12, "steering_vectors": GOOD_VEC}, "description"),
    ({"name": "ok", "replace": "maybe", "steering_vectors": GOOD_VEC}, "replace"),
    ({"name": "ok", "replace": 1, "steering_vectors": GOOD_VEC}, "replace"),
    ({"name": "x", "steering_vectors": {"post_mlp": {"1": [0.0] * 5}}}, "steering_vectors.post_mlp.1"),
    ({"name": "x", "steering_vectors": {"sideways": {"1": [0.0] * HIDDEN}}}, "steering_vectors.sideways"),
    ({"name": "x", "vectorz": {}}, "vectorz"),
    ({"name": "x"}, "steering_vectors"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_malformed_json_registration_is_a_400_with_the_reason(base, body, field):
    r = register(base, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field, r.text


def test_unreadable_registration_bodies_are_400s_not_500s(base):
    for raw in (b"{not json", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b"[1, 2]"):
        r = httpx.post(f"{base}/v1/steering/modules", content=raw, timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text[:300]
    r = register(base, files={"file": ("v.safetensors", save({"post_mlp.1": VEC}))}, data={"name": "a b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    r = register(base, files={"file": ("v.safetensors", save({"post_mlp.1": VEC}))},
                 data={"name": "ok-form", "replace": "perhaps"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "replace"


@pytest.mark.parametrize("filename, payload, words", [
    ("v.safetensors", b"garbage", "safetensors"),
    ("v.safetensors", save({"mlp.3": np.zeros(HIDDEN, np.float32)}), "tensor names"),
    ("v.safetensors", save({"post_mlp.3": np.zeros(7, np.float32)}), "hidden size"),
    ("v.gguf", b"GGUF" + b"\0" * 20, "GGUF"),
    ("v.json", b"{not json", "not a readable JSON module file"),
    ("v.json", b"[1, 2]", "holds an object"),
    ("v.json", b'{"steering_vectors": {"post_mlp": {"1": [1.0, 2.0]}}}', "hidden size"),
    ("v.txt", b"hello", "unsupported module file"),
], ids=["not-safetensors", "bad-name", "bad-size", "bad-gguf", "json-syntax", "json-list", "json-size", "txt"])
def test_malformed_file_registration_is_a_400_with_the_reason(base, filename, payload, words):
    r = register(base, files={"file": (filename, payload)}, data={"name": "bad-file"})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"].startswith("file"), r.text


def test_json_module_file_upload_equals_the_json_route(base, model):
    import json as _json

    body = {"steering_vectors": {"post_mlp": {str(LAYER): VEC.tolist()}}, "description": "from a file"}
    r = register(base, files={"file": ("m.json", _json.dumps(body).encode())}, data={"name": "json-file-mod"})
    assert r.status_code == 201 and r.json()["description"] == "from a file", r.text
    a = complete(base, model, steering_module={"name": "json-file-mod"}).json()
    b = complete(base, model, steering_vectors={"post_mlp": {str(LAYER): VEC.tolist()}}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


ROWS30 = pack(np.tile(VEC, (30, 1)), list(range(30)))  # 30 layers: 69,120 bytes of float32 per hook


def _gone(base, name):
    return httpx.get(f"{base}/v1/steering/modules/{name}", timeout=30).status_code == 404


def test_module_byte_cap_is_its_own_and_a_module_over_it_is_a_413_naming_the_field(base, model):
    # 138,240 bytes: over the request cap (max_request_bytes), under max_module_bytes: a module may be
    # larger than what one request may carry, and it steers as the same vectors do
    r = register(base, {"name": "big-ok", "steering_vectors": {"post_mlp": ROWS30, "pre_attn": ROWS30}})
    assert r.status_code == 201, r.text
    assert API_SERVER_CAP < r.json()["bytes"] == 2 * 30 * HIDDEN * 4 <= MODULE_CAP
    assert httpx.delete(f"{base}/v1/steering/modules/big-ok", headers=AUTH, timeout=30).status_code == 200
    three_hooks = {"post_mlp": ROWS30, "pre_attn": ROWS30, "post_attn": ROWS30}  # 207,360 bytes
    two_hooks = {"post_mlp": ROWS30, "pre_attn": ROWS30}
    st = save({f"{h}.{l}": VEC for h in ("pre_attn", "post_attn", "post_mlp") for l in range(30)})
    cases = [
        ({"name": "big", "steering_vectors": three_hooks}, None, "steering_vectors"),  # one tier over
        ({"name": "big", "prefill_steering_vectors": two_hooks, "decode_steering_vectors": {"post_mlp": ROWS30}},
         None, "prefill_steering_vectors"),  # each tier under, the module over: the largest tier is named
        (None, {"file": ("v.safetensors", st)}, "file"),
        (None, {"file": ("v.json", json.dumps({"steering_vectors": three_hooks}).encode())}, "file.steering_vectors"),
    ]
    for body, files, field in cases:
        r = register(base, body, files=files, data={"name": "big"} if files else None)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == field and "max_module_bytes" in err["message"], r.text
        assert _gone(base, "big")


def test_a_registration_body_over_the_cap_is_a_413_before_it_is_read(base):
    cap = 2 * MODULE_CAP + (1 << 20)  # module_body_cap
    junk = b"\xff" * (cap + 1)  # read, it would be a 400 (not a safetensors file)
    r = register(base, files={"file": ("v.safetensors", junk)}, data={"name": "huge"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "file", r.text
    assert "max_module_bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/steering/modules", content=b"{" + b" " * cap + b"}", timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text

    def chunks():  # no content-length: refused once the bytes that arrived pass the cap
        yield b'{"name": "huge", "description": "'
        for _ in range(cap // 65536 + 2):
            yield b"x" * 65536

    r = httpx.post(f"{base}/v1/steering/modules", content=chunks(), timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
    assert _gone(base, "huge")


def test_registering_beyond_max_modules_is_a_409_naming_the_limit(base, model):
    small = {"post_mlp": {str(LAYER): VEC.tolist()}}
    held = [m["name"] for m in httpx.get(f"{base}/v1/steering/modules", timeout=30).json()["data"]]
    fillers = [f"fill-{i}" for i in range(MAX_MODULES - len(held))]
    assert fillers, f"the shared server already holds {len(held)} modules (max_modules {MAX_MODULES})"
    try:
        for name in fillers:
            assert register(base, {"name": name, "steering_vectors": small}).status_code == 201
        for r in (register(base, {"name": "one-too-many", "steering_vectors": small}),
                  register(base, files={"file": ("v.safetensors", save({f"post_mlp.{LAYER}": VEC}))},
                           data={"name": "one-too-many"})):
            assert r.status_code == 409, r.text
            assert f"max_modules ({MAX_MODULES})" in r.json()["error"]["message"] and r.json()["error"]["param"] == "name"
        assert _gone(base, "one-too-many")
        # replacing an existing name is not a new module; deleting one frees a place
        r = register(base, {"name": fillers[0], "steering_vectors": {"post_mlp": {str(LAYER): (-VEC).tolist()}},
                            "replace": True})
        assert r.status_code == 201, r.text
        assert complete(base, model, steering_module={"name": fillers[0]}).status_code == 200
        assert httpx.delete(f"{base}/v1/steering/modules/{fillers[-1]}", headers=AUTH, timeout=30).status_code == 200
        assert register(base, {"name": "one-too-many", "steering_vectors": small}).status_code == 201
    finally:
        for name in fillers + ["one-too-many"]:
            httpx.delete(f"{base}/v1/steering/modules/{name}", headers=AUTH, timeout=30)
    assert len(httpx.get(f"{base}/v1/steering/modules", timeout=30).json()["data"]) == len(held)


def test_modules_carry_projections_json_safetensors_and_a_gguf_used_as_an_ablation(base, model):
    """A module's projections (JSON fields, safetensors ``project.<site>`` tensors with bounds, a GGUF control
    vector registered ``as_ablation``) apply to a request naming it exactly as the same projections inline:
    same text, same config key (``steering``)."""
    d_ab, d_cap = vector(HIDDEN, 31, 1.0), vector(HIDDEN, 32, 1.0)
    ops = [{"direction": d_ab.tolist(), "mode": "ablate"}, {"direction": (d_cap * 3).tolist(), "mode": "cap", "min": 20.0}]
    vecs = {"post_mlp": {str(LAYER): VEC.tolist()}}
    names = ["proj-json", "proj-st", "proj-gguf"]
    try:
        r = register(base, {"name": names[0], "steering_vectors": vecs, "steering_projections": {"post_mlp.10": ops}})
        assert r.status_code == 201 and r.json()["projections"] == {"steering_projections": {
            "post_mlp.10": ["ablate", "cap"]}}, r.text
        st = save({"project.post_mlp.10": np.stack([d_ab, d_cap * 3]),
                   "project.post_mlp.10.bounds": np.array([[0, 0], [20, np.inf]], np.float32)})
        r = register(base, files={"file": ("p.safetensors", st)}, data={"name": names[1]})
        assert r.status_code == 201 and r.json()["bytes"] == 0, r.text
        r = register(base, files={"file": ("cv.gguf", gguf_control_vector({10: d_cap * 5}))},
                     data={"name": names[2], "as_ablation": "true"})
        assert r.status_code == 201 and r.json()["layers"] == [] and r.json()["projections"] == {
            "steering_projections": {"post_mlp.10": ["ablate"]}}, r.text
        cases = [({"steering_module": names[0]}, {"steering_vectors": vecs, "steering_projections": {"post_mlp.10": ops}}),
                 ({"steering_module": names[1]}, {"steering_projections": {"post_mlp.10": ops}}),
                 ({"steering_module": names[2]}, {"steering_projections": {"post_mlp.10": [
                     {"direction": (d_cap * 5).tolist(), "mode": "ablate"}]}})]  # the same float32 values
        plain = complete(base, model).json()["choices"][0]["text"]
        for via_module, inline in cases:
            a, b = complete(base, model, **via_module).json(), complete(base, model, **inline).json()
            assert a["choices"][0]["text"] == b["choices"][0]["text"], via_module
            assert a["steering"]["decode"] == b["steering"]["decode"], via_module  # the same config key
            assert a["steering"]["projections"] == b["steering"]["projections"] == 1, a["steering"]
        assert complete(base, model, **cases[1][1]).json()["choices"][0]["text"] != plain  # the cap moves it
        r = register(base, files={"file": ("cv.gguf", gguf_control_vector({10: d_cap}))},
                     data={"name": "proj-bad", "as_ablation": "maybe"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "as_ablation", r.text
    finally:
        for name in names:
            httpx.delete(f"{base}/v1/steering/modules/{name}", headers=AUTH, timeout=30)
