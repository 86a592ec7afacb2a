"""Speculative decoding: capture and ``stop_when`` are refused clearly (``core.speculative``), steering is not.

A drafting engine's forward runs draft tokens the verifier may reject; capture would deliver a rejected draft's rows
as the request's own and ``stop_when`` would read its gate. A request asking for either gets a 400 naming the field;
a consumer whose global spec captures every request keeps the engine from starting (one line naming the consumer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_steer.core.config import SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.speculative import drafting

V = [0.5] * 8
NGRAM = SimpleNamespace(method="ngram", num_speculative_tokens=3)


def _frontend(spec=None, **steer):
    from vllm_steer.frontend.prepare import SteeringFrontend

    mc = SimpleNamespace(dtype=torch.float32, hf_text_config=SimpleNamespace(num_hidden_layers=8),
                         get_hidden_size=lambda: 8)
    return SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": steer},
                                            speculative_config=spec))


CAPTURE = {"capture": {"act": {"layers": [1], "hooks": ["post_mlp"], "positions": "all"}}}
STOP = {"steering_vectors": {"post_mlp": {"3": V}},
        "steering_condition": {"site": "post_mlp.2", "probe": V, "phase": "decode",
                               "stop_when": {"above": 0.5, "tokens": 2}}}


def test_drafting_says_how_the_engine_drafts():
    assert drafting(SimpleNamespace(speculative_config=None)) is None
    assert drafting(SimpleNamespace()) is None
    assert drafting(SimpleNamespace(speculative_config=NGRAM)) == "ngram, 3 tokens a step"


@pytest.mark.parametrize("fields, field", [(CAPTURE, "capture"), (STOP, "steering_condition.stop_when")])
def test_a_drafting_server_refuses_capture_and_stop_when_naming_the_field(fields, field):
    steer = {"capture": ["activations:instance=act"], "conditions": True}
    assert _frontend(None, **steer).resolve(dict(fields))[0] is not None  # not drafting: accepted
    with pytest.raises(SteeringSpecError) as e:
        _frontend(NGRAM, **steer).resolve(dict(fields))
    assert e.value.field == field
    assert "speculative decoding" in str(e.value) and "ngram, 3 tokens a step" in str(e.value)


def test_a_drafting_server_still_steers_and_gates():
    fe = _frontend(NGRAM, capture=["activations:instance=act"], conditions=True)
    payload, key, _ = fe.resolve({"steering_vectors": {"post_mlp": {"3": V}}})
    assert key is not None and payload.configs[key]
    gated = {**STOP, "steering_condition": {k: v for k, v in STOP["steering_condition"].items() if k != "stop_when"}}
    payload, _, dk = fe.resolve(gated)
    assert payload.condition and payload.stop_when is None and dk is not None


def test_a_global_capture_spec_keeps_a_drafting_engine_from_starting(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_steer.core.engine_config import patch_engine_config

    patch_engine_config()
    steer = {"capture": [{"name": "activations", "instance": "everything",
                          "params": {"global_spec": {"layers": [0], "hooks": ["post_mlp"], "positions": "last"}}}]}
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    args = dict(model=tiny_model("llama"), max_model_len=256, speculative_config=spec)
    with pytest.raises(SteerConfigError) as e:
        EngineArgs(**args, additional_config={"steer": steer}).create_engine_config()
    assert "steer.capture 'everything' (a global_spec)" in str(e.value) and "ngram, 2 tokens a step" in str(e.value)
    cfg = EngineArgs(**args, additional_config={"steer": {"capture": ["activations"]}}).create_engine_config()
    assert cfg.speculative_config.num_speculative_tokens == 2  # consumers asked per request: it starts
