"""Model-family adapters: supported layers resolve (also through subclasses), others fail clearly."""

from __future__ import annotations

import pytest
import torch.nn as nn

from vllm_steer.runtime.families import UnsupportedModelError, adapter_for_layer
from vllm_steer.runtime.install import find_decoder_layers


class LlamaDecoderLayer(nn.Module):
    pass


class MyFancyDecoderLayer(LlamaDecoderLayer):
    pass


class GPTJBlock(nn.Module):
    pass


def _model(layer_cls):
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList([layer_cls(), layer_cls()])
    return m


def test_adapter_found_through_subclass():
    assert adapter_for_layer(MyFancyDecoderLayer()).name == "llama"
    assert [i for i, _ in find_decoder_layers(_model(MyFancyDecoderLayer))] == [0, 1]


def test_unsupported_architecture_gets_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="no adapter for decoder layer GPTJBlock; supported: "):
        find_decoder_layers(_model(GPTJBlock))
    bare = nn.Module()
    with pytest.raises(UnsupportedModelError, match="cannot find decoder layers"):
        find_decoder_layers(bare)


class Gemma2DecoderLayer(nn.Module):
    pass


class PPMissingLayer(nn.Module):
    pass


def _norms(layer: nn.Module) -> nn.Module:
    for attr in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
        setattr(layer, attr, nn.Identity())
    return layer


def _sites(model, wanted):
    from vllm_steer.runtime.install import norm_sites

    return {s.name: (s.a, s.b) for s in norm_sites(model, wanted)}


ALL = {(h, l) for h in ("pre_attn", "post_attn", "post_mlp") for l in range(3)}


def test_each_hook_folds_into_the_norm_that_receives_it():
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList([_norms(LlamaDecoderLayer()) for _ in range(3)])
    m.model.norm = nn.Identity()
    assert _sites(m, ALL) == {
        "layers.0.input_layernorm": (None, ("pre_attn", 0)),
        "layers.0.post_attention_layernorm": (("post_attn", 0), None),
        "layers.1.input_layernorm": (("post_mlp", 0), ("pre_attn", 1)),
        "layers.1.post_attention_layernorm": (("post_attn", 1), None),
        "layers.2.input_layernorm": (("post_mlp", 1), ("pre_attn", 2)),
        "layers.2.post_attention_layernorm": (("post_attn", 2), None),
        "norm": (("post_mlp", 2), None),
    }
    # only what the config asks for; norms that receive nothing stay vLLM's
    assert _sites(m, {("post_mlp", 1), ("post_attn", 2)}) == {
        "layers.2.input_layernorm": (("post_mlp", 1), None),
        "layers.2.post_attention_layernorm": (("post_attn", 2), None),
    }


def test_gemma_post_attn_is_the_pre_feedforward_norm_and_pp_ranks_fold_their_neighbours():
    m = nn.Module()
    m.model = nn.Module()
    # a later pipeline rank: layer 0 lives elsewhere, and so does the final norm
    m.model.layers = nn.ModuleList([PPMissingLayer(), _norms(Gemma2DecoderLayer()), _norms(Gemma2DecoderLayer())])
    m.model.norm = PPMissingLayer()
    got = _sites(m, ALL)
    assert got["layers.1.input_layernorm"] == (("post_mlp", 0), ("pre_attn", 1))  # rank 0's last post_mlp
    assert got["layers.1.pre_feedforward_layernorm"] == (("post_attn", 1), None)
    assert "norm" not in got and not any("post_attention" in k for k in got)
