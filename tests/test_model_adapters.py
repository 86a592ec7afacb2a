"""Model-family adapters: supported layers resolve (also through subclasses), others fail clearly."""

from __future__ import annotations

import pytest
import torch.nn as nn

from vllm_steer.hooks import HookPoint
from vllm_steer.models import UnsupportedModelError, adapter_for_layer
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


def test_every_family_places_all_three_hooks():
    from vllm_steer.models import _BY_LAYER_CLASS

    for adapter in _BY_LAYER_CLASS.values():
        assert set(adapter.sites) == set(HookPoint)
