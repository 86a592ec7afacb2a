"""Request spec parsing, tier resolution and the config hash (no engine)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from vllm_steer.core.layout import config_hash as _config_hash
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.vectors import merge, nonzero
from vllm_steer.frontend.spec import ModelShape, parse_spec

def config_hash(vectors, dtype="float32"):
    return _config_hash(vectors, dtype)


SHAPE = ModelShape(num_layers=4, hidden_size=8, hooks=("pre_attn", "post_attn", "post_mlp"), layers=None, max_bytes=1 << 20)


def packed(arr: np.ndarray, layers, dtype="float32", **extra) -> dict:
    if dtype == "bfloat16":
        raw = torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    else:
        raw = arr.astype(dtype).tobytes()
    return {"dtype": dtype, "shape": list(arr.shape), "layer_indices": list(layers), "data": base64.b64encode(raw).decode(), **extra}


def test_floats_and_packed_in_any_exact_dtype_hash_identically():
    arr = np.array([[0.5, -1.0, 2.0, 0.0, 0.25, 3.0, -0.125, 1.5], [1, 2, 3, 4, 5, 6, 7, 8]], dtype=np.float32)
    as_floats = parse_spec({"steering_vectors": {"post_mlp": {"1": arr[0].tolist(), 3: arr[1].tolist()}}}, SHAPE)
    keys = {config_hash(as_floats.tiers["steering_vectors"])}
    for dt in ("float32", "float16", "bfloat16"):
        spec = parse_spec({"steering_vectors": {"post_mlp": packed(arr, [1, 3], dt)}}, SHAPE)
        keys.add(config_hash(spec.tiers["steering_vectors"]))
    assert len(keys) == 1 and None not in keys


def test_hash_separates_hooks_layers_and_values():
    v = np.ones(8, dtype=np.float32)
    hashes = {
        config_hash({"post_mlp": {1: v}}),
        config_hash({"post_attn": {1: v}}),
        config_hash({"post_mlp": {2: v}}),
        config_hash({"post_mlp": {1: v * 2}}),
    }
    assert len(hashes) == 4
    assert config_hash({}) is None


def test_packed_wins_over_layer_keys_beside_it():
    arr = np.full((1, 8), 2.0, dtype=np.float32)
    obj = packed(arr, [0])
    obj["0"] = [9.0] * 8
    spec = parse_spec({"steering_vectors": {"pre_attn": obj}}, SHAPE)
    np.testing.assert_array_equal(spec.tiers["steering_vectors"]["pre_attn"][0], arr[0])


def test_scales_multiply_rows_in_source_dtype():
    arr = np.ones((2, 8), dtype=np.float16)
    spec = parse_spec({"steering_vectors": {"post_mlp": packed(arr, [0, 2], "float16", scales=[2.0, -0.5])}}, SHAPE)
    got = spec.tiers["steering_vectors"]["post_mlp"]
    np.testing.assert_array_equal(got[0], np.full(8, 2.0, np.float32))
    np.testing.assert_array_equal(got[2], np.full(8, -0.5, np.float32))


def test_effective_vector_is_base_plus_phase_tier_and_zero_is_unsteered():
    one = np.ones(8, dtype=np.float32)
    base = {"post_mlp": {1: one}}
    decode = {"post_mlp": {1: -one}, "pre_attn": {0: one}}
    eff = nonzero(merge(base, decode))
    assert set(eff) == {"pre_attn"}  # base + (-base) cancels to nothing at post_mlp
    assert config_hash(nonzero(merge(base, {}))) == config_hash(base)


BAD = [
    ({"steering_vectors": {"mid_mlp": {"0": [0.0] * 8}}}, "steering_vectors.mid_mlp", "unknown hook"),
    ({"steering_vectors": {"post_mlp": {"9": [0.0] * 8}}}, "steering_vectors.post_mlp.9", "out of range"),
    ({"steering_vectors": {"post_mlp": {"x": [0.0] * 8}}}, "steering_vectors.post_mlp.x", "integer"),
    ({"steering_vectors": {"post_mlp": {"0": [0.0] * 7}}}, "steering_vectors.post_mlp.0", "hidden size"),
    ({"steering_vectors": {"post_mlp": {"0": [float("nan")] * 8}}}, "steering_vectors.post_mlp.0", "NaN"),
    ({"decode_steering_vectors": {"post_mlp": {"0": ["a"] * 8}}}, "decode_steering_vectors.post_mlp.0", "numbers"),
    ({"steering_vectors": {"post_mlp": {**packed(np.zeros((1, 8)), [0]), "dtype": "int8"}}}, "steering_vectors.post_mlp.dtype", "unknown dtype"),
    ({"steering_vectors": {"post_mlp": {**packed(np.zeros((1, 8)), [0]), "data": "!!!"}}}, "steering_vectors.post_mlp.data", "base64"),
    ({"steering_vectors": {"post_mlp": {**packed(np.zeros((1, 8)), [0]), "shape": [2, 8]}}}, "steering_vectors.post_mlp.layer_indices", "2 layer indices"),
    ({"steering_vectors": {"post_mlp": {**packed(np.zeros((2, 8)), [0, 1]), "data": base64.b64encode(b"\0" * 12).decode()}}}, "steering_vectors.post_mlp.data", "needs 64"),
    ({"steering_vectors": {"post_mlp": packed(np.zeros((1, 8)), [0], scales=[1.0, 2.0])}}, "steering_vectors.post_mlp.scales", "expected 1 scales"),
    ({"steering_vectors": {"post_mlp": packed(np.zeros((1, 4)), [0])}}, "steering_vectors.post_mlp.shape", "hidden size 4"),
    ({"steering_vectors": {"post_mlp": packed(np.full((1, 8), np.inf), [0])}}, "steering_vectors.post_mlp.data", "NaN or Inf"),
    ({"steering_module": {"name": 3}}, "steering_module", "name"),
    ({"steering_module": {"name": "m", "scale": "big"}}, "steering_module.scale", "finite number"),
]


@pytest.mark.parametrize("fields, field, words", BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_bad_input_names_the_field(fields, field, words):
    with pytest.raises(SteeringSpecError) as e:
        parse_spec(fields, SHAPE)
    assert e.value.field == field
    assert words in str(e.value)


def test_payload_over_byte_cap_is_refused():
    small = ModelShape(4, 8, SHAPE.hooks, None, max_bytes=16)
    with pytest.raises(SteeringSpecError, match="exceeds the server's cap of 16"):
        parse_spec({"steering_vectors": {"post_mlp": packed(np.zeros((1, 8)), [0])}}, small)


def test_disabled_hook_and_unsteerable_layer_are_refused():
    narrow = ModelShape(4, 8, ("post_mlp",), frozenset({1}), 1 << 20)
    with pytest.raises(SteeringSpecError, match="not enabled on this server"):
        parse_spec({"steering_vectors": {"pre_attn": {"1": [0.0] * 8}}}, narrow)
    with pytest.raises(SteeringSpecError, match="not steerable"):
        parse_spec({"steering_vectors": {"post_mlp": {"2": [0.0] * 8}}}, narrow)


def test_numpy_bf16_rounding_matches_torch_and_client_pack_roundtrips():
    from vllm_steer.core import bf16
    from vllm_steer.client import pack

    vals = np.random.default_rng(1).standard_normal(4096).astype(np.float32) * 1000
    vals[:6] = [0.0, -0.0, 1e-40, 3.0e38, np.inf, -np.inf]
    want = torch.from_numpy(vals).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16.numpy_to_bits(vals), want)  # the client's path (no torch)
    np.testing.assert_array_equal(bf16.to_bits(vals), want)  # torch's cast where torch is loaded
    np.testing.assert_array_equal(bf16.to_bits(vals[:100]), want[:100])  # a small array: numpy's
    got = parse_spec({"steering_vectors": {"post_mlp": pack(vals[8:16][None], [2], "bfloat16")}}, SHAPE)
    np.testing.assert_array_equal(got.tiers["steering_vectors"]["post_mlp"][2], bf16.round_to_bf16(vals[8:16]))
    torch_scaled = (torch.from_numpy(vals[8:16]).to(torch.bfloat16) * torch.tensor(0.3, dtype=torch.bfloat16)).float().numpy()
    scaled = parse_spec({"steering_vectors": {"post_mlp": pack(vals[8:16][None], [2], "bfloat16", scales=[0.3])}}, SHAPE)
    np.testing.assert_array_equal(scaled.tiers["steering_vectors"]["post_mlp"][2], torch_scaled)


def _frontend(dtype=torch.bfloat16, layers=4, hidden=8, **steer):
    from types import SimpleNamespace

    from vllm_steer.frontend.prepare import SteeringFrontend

    mc = SimpleNamespace(dtype=dtype, hf_text_config=SimpleNamespace(num_hidden_layers=layers),
                         get_hidden_size=lambda: hidden)
    return SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": steer}))


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_packed_in_the_model_dtype_takes_the_byte_path_to_the_same_key_and_rows(model_dtype):
    """Rows sent packed in the model dtype are keyed and shipped as they came (no float32 round
    trip), and give exactly the key and bytes of the general path: floats, unsorted layers, zero
    rows and -0.0 included."""
    from vllm_steer.client import pack
    name = str(model_dtype).split(".")[-1]
    fe = _frontend(model_dtype)
    rng = np.random.default_rng(3)
    rows = torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32)).to(model_dtype).float().numpy()
    rows[1] = 0.0  # an all-zero row: no steering at that layer
    rows[2, :3] = -0.0
    packed_field = {"post_mlp": pack(rows, [3, 0, 2], name), "pre_attn": pack(rows[:1], [1], name)}
    floats_field = {"post_mlp": {"3": rows[0].tolist(), "0": rows[1].tolist(), "2": (rows[2] + np.float32(0)).tolist()},
                    "pre_attn": {"1": rows[0].tolist()}}
    fast, slow = (fe.engine_extra_args({"steering_vectors": f}) for f in (packed_field, floats_field))
    (pk_fast, dk_fast), (pk_slow, dk_slow) = fast[2:4], slow[2:4]
    assert pk_fast == dk_fast == pk_slow == dk_slow is not None
    assert fast.payload.configs == slow.payload.configs
    (layout,) = fast.payload.configs.values()
    assert [(h, ids) for h, (ids, _) in layout.items()] == [("pre_attn", (1,)), ("post_mlp", (2, 3))]
    _, _, pk, dk, _ = fe.engine_extra_args({"prefill_steering_vectors": packed_field})
    assert (pk, dk) == (pk_fast, None)


def test_byte_path_refuses_bad_rows_naming_the_field():
    from vllm_steer.client import pack

    fe = _frontend(torch.bfloat16, max_request_bytes=40)
    bad = np.zeros((1, 8), dtype=np.float32)
    bad[0, 5] = np.nan
    with pytest.raises(SteeringSpecError) as e:
        fe.engine_extra_args({"steering_vectors": {"post_mlp": pack(bad, [1], "bfloat16")}})
    assert e.value.field == "steering_vectors.post_mlp.data" and "NaN or Inf" in str(e.value)
    two = np.ones((2, 8), dtype=np.float32)
    with pytest.raises(SteeringSpecError, match="exceeds the server's cap of 40"):
        fe.engine_extra_args({"steering_vectors": {"post_mlp": pack(two, [1, 2], "bfloat16"),
                                                   "pre_attn": pack(two, [1, 2], "bfloat16")}})
    with pytest.raises(SteeringSpecError) as e:
        fe.engine_extra_args({"steering_vectors": {"mid": pack(two, [1, 2], "bfloat16")}})
    assert e.value.field == "steering_vectors.mid"
    zero, _, pk, dk, _ = fe.engine_extra_args({"steering_vectors": {"post_mlp": pack(np.zeros((1, 8)), [1], "bfloat16")}})
    assert zero is None and pk is dk is None  # all-zero vectors are no steering at all


def test_steering_fields_refuse_nesting_past_the_limit_and_pass_long_flat_lists():
    """The body's steering fields are walked for depth before anything parses them: a value nested past
    MAX_NESTING is a 400 naming the field (top level or inside vllm_xargs); a 4096-float probe is one level."""
    from vllm_steer.server.openai_fields import MAX_NESTING, steering_fields

    deep: list = [0.0]
    for _ in range(MAX_NESTING + 2):
        deep = [1.0, deep]
    for body in ({"steering_condition": {"probe": deep}},
                 {"vllm_xargs": {"steering_condition": __import__("json").dumps({"probe": deep})}}):
        with pytest.raises(SteeringSpecError) as e:
            steering_fields(body)
        assert "nested deeper" in str(e.value) and e.value.field.endswith("steering_condition")
    flat = {"site": "post_mlp.3", "probe": [0.5] * 4096, "stop_when": {"above": 0.5}}
    assert steering_fields({"steering_condition": flat, "prompt": "x"}) == {"steering_condition": flat}
