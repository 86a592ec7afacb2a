"""The fused-norm rule on small layer classes: what fits gets its norms (also through subclasses, whatever the
norms are called), what does not is refused naming what was not found, and each hook folds into the norm
that receives it."""

from __future__ import annotations

from dataclasses import astuple

import pytest
import torch.nn as nn

from vllm_steer.runtime.families import UnsupportedModelError, layer_norms, structure
from vllm_steer.runtime.install import find_decoder_layers


@pytest.fixture(scope="module")
def rms():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        yield lambda: RMSNorm(8, eps=1e-6)


class LlamaLike(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.self_attn, self.mlp = nn.Identity(), nn.Identity()

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MyFancyLayer(LlamaLike):
    pass


class SandwichLike(nn.Module):
    """Gemma2/3's shape, with other names: the branch is normalized, then added by the second fused norm."""

    def __init__(self, norm):
        super().__init__()
        self.attention_norm, self.branch_norm, self.ffn_norm = norm(), norm(), norm()
        self.attention, self.feed_forward = nn.Identity(), nn.Identity()

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.attention_norm(hidden_states)
        else:
            hidden_states, residual = self.attention_norm(hidden_states, residual)
        hidden_states = self.branch_norm(self.attention(hidden_states))
        hidden_states, residual = self.ffn_norm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual


class Unfused(LlamaLike):  # Granite's shape: the adds are the layer's own
    def forward(self, positions, hidden_states):
        residual = hidden_states
        hidden_states = residual + self.self_attn(self.input_layernorm(hidden_states)) * 0.5
        return hidden_states


class ScalesResidual(LlamaLike):  # DeepSeek-V2's float16 guard
    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        residual *= 0.5
        hidden_states, residual = self.post_attention_layernorm(self.self_attn(hidden_states), residual)
        return self.mlp(hidden_states), residual


class Parallel(LlamaLike):  # one norm feeds attention and MLP
    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return self.self_attn(hidden_states) + self.mlp(hidden_states), residual


class LayerNormLike(LlamaLike):
    def __init__(self, norm):
        super().__init__(lambda: nn.LayerNorm(8))


class Model(nn.Module):
    def forward(self, positions, hidden_states):
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class SkipModel(Model):  # Solar's shape: the stream changes between layers
    def forward(self, positions, hidden_states):
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
            residual = residual * 0.5
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class PPMissingLayer(nn.Module):
    pass


def _model(layers, inner=Model):
    m = nn.Module()
    m.model = inner()
    m.model.layers = nn.ModuleList(layers)
    return m


def test_the_rule_finds_the_fused_norms_whatever_their_names(rms):
    assert structure(LlamaLike) == structure(MyFancyLayer)
    assert astuple(layer_norms(MyFancyLayer(rms))) == ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    assert astuple(layer_norms(SandwichLike(rms))) == ("attention_norm", "ffn_norm", "attention", "feed_forward")
    assert [i for i, _ in find_decoder_layers(_model([MyFancyLayer(rms), LlamaLike(rms)]))] == [0, 1]


@pytest.mark.parametrize("layer, why", [
    (Unfused, "Unfused.forward takes no residual: its residual adds are not fused into norms"),
    (ScalesResidual, "ScalesResidual.forward line 3 reads or writes the residual outside a fused norm: residual *= 0.5"),
    (Parallel, "Parallel.forward calls 1 fused norm(s) (input_layernorm), not 2"),
    (LayerNormLike, "its fused norm input_layernorm is torch.nn.modules.normalization.LayerNorm, not vLLM's RMSNorm"),
])
def test_what_does_not_fit_is_refused_naming_what_was_not_found(rms, layer, why):
    with pytest.raises(UnsupportedModelError, match=f"cannot steer decoder layer {layer.__name__}: ") as e:
        find_decoder_layers(_model([layer(rms), layer(rms)]))
    assert why in str(e.value)


def test_a_model_that_changes_the_stream_between_layers_or_has_no_layers_is_refused(rms):
    with pytest.raises(UnsupportedModelError, match="SkipModel.forward line 5 changes the stream between layers: "
                                                    "residual = residual \\* 0.5"):
        find_decoder_layers(_model([LlamaLike(rms)], SkipModel))
    with pytest.raises(UnsupportedModelError, match="cannot find decoder layers"):
        find_decoder_layers(nn.Module())


def _sites(model, wanted):
    from vllm_steer.runtime.install import norm_sites

    return {s.name: (s.a, s.b) for s in norm_sites(model, wanted)}


ALL = {(h, l) for h in ("pre_attn", "post_attn", "post_mlp") for l in range(3)}


def test_each_hook_folds_into_the_norm_that_receives_it(rms):
    m = _model([LlamaLike(rms) for _ in range(3)])
    m.model.norm = rms()
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


def test_sandwich_post_attn_is_the_second_fused_norm_and_pp_ranks_fold_their_neighbours(rms):
    # a later pipeline rank: layer 0 lives elsewhere, and so does the final norm
    m = _model([PPMissingLayer(), SandwichLike(rms), SandwichLike(rms)])
    m.model.norm = PPMissingLayer()
    got = _sites(m, ALL)
    assert got["layers.1.attention_norm"] == (("post_mlp", 0), ("pre_attn", 1))  # rank 0's last post_mlp
    assert got["layers.1.ffn_norm"] == (("post_attn", 1), None)
    assert "norm" not in got and not any("branch_norm" in k for k in got)
