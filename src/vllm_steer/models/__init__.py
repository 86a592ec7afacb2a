"""Model-family adapters: where pre_attn / post_attn / post_mlp sit in each supported decoder layer.

Each family names, per hook point, where in a decoder layer the residual stream is reachable.
Nothing else lives here. See NOTES.md for the derivations.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_steer.hooks import HookPoint


@dataclass(frozen=True)
class HookSite:
    """Where a hook point's residual stream is reachable, as ``a + b`` (``b`` may be None).

    side:
      - ``"layer_input"``: the decoder layer's ``(hidden_states, residual)`` arguments (residual
        None on the first layer); steer by adding to ``residual`` (or ``hidden_states``).
      - ``"layer_output"``: the layer's returned ``(hidden_states, residual)``; steer ``hidden_states``.
      - ``"norm_input"``: a fused add+norm submodule called as ``norm(x, residual)``; steer ``x``.
    ``attr`` names the submodule for ``norm_input`` (empty for the layer itself).
    """

    attr: str
    side: str


@dataclass(frozen=True)
class FamilyAdapter:
    name: str
    sites: dict[HookPoint, HookSite]


# vLLM carries the residual separately; a layer takes and returns (h, residual) with
# stream = h + residual, and the next fused add+norm sums them. So pre_attn is the layer's input
# and post_mlp its output, for every family. post_attn is the input of the fused add+norm that
# adds the attention branch to the residual: post_attention_layernorm(attn_out, residual) in
# Llama-style layers; in Gemma2/3, which normalize the branch first, it is
# pre_feedforward_layernorm(post_attention_layernorm(attn_out), residual).
_LAYER_IN = HookSite("", "layer_input")
_LAYER_OUT = HookSite("", "layer_output")
LLAMA_STYLE = {
    HookPoint.PRE_ATTN: _LAYER_IN,
    HookPoint.POST_ATTN: HookSite("post_attention_layernorm", "norm_input"),
    HookPoint.POST_MLP: _LAYER_OUT,
}
GEMMA_STYLE = {
    HookPoint.PRE_ATTN: _LAYER_IN,
    HookPoint.POST_ATTN: HookSite("pre_feedforward_layernorm", "norm_input"),
    HookPoint.POST_MLP: _LAYER_OUT,
}

_BY_LAYER_CLASS: dict[str, FamilyAdapter] = {
    "LlamaDecoderLayer": FamilyAdapter("llama", LLAMA_STYLE),
    "MistralDecoderLayer": FamilyAdapter("mistral", LLAMA_STYLE),
    "Qwen2DecoderLayer": FamilyAdapter("qwen2", LLAMA_STYLE),
    "Qwen3DecoderLayer": FamilyAdapter("qwen3", LLAMA_STYLE),
    "Qwen3MoeDecoderLayer": FamilyAdapter("qwen3_moe", LLAMA_STYLE),
    "MixtralDecoderLayer": FamilyAdapter("mixtral", LLAMA_STYLE),
    "Gemma2DecoderLayer": FamilyAdapter("gemma2", GEMMA_STYLE),
    "Gemma3DecoderLayer": FamilyAdapter("gemma3", GEMMA_STYLE),
}

SUPPORTED_LAYER_CLASSES = tuple(sorted(_BY_LAYER_CLASS))


class UnsupportedModelError(RuntimeError):
    """Steering is enabled for a model whose decoder layers have no adapter."""


def adapter_for_layer(layer: object) -> FamilyAdapter:
    """The adapter of a decoder layer instance, matched on its class or first known base."""
    for cls in type(layer).__mro__:
        adapter = _BY_LAYER_CLASS.get(cls.__name__)
        if adapter is not None:
            return adapter
    raise UnsupportedModelError(
        f"vllm-steer has no adapter for decoder layer {type(layer).__name__}; "
        f"supported: {', '.join(SUPPORTED_LAYER_CLASSES)}"
    )
