"""A request naming a module ships only the reference to the engine: measured on the bytes vLLM's
own msgpack encoder produces for the request's SamplingParams (what crosses the process boundary)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.serial_utils import MsgpackEncoder

from vllm_steer.frontend.prepare import SteeringFrontend
from vllm_steer.frontend.prepared import for_request
from vllm_steer.frontend.module_registration import module_from_json
from vllm_steer.frontend.module_store import STORE

LAYERS, HIDDEN = 34, 2560


def _frontend() -> SteeringFrontend:
    mc = SimpleNamespace(dtype=torch.bfloat16, hf_text_config=SimpleNamespace(num_hidden_layers=LAYERS),
                         get_hidden_size=lambda: HIDDEN)
    return SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": {}}))


def _wire_bytes(extra_args) -> int:
    return sum(len(b) for b in MsgpackEncoder().encode(SamplingParams(max_tokens=8, extra_args=extra_args)))


def test_module_reference_ships_a_few_hundred_bytes_inline_ships_the_vectors():
    fe = _frontend()
    rng = np.random.default_rng(0)
    vectors = {h: {str(l): rng.standard_normal(HIDDEN).astype(np.float32).tolist() for l in range(LAYERS)}
               for h in ("pre_attn", "post_attn", "post_mlp")}
    module = module_from_json({"name": "bytes-test", "steering_vectors": vectors}, fe.shape)
    module.version = STORE.next_version()
    STORE.publish(module)
    try:
        inline, by_ref = (for_request(fe.engine_extra_args(f), {}, "r") for f in (
            {"steering_vectors": vectors}, {"steering_module": {"name": "bytes-test", "scale": 1.0}}))
        pk_i, pk_m = inline.prefill_key, by_ref.prefill_key
    finally:
        STORE.drop("bytes-test")
    assert pk_i == pk_m  # the same config either way
    inline_bytes, ref_bytes = _wire_bytes(inline.extra_args), _wire_bytes(by_ref.extra_args)
    assert inline_bytes > LAYERS * HIDDEN * 3 * 2  # every vector, in bf16
    assert ref_bytes < 600, ref_bytes
