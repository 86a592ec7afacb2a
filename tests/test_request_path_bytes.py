"""The request path's byte handling (issue 41, no engine): base64 strings lifted out of a JSON body
(``server.base64_lift``), ``core.layout.raw_rows`` against the general float32 path, and one 1 MB request's
key and engine payload equal whichever way its vectors came (JSON with and without the lift, msgpack)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from tests.asgi_drive import completion_scope, post, reply_ok
from vllm_steer.client import pack
from vllm_steer.core import bf16
from vllm_steer.core.layout import raw_rows, table_layout
from vllm_steer.core.payload import PAYLOAD_KEY, ROWS_KEY, payload_from_extra
from vllm_steer.server import base64_lift, request_body

HOOKS = ("pre_attn", "post_attn", "post_mlp")


def _b64(n: int, seed: int = 0) -> str:
    return base64.b64encode(np.random.default_rng(seed).bytes(n)).decode()


def _as_text(obj):
    """``obj`` with every bytes value as the base64 text it was lifted from."""
    if isinstance(obj, dict):
        return {k: _as_text(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_text(v) for v in obj]
    return base64.b64encode(obj).decode() if isinstance(obj, bytes) else obj


def test_packed_blocks_are_lifted_as_bytes_and_the_rest_equals_the_plain_parse():
    data = {h: _b64(3 * base64_lift.MIN_CHARS, i) for i, h in enumerate(HOOKS)}
    probe = _b64(base64_lift.MIN_CHARS, 7)
    obj = {"model": "m", "prompt": "say \"data\": \"x\"", "max_tokens": 4,
           "steering_vectors": {h: {"dtype": "bfloat16", "shape": [1, 8], "layer_indices": [0], "data": d}
                                for h, d in data.items()},
           "steering_condition": {"site": "pre_attn.1", "probe": {"dtype": "float32", "data": probe}},
           "steering_projections": {"post_mlp.1": [{"direction": {"dtype": "float32", "data": probe},
                                                    "mode": "ablate"}]},
           "vllm_xargs": {"decode_steering_vectors": {"post_mlp": {"data": data["post_mlp"]}}}}
    body = json.dumps(obj, indent=1).encode()  # whitespace around the colons too
    got = request_body._decode(body, False)
    for h in HOOKS:  # the tiers' blocks: raw bytes, as a msgpack body carries them
        assert got["steering_vectors"][h]["data"] == base64.b64decode(data[h])
    assert got["vllm_xargs"]["decode_steering_vectors"]["post_mlp"]["data"] == base64.b64decode(data["post_mlp"])
    # any other packed {"dtype", "data"} of the steering fields (a probe, a projection's direction): bytes too
    assert got["steering_condition"]["probe"]["data"] == base64.b64decode(probe)
    assert got["steering_projections"]["post_mlp.1"][0]["direction"]["data"] == base64.b64decode(probe)
    assert _as_text(got) == json.loads(body)


@pytest.mark.parametrize("case", ["key ending in data", "escaped slash", "invalid base64", "duplicate field",
                                  "short", "not a string"])
def test_what_is_not_a_tier_block_parses_as_before(case):
    """Anything the lift must not touch decodes exactly as the plain parse does (strings stay strings)."""
    long = _b64(2 * base64_lift.MIN_CHARS)
    tier = {"post_mlp": {"dtype": "float32", "data": long}}
    if case == "key ending in data":  # a vLLM field whose key merely ends in "data: the whole body parsed again
        body = json.dumps({"prompt": "p", "metadata": {'x"data': long}, "steering_vectors": tier}).encode()
    elif case == "escaped slash":  # valid JSON for "/": left to the parser
        text = json.dumps({"prompt": "p", "steering_vectors": {"post_mlp": {"data": long + "/A=="}}})
        body = text.replace("/", "\\/").encode()
    elif case == "invalid base64":  # left as text: the front end names it ("invalid base64")
        body = json.dumps({"steering_vectors": {"post_mlp": {"data": long[:-1] + "*"}}}).encode()
    elif case == "duplicate field":  # the last one wins, as in the plain parse (the first's placeholder is gone)
        body = (b'{"steering_vectors": ' + json.dumps(tier).encode() + b', "steering_vectors": {"pre_attn": {"data": "'
                + _b64(2 * base64_lift.MIN_CHARS, 1).encode() + b'"}}}')
    elif case == "short":
        body = json.dumps({"prompt": "p" * base64_lift.MIN_CHARS, "steering_vectors": {"post_mlp": {"data": "AAAA"}}}
                          ).encode()
    else:
        body = json.dumps({"prompt": "p" * base64_lift.MIN_CHARS, "steering_vectors": {"post_mlp": {"data": 5}}}
                          ).encode()
    if case in ("key ending in data", "duplicate field"):
        assert base64_lift.lift(body) is not None  # lifted, then refused by ``restore``
    got = request_body._decode(body, False)
    assert got == json.loads(body)  # the lifted parse is dropped (a placeholder went missing or stood elsewhere)
    assert not any(isinstance(v.get("data"), bytes) for v in got["steering_vectors"].values())


@pytest.mark.parametrize("case", ["as long", "shorter, a quote where the last ended", "longer", "invalid base64"])
def test_a_block_is_lifted_whatever_the_last_blocks_length(monkeypatch, case):
    """The closing quote is first looked for where the last lifted string's length puts it (``_hinted``): a string
    of another length, or a quote of the next string standing there, lifts as without the hint."""
    hint = 3 * base64_lift.MIN_CHARS
    monkeypatch.setattr(base64_lift, "_LAST", [hint])
    data = {"as long": _b64(hint // 4 * 3), "longer": _b64(hint), "invalid base64": _b64(hint // 4 * 3)[:-1] + "*",
            "shorter, a quote where the last ended": _b64(2 * base64_lift.MIN_CHARS - 2)}[case]  # unpadded
    head = '{"prompt": "p", "steering_vectors": {"post_mlp": {"data": "'
    rest = '", "note": "'  # a string whose closing quote stands ``hint`` characters after the block's start
    body = (head + data + rest + "n" * max(hint - len(data) - len(rest), 0) + '"}}}').encode()
    if case.startswith("shorter"):
        assert body[len(head) + hint:len(head) + hint + 1] == b'"'
    got = request_body._decode(body, False)
    assert _as_text(got) == json.loads(body)
    block = got["steering_vectors"]["post_mlp"]["data"]
    assert block == (data if case == "invalid base64" else base64.b64decode(data))


def test_raw_rows_equal_the_float32_path_on_every_dtype():
    """Rows sent in the model's dtype are checked and keyed on their bits; the result equals ``table_layout``
    of the same values (zero rows dropped, -0.0 as 0.0, sorted layers) and NaN / Inf are refused."""
    rng, pick = np.random.default_rng(3), random.Random(3)
    for trial in range(400):
        dtype = pick.choice(["float32", "float16", "bfloat16"])
        n, d = pick.randint(1, 5), pick.choice([1, 4, 16])
        values = rng.standard_normal((n, d)).astype(np.float32)
        for _ in range(pick.randint(0, 4)):
            i, j = pick.randrange(n), pick.randrange(d)
            values[i, pick.choice([j, slice(None)])] = pick.choice([0.0, -0.0, np.inf, -np.inf, np.nan])
        if dtype == "bfloat16":
            words = bf16.to_bits(values)
            values = bf16.from_bits(words).reshape(n, d)
        else:
            words = values.astype(dtype)
            values = words.astype(np.float32)
        layers = pick.sample(range(12), n)
        raw = np.ascontiguousarray(words).tobytes()
        try:
            expected = table_layout({"post_mlp": {l: values[i] for i, l in enumerate(layers)
                                                  if values[i].any() or not np.isfinite(values[i]).all()}}, dtype)
        except ValueError:
            expected = "refused"
        try:
            got = raw_rows(raw, layers, dtype, d)
        except ValueError:
            got = "refused"
        assert got == expected.get("post_mlp") if isinstance(expected, dict) else got == expected, (trial, dtype)


def _engine_payload(fe, body: bytes, msgpack: bool) -> tuple[str, bytes, list]:
    """(prefill key, engine payload bytes, the rows beside it) of one request through the real middleware and
    ``process_inputs``' preparation (what vLLM's handler does in between: parse the body it gets,
    ``to_sampling_params``)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_steer.frontend.prepare import _prepared
    from vllm_steer.server.openai_fields import endpoint_attached, patch_openai_requests

    patch_openai_requests()
    endpoint_attached()
    seen = {}

    async def handler(scope, receive, send):
        message = await receive()
        params = CompletionRequest.model_validate(json.loads(message["body"])).to_sampling_params(8, {})
        ready = _prepared(fe, params.extra_args, "req-0")
        seen["out"] = ready.prefill_key, ready.extra_args[PAYLOAD_KEY], [bytes(r) for r in ready.extra_args[ROWS_KEY]]
        await reply_ok(send)

    asyncio.run(post(request_body.SteeringRequestMiddleware(handler), completion_scope(fe, body, msgpack), body))
    return seen["out"]


def test_a_1mb_json_request_has_the_key_and_payload_of_the_same_vectors_as_msgpack(monkeypatch):
    """32 layers x 4096 x 3 hooks of bf16 (1 MB of JSON): lifted, parsed plainly (lift off) and as msgpack bins,
    the prefill key and the engine payload's bytes are the same, and the rows are the ones sent (the -0.0 and
    the zero row sent in one hook normalised as the float32 path does)."""
    from vllm_steer.frontend.prepare import SteeringFrontend

    mc = SimpleNamespace(dtype=torch.bfloat16, hf_text_config=SimpleNamespace(num_hidden_layers=32),
                         get_hidden_size=lambda: 4096)
    fe = SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": {}}))
    rng = np.random.default_rng(11)
    vectors = {h: (rng.standard_normal((32, 4096), dtype=np.float32) * 0.05) for h in HOOKS}
    vectors["post_mlp"][3] = 0.0
    vectors["post_mlp"][5, 7] = -0.0
    layers = list(range(32))[::-1]  # unsorted: rows reordered on the way
    packed = {h: pack(v, layers, "bfloat16") for h, v in vectors.items()}
    base = {"model": "m", "prompt": [1] * 16, "max_tokens": 4}
    as_json = json.dumps({**base, "steering_vectors": packed}).encode()
    as_msgpack = msgspec.msgpack.encode({**base, "steering_vectors": {h: pack(v, layers, "bfloat16", binary=True)
                                                                       for h, v in vectors.items()}})
    assert len(as_json) > 1_000_000
    lifted = _engine_payload(fe, as_json, False)
    binary = _engine_payload(fe, as_msgpack, True)
    monkeypatch.setattr(base64_lift, "MIN_CHARS", 1 << 40)  # the plain parse: base64 text to the front end
    plain = _engine_payload(fe, as_json, False)
    assert lifted == plain == binary and lifted[0] is not None
    assert [len(r) for r in lifted[2]] == [2 * 4096 * (31 if h == "post_mlp" else 32) for h in HOOKS]
    payload = payload_from_extra({PAYLOAD_KEY: lifted[1], ROWS_KEY: lifted[2]})
    rows = payload.configs[payload.prefill]
    for h in HOOKS:
        values = bf16.from_bits(bf16.to_bits(vectors[h])).reshape(32, 4096)
        keep = [l for l in sorted(layers) if values[31 - l].any()]
        ids, raw = rows[h]
        assert list(ids) == keep
        np.testing.assert_array_equal(bf16.from_bits(np.frombuffer(raw, np.uint16)).reshape(len(keep), 4096),
                                      values[[31 - l for l in keep]] + np.float32(0.0))
        assert not (np.frombuffer(raw, np.uint16) == 0x8000).any()  # no -0.0 left


@pytest.mark.parametrize("form", ["json", "msgpack"])
def test_a_lifted_body_on_the_packed_fast_path_is_prepared_on_the_event_loop(monkeypatch, form):
    """A 1 MB body whose vectors are packed in the model's dtype and whose rest is small (JSON: once its base64 blocks
    lift away; msgpack: outside its steering fields) is prepared on the event loop (no pool hop); float32 vectors for
    a bf16 model (converted value by value) are prepared in the pool, as is a msgpack body whose rest (a long prompt)
    is not small, and a body past INLINE_LIFTED_BYTES is read there whole; either way the same vectors get the same
    payload. The same float32 vectors a third time (their conversion remembered) are prepared on the loop too."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_steer.core import layout
    from vllm_steer.core.recent_blocks import Recent
    from vllm_steer.frontend.prepare import SteeringFrontend

    monkeypatch.setattr(layout, "CHECKED", Recent(64 << 20))  # nothing remembered from other tests
    monkeypatch.setattr(base64_lift, "TEXTS", Recent(64 << 20))

    mc = SimpleNamespace(dtype=torch.bfloat16, hf_text_config=SimpleNamespace(num_hidden_layers=32),
                         get_hidden_size=lambda: 4096)
    fe = SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": {}}))
    hops = []

    class Counting(ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            hops.append(fn.__name__)
            return super().submit(fn, *args, **kwargs)

    executor = Counting(1)
    monkeypatch.setattr(request_body, "pool", lambda: executor)
    rng = np.random.default_rng(12)
    vectors = {h: rng.standard_normal((32, 4096), dtype=np.float32) for h in HOOKS}
    base = {"model": "m", "prompt": [1] * 16, "max_tokens": 4}

    msgpack = form == "msgpack"

    def body(dtype: str, layers: int, prompt: list = base["prompt"]) -> bytes:
        tier = {h: pack(v[:layers], list(range(layers)), dtype, binary=msgpack) for h, v in vectors.items()}
        obj = {**base, "prompt": prompt, "steering_vectors": tier}
        return msgspec.msgpack.encode(obj) if msgpack else json.dumps(obj).encode()

    bf16_body, f32_body = body("bfloat16", 32), body("float32", 16)
    least = 750_000 if msgpack else 1_000_000  # 768 KiB of rows, as bins or as base64
    assert request_body.INLINE_BYTES < least < len(bf16_body) <= request_body.INLINE_LIFTED_BYTES
    assert least < len(f32_body) <= request_body.INLINE_LIFTED_BYTES
    on_loop = _engine_payload(fe, bf16_body, msgpack)
    assert hops == []
    f32_payload = _engine_payload(fe, f32_body, msgpack)
    assert hops == ["_prepare_fields"]
    assert _engine_payload(fe, f32_body, msgpack) == f32_payload  # converted again, and now remembered
    assert hops == ["_prepare_fields"] * 2
    assert _engine_payload(fe, f32_body, msgpack) == f32_payload  # the same float32 vectors again: on the loop
    assert hops == ["_prepare_fields"] * 2
    hops.clear()
    if msgpack:  # a long prompt beside the vectors: decoded in the pool, not on the loop
        long = body("bfloat16", 32, list(range(request_body.INLINE_BYTES)))
        assert len(long) <= request_body.INLINE_LIFTED_BYTES
        assert _engine_payload(fe, long, msgpack) == on_loop
        assert hops == ["_prepare"]
        hops.pop()
    monkeypatch.setattr(request_body, "INLINE_LIFTED_BYTES", len(bf16_body) - 1)
    assert _engine_payload(fe, bf16_body, msgpack) == on_loop and on_loop[0] is not None
    assert hops == ["_prepare"]
    executor.shutdown()


def test_the_same_vectors_again_are_not_decoded_checked_or_hashed_again(monkeypatch):
    """A client sending the same vectors with every request: the first two times a block is decoded, checked and
    hashed (the first time nothing of it is kept: new vectors cost no memory), from the third on its base64 text is
    found decoded (``base64_lift.TEXTS``) and the bytes found checked and hashed (``layout.CHECKED``): no base64
    decode, no row check, no BLAKE3; the same key and payload each time. A block that differs in one byte between
    equal ends is decoded, checked and keyed anew; msgpack bins equal to checked rows are compared, not checked; a
    block refused by the check is refused every time; the memory is bounded."""
    from vllm_steer.core import layout
    from vllm_steer.core.recent_blocks import Recent
    from vllm_steer.frontend.prepare import SteeringFrontend

    def fresh_memory():
        monkeypatch.setattr(base64_lift, "TEXTS", Recent(64 << 20))
        monkeypatch.setattr(layout, "CHECKED", Recent(64 << 20))

    fresh_memory()
    calls = {"b64decode": 0, "raw_rows": 0, "rows_digest": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(base64_lift, "pybase64", SimpleNamespace(b64decode=counted("b64decode", base64_lift.pybase64.b64decode)))
    for name in ("raw_rows", "rows_digest"):
        monkeypatch.setattr(layout, name, counted(name, getattr(layout, name)))
    mc = SimpleNamespace(dtype=torch.bfloat16, hf_text_config=SimpleNamespace(num_hidden_layers=32),
                         get_hidden_size=lambda: 4096)
    fe = SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": {}}))
    rng = np.random.default_rng(13)
    vectors = {h: rng.standard_normal((32, 4096), dtype=np.float32) for h in HOOKS}
    base = {"model": "m", "prompt": [1] * 16, "max_tokens": 4}

    def body(vecs: dict, msgpack: bool = False) -> bytes:
        tier = {h: pack(v, list(range(32)), "bfloat16", binary=msgpack) for h, v in vecs.items()}
        return (msgspec.msgpack.encode if msgpack else lambda o: json.dumps(o).encode())({**base, "steering_vectors": tier})

    first = _engine_payload(fe, body(vectors), False)
    seen = []
    for _ in range(3):  # new body objects with the same texts
        assert _engine_payload(fe, body(vectors), False) == first
        seen.append(dict(calls))
    assert seen == [{"b64decode": 6, "raw_rows": 6, "rows_digest": 6}] * 3
    changed = {**vectors, "post_attn": vectors["post_attn"].copy()}
    changed["post_attn"][16, 100] += 1.0  # the middle of its text: same length and ends
    other = _engine_payload(fe, body(changed), False)
    assert calls == {"b64decode": 7, "raw_rows": 7, "rows_digest": 7} and other[0] != first[0]
    fresh_memory()  # the reference: nothing remembered
    assert _engine_payload(fe, body(changed), False) == other
    assert _engine_payload(fe, body(vectors, msgpack=True), True) == first
    assert calls["raw_rows"] == 13  # its keys came before (changed's): kept now
    for _ in range(2):  # equal bins: compared, not checked
        assert _engine_payload(fe, body(vectors, msgpack=True), True) == first
    assert calls["raw_rows"] == 13 and calls["rows_digest"] == 13
    nan = bf16.to_bits(np.full((2, 8), np.nan, np.float32)).tobytes()
    for _ in range(3):
        with pytest.raises(ValueError, match="NaN or Inf"):
            layout.checked_rows(nan, [0, 1], "bfloat16", 8)
    assert calls["raw_rows"] == 16
    monkeypatch.setattr(layout, "CHECKED", Recent(3 * 2 * 32 * 4096))  # room for three blocks of 256 KiB
    for seed in range(4):
        block = bf16.to_bits(np.random.default_rng(seed).standard_normal((32, 4096), dtype=np.float32)).tobytes()
        for _ in range(2):
            layout.checked_rows(block, list(range(32)), "bfloat16", 4096)
    assert len(layout.CHECKED) == 3 and layout.CHECKED.held_bytes == 3 * 2 * 32 * 4096


@pytest.mark.parametrize("key", ["steering_vectors", "decode_steering_vectors", "steering_module", "capture", "sae",
                                 "steering_condition", "steering_projections", "prefill_steering_projections",
                                 "vllm_steer_token"])
def test_the_steering_markers_find_every_field_key_in_one_pass(key):
    """``request_body._MARKERS``: any steering field's key (quoted, as JSON writes keys) or a ``"vllm_steer``
    key anywhere in a body, after a large prompt too; a body naming none, or only a longer key, is not marked (it
    passes through to vLLM untouched)."""
    big = json.dumps({"prompt": "x" * 200_000, "pad": _b64(300_000)})[:-1]
    assert request_body._MARKERS.search(f'{big}, "{key}": 1}}'.encode())
    assert not request_body._MARKERS.search(f'{big}, "{key}x": 1, "note": "{key} in a text"}}'.encode()) or \
        key == "vllm_steer_token"  # any "vllm_steer... key is ours
    assert not request_body._MARKERS.search(f'{big}}}'.encode())


def test_packed_blocks_in_another_dtype_take_the_fast_path_and_equal_the_float32_path():
    """Packed vectors in another dtype than the model's (float32 for a bfloat16 model, the numpy default; float16;
    bfloat16 for a float16 model) go straight to table layout (``spec.parse_packed_fast``) with the layout and key
    the general float32 path gives the same request: zero rows dropped, layers sorted, -0.0 as 0.0, rounded to
    the model dtype, values that overflow it or NaN / Inf left to the general path, which refuses them naming the
    field. The same block again is not converted again (``layout.CHECKED``)."""
    from vllm_steer.core import layout
    from vllm_steer.core.layout import layout_key
    from vllm_steer.core.vectors import effective_phases
    from vllm_steer.frontend.spec import ModelShape, SteeringSpecError, parse_packed_fast, parse_spec

    rng, pick = np.random.default_rng(21), random.Random(21)
    converted = {"calls": 0}
    real = layout.to_dtype_bytes

    def counting(*a):
        converted["calls"] += 1
        return real(*a)

    layout.to_dtype_bytes = counting
    checked = 0
    try:
        for trial in range(300):
            model, d = pick.choice(["bfloat16", "float16"]), pick.choice([4, 16])
            shape = ModelShape(num_layers=12, hidden_size=d, hooks=HOOKS, layers=None, max_bytes=1 << 20, dtype=model)
            tier = pick.choice(["steering_vectors", "prefill_steering_vectors", "decode_steering_vectors"])
            fields = {tier: {}}
            for hook in pick.sample(HOOKS, pick.randint(1, 3)):
                src = pick.choice(["float32", "float16", "bfloat16"])
                n = pick.randint(1, 5)
                values = (rng.standard_normal((n, d)) * pick.choice([1.0, 1e-3, 1e-41, 7e4, 3.3e38])).astype(np.float32)
                for _ in range(pick.randint(0, 3)):
                    values[pick.randrange(n), pick.choice([pick.randrange(d), slice(None)])] = pick.choice(
                        [0.0, -0.0, np.inf, np.nan, -1e-45])
                fields[tier][hook] = pack(values, pick.sample(range(12), n), src)
            try:
                fast = parse_packed_fast(fields, shape)
            except SteeringSpecError:  # a block in the model's dtype is refused on the fast path itself
                fast = "refused"
            try:
                spec = parse_spec(fields, shape)
                prefill, decode = effective_phases(spec.tiers)
                general = {"prefill": table_layout(prefill, model), "decode": table_layout(decode, model)}
            except (SteeringSpecError, ValueError):
                general = "refused"
            if general == "refused":
                assert fast is None or fast == "refused", trial
                continue
            assert fast is not None, trial
            got_tier, got_layout, got_key = fast
            phase = {"steering_vectors": "prefill", "prefill_steering_vectors": "prefill",
                     "decode_steering_vectors": "decode"}[got_tier]
            assert got_layout == general[phase], trial
            assert got_key == layout_key(general[phase], model), trial
            assert parse_packed_fast(fields, shape) == fast  # the same blocks again: now remembered
            before = converted["calls"]
            assert parse_packed_fast(fields, shape) == fast and converted["calls"] == before  # not converted again
            if any(f["dtype"] != model for f in fields[tier].values()):
                checked += 1
    finally:
        layout.to_dtype_bytes = real
    assert checked > 30  # trials that converted a block and were not refused
