"""The one payload struct (core/payload.py) and the RPC table (core/rpc.py), without an engine: every field
survives the trip as the engine core and the workers decode it, anything else under the payload key is
refused with a clear error, and each RPC name is answered by the one process the table names."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from vllm import SamplingParams
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_steer.core.payload import (PAYLOAD_KEY, ROWS_KEY, SIDE_BYTES, ModuleRef, PayloadError, SteerPayload,
                                     decode_payload, encode_payload, encode_split, payload_of, request_payload)
from vllm_steer.core.rpc import (ENGINE_CORE, METHODS, WORKER, ForgetModules, RegisterModule, RpcArgsError, call_args,
                                 methods_of, parse_args)

ROWS = np.arange(2 * 8, dtype=np.float32).tobytes()


def _every_field() -> SteerPayload:
    """A payload with no field at its default (checked below, so a new field must be added here)."""
    return SteerPayload(
        prefill="kp", decode="kd",
        configs={"kp": {"post_mlp": ((1, 3), ROWS)}, "kd": {}},
        module=ModuleRef("m", 7, 0.5, layers=(1, 3), hooks=("post_mlp",)),
        capture={"probe": {"sites": ["post_mlp.1"]}},
        sae={"kd": [("gs", "post_mlp", 3, 1, b"\1\0\0\0", b"\2\0\0\0", b"\0\0\0@")]},
        condition={"kd": ("post_mlp", 2, 0.5, 4.0, 1, np.ones(8, np.float32).tobytes(), 2)},
        stop_when=(0.25, 2, True), sae_versions={"gs": 11}, external_id="cmpl-1", capture_reply="tcp://h:1",
        projections={"kd": [("post_mlp", 3, np.ones(8, np.float32).tobytes(), np.zeros(2, np.float32).tobytes())]},
        capture_rows=(30, 31, 2))


def test_every_field_round_trips_through_vllms_own_transport():
    payload = _every_field()
    defaults = SteerPayload()
    unset = [f for f in payload.__struct_fields__ if getattr(payload, f) == getattr(defaults, f)]
    assert unset == [], f"give these fields a value in _every_field: {unset}"
    # what the API process sends: SamplingParams cloned, then vLLM's msgpack to the engine core
    params = SamplingParams(max_tokens=4, extra_args={PAYLOAD_KEY: encode_payload(payload)}).clone()
    arrived = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))
    got = payload_of(arrived)
    assert got == payload and got.keys == ("kp", "kd") and got.steered
    assert np.array_equal(np.frombuffer(got.configs["kp"]["post_mlp"][1], np.float32), np.frombuffer(ROWS, np.float32))
    assert got.rows_of("kd") == {} and got.rows_of("other") is None
    assert got.module.layers == (1, 3) and got.stop_when == (0.25, 2, True) and got.condition["kd"][6] == 2
    assert np.frombuffer(got.projections["kd"][0][2], np.float32).tolist() == [1.0] * 8
    assert got.capture_rows == (30, 31, 2)


def test_large_rows_travel_beside_the_payload_uncopied_and_arrive_as_sent():
    """Rows of SIDE_BYTES or more leave the payload bytes for extra_args[ROWS_KEY] as the very objects the front end
    made (vLLM's encode is their one copy); small ones stay inside; a missing or short side list is refused."""
    rng = np.random.default_rng(0)
    big, other = rng.bytes(SIDE_BYTES), rng.bytes(2 * SIDE_BYTES)
    payload = SteerPayload(prefill="kp", decode="kd", configs={
        "kp": {"pre_attn": ((0, 1), big), "post_mlp": ((1, 3), ROWS)}, "kd": {"post_mlp": ((2,), other)}})
    raw, side = encode_split(payload)
    assert side[0] is big and side[1] is other and len(side) == 2 and len(raw) < len(ROWS) + 200
    assert encode_split(SteerPayload("k", "k", {"k": {"post_mlp": ((1, 3), ROWS)}})) == \
        (encode_payload(SteerPayload("k", "k", {"k": {"post_mlp": ((1, 3), ROWS)}})), None)
    params = SamplingParams(max_tokens=4, extra_args={PAYLOAD_KEY: raw, ROWS_KEY: side}).clone()
    arrived = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))
    got = payload_of(arrived)
    assert got == payload and bytes(got.configs["kd"]["post_mlp"][1]) == other
    for extra, words in (({PAYLOAD_KEY: raw}, "NoneType, not their list"),
                         ({PAYLOAD_KEY: raw, ROWS_KEY: side[:1]}, "row block 1 of kd.post_mlp is not in"),
                         ({PAYLOAD_KEY: raw, ROWS_KEY: [big, 5]}, "row block 1 of kd.post_mlp is not in")):
        with pytest.raises(PayloadError, match=words):
            payload_of(SimpleNamespace(extra_args=extra))


def test_unset_fields_cost_nothing_and_read_as_their_defaults():
    plain = SteerPayload(capture={})
    assert decode_payload(encode_payload(plain)) == plain and not plain.steered and plain.keys == ()
    assert len(encode_payload(plain)) < len(encode_payload(SteerPayload(capture={}, external_id="x"))) < 40


@pytest.mark.parametrize("raw, words", [
    ({"prefill": "k", "decode": "k"}, "expected the bytes of encode_payload, got dict"),
    (b"\xc1\x00", "garbled"),
    (msgspec.msgpack.encode(["vllm-steer/2", "k", "k"]), "not a vllm-steer/3 payload: Invalid value 'vllm-steer/2'"),
    (msgspec.msgpack.encode(["vllm-steer/3", 5]), "Expected `str | null`, got `int`"),
    (msgspec.msgpack.encode(["vllm-steer/3", "k", "k", {}] + [None] * 10 + ["a field this version lacks"]),
     "Expected `array` of at most length"),
])
def test_an_unknown_or_garbled_payload_is_refused_with_a_clear_error(raw, words):
    with pytest.raises(PayloadError) as e:
        payload_of(SimpleNamespace(extra_args={PAYLOAD_KEY: raw}))
    assert words in str(e.value), str(e.value)


def test_a_request_decodes_its_payload_once_and_a_bad_one_once():
    calls = []

    class Params:
        @property
        def extra_args(self):
            calls.append(1)
            return {PAYLOAD_KEY: encode_payload(SteerPayload("k", "k"))}

    request = SimpleNamespace(sampling_params=Params())
    assert request_payload(request).keys == ("k",) and request_payload(request).keys == ("k",) and len(calls) == 1
    bad = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={PAYLOAD_KEY: b"\xc1"}))
    with pytest.raises(PayloadError):
        request_payload(bad)
    assert request_payload(bad) is None  # the scheduler refused it; later readers skip it
    assert request_payload(SimpleNamespace(sampling_params=None)) is None


def test_each_rpc_has_one_answering_process_and_its_handlers_cover_the_table():
    from vllm_steer.engine.module_rpc import HANDLERS as ENGINE_HANDLERS
    from vllm_steer.runtime.worker_rpc import WORKER_METHODS

    assert set(ENGINE_HANDLERS) == methods_of(ENGINE_CORE) and set(WORKER_METHODS) == methods_of(WORKER)
    assert methods_of(ENGINE_CORE) | methods_of(WORKER) == set(METHODS)
    assert not methods_of(ENGINE_CORE) & methods_of(WORKER)


def test_rpc_args_travel_as_the_positional_tuple_and_are_checked_on_arrival():
    args = RegisterModule("m", 3, {"base": {}}, ["k"], {"replace": True})
    assert call_args(args) == ("m", 3, {"base": {}}, ["k"], {"replace": True})
    assert parse_args("vllm_steer_register_module", call_args(args)) == args
    assert parse_args("vllm_steer_register_module", ["m", 3, {}, []]).policy == {}
    assert parse_args("vllm_steer_forget_modules", ([["m", 3]],)) == ForgetModules([("m", 3)])
    with pytest.raises(RpcArgsError) as e:
        parse_args("vllm_steer_unregister_module", (7,))
    assert "vllm_steer_unregister_module: arguments do not fit Name: Expected `str`, got `int`" in str(e.value)
    with pytest.raises(RpcArgsError, match="at most length"):
        parse_args("vllm_steer_capture_publish", (["a"], "extra"))


def test_the_engine_core_answers_its_methods_and_forwards_every_other_name(monkeypatch):
    """The patched ``EngineCore.collective_rpc`` with a stand-in for vLLM's: one lookup, typed args."""
    from vllm.v1.engine.core import EngineCore

    from vllm_steer.engine import module_rpc

    seen = []
    monkeypatch.setattr(EngineCore, "collective_rpc", lambda self, method, timeout=None, args=(), kwargs=None:
                        seen.append((method, tuple(args))) or [f"worker:{method}"])
    module_rpc.patch_engine_core_rpc()
    payload = SteerPayload("k", "k", module=ModuleRef("m", 1, 1.0), sae={"k": [("s", "post_mlp", 2, 1, b"", b"", b"")]},
                           sae_versions={"s": 1})  # a runtime SAE: its site counts as in use
    request = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={PAYLOAD_KEY: encode_payload(payload)}))
    core = SimpleNamespace(scheduler=SimpleNamespace(steer_gate=object(), requests={"r": request}))
    assert EngineCore.collective_rpc(core, "vllm_steer_module_users") == [{"m": 1}]
    assert EngineCore.collective_rpc(core, "vllm_steer_sae_users") == [{"names": {"s": 1}, "sites": {"post_mlp.2": 1}}]
    assert EngineCore.collective_rpc(core, "vllm_steer_status") == ["worker:vllm_steer_status"]
    assert EngineCore.collective_rpc(core, "vllm_steer_capture_publish", args=(["r"],)) == ["worker:vllm_steer_capture_publish"]
    assert seen == [("vllm_steer_status", ()), ("vllm_steer_capture_publish", (["r"],))]
    with pytest.raises(RpcArgsError):
        EngineCore.collective_rpc(core, "vllm_steer_unregister_sae", args=(1,))
