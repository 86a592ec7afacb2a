"""Model-family adapters: where pre_attn / post_attn / post_mlp sit in each supported decoder layer.

Each family names, per hook point, the submodule of a decoder layer to wrap and on which side of
it the residual stream is reachable. Nothing else lives here. See NOTES.md for the derivations.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_steer.hooks import HookPoint


@dataclass(frozen=True)
class HookSite:
    """A submodule of the decoder layer and how to reach the residual stream through it.

    side:
      - ``"residual_in"``: a fused add+norm called as ``norm(x, residual)``; the stream is
        ``x + residual`` (or ``x`` alone when residual is None), steer by adding to ``residual``
        (or to ``x`` when residual is None), before the norm.
      - ``"input"``: the stream is ``submodule_input + residual``: add to the submodule's input.
      - ``"output"``: the stream is ``submodule_output + residual``: add to its output.
    """

    attr: str
    side: str


@dataclass(frozen=True)
class FamilyAdapter:
    name: str
    sites: dict[HookPoint, HookSite]


# vLLM carries the residual separately; a layer returns (h, residual) with stream = h + residual,
# and the next fused add+norm sums them. Llama-style layers (one norm before attn, one fused norm
# after it, then the MLP):
#   pre_attn  = layer input           -> before input_layernorm(x, residual)
#   post_attn = attn_out + residual    -> attn_out is post_attention_layernorm's first input
#   post_mlp  = mlp_out + residual     -> the MLP's output
LLAMA_STYLE = {
    HookPoint.PRE_ATTN: HookSite("input_layernorm", "residual_in"),
    HookPoint.POST_ATTN: HookSite("post_attention_layernorm", "input"),
    HookPoint.POST_MLP: HookSite("mlp", "output"),
}

# Gemma2/3 normalize each branch before the add: post_attention_layernorm(attn_out) is what is
# added to the residual (inside pre_feedforward_layernorm's fused add), and likewise
# post_feedforward_layernorm(mlp_out) for the layer output.
GEMMA_STYLE = {
    HookPoint.PRE_ATTN: HookSite("input_layernorm", "residual_in"),
    HookPoint.POST_ATTN: HookSite("post_attention_layernorm", "output"),
    HookPoint.POST_MLP: HookSite("post_feedforward_layernorm", "output"),
}

MIXTRAL_STYLE = {**LLAMA_STYLE, HookPoint.POST_MLP: HookSite("block_sparse_moe", "output")}

_BY_LAYER_CLASS: dict[str, FamilyAdapter] = {
    "LlamaDecoderLayer": FamilyAdapter("llama", LLAMA_STYLE),
    "MistralDecoderLayer": FamilyAdapter("mistral", LLAMA_STYLE),
    "Qwen2DecoderLayer": FamilyAdapter("qwen2", LLAMA_STYLE),
    "Qwen3DecoderLayer": FamilyAdapter("qwen3", LLAMA_STYLE),
    "Qwen3MoeDecoderLayer": FamilyAdapter("qwen3_moe", LLAMA_STYLE),
    "MixtralDecoderLayer": FamilyAdapter("mixtral", MIXTRAL_STYLE),
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
