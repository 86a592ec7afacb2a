"""Model-family adapters: which norm of a supported decoder layer receives each hook point.

vLLM keeps the residual stream split: a decoder layer takes and returns ``(hidden, residual)``
with stream = hidden + residual, and the next fused add + RMSNorm sums them. Every hook point is
therefore the input of one fused norm, which is where the steering add is folded in:

- ``pre_attn`` of layer L: the stream entering layer L = the input of ``layers[L].input_layernorm``
  (without a residual on the first layer, whose stream is the embedding itself);
- ``post_mlp`` of layer L: layer L's output = the same input of ``layers[L+1].input_layernorm``,
  or of the final ``model.norm`` after the last layer;
- ``post_attn`` of layer L: the input of the fused norm that adds the attention branch:
  ``post_attention_layernorm(attn_out, residual)`` in Llama-style layers; in Gemma2/3, which
  normalize the branch first, ``pre_feedforward_layernorm(post_attention_layernorm(attn_out), residual)``.

Nothing else lives here. See NOTES.md for the derivations and the transformers oracle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyAdapter:
    name: str
    post_attn_norm: str  # attribute of the decoder layer: the fused add+norm after attention


INPUT_NORM = "input_layernorm"
FINAL_NORM = "norm"  # model.model.norm

_LLAMA_STYLE = "post_attention_layernorm"
_GEMMA_STYLE = "pre_feedforward_layernorm"

_BY_LAYER_CLASS: dict[str, FamilyAdapter] = {
    "LlamaDecoderLayer": FamilyAdapter("llama", _LLAMA_STYLE),
    "MistralDecoderLayer": FamilyAdapter("mistral", _LLAMA_STYLE),
    "Qwen2DecoderLayer": FamilyAdapter("qwen2", _LLAMA_STYLE),
    "Qwen3DecoderLayer": FamilyAdapter("qwen3", _LLAMA_STYLE),
    "Qwen3MoeDecoderLayer": FamilyAdapter("qwen3_moe", _LLAMA_STYLE),
    "MixtralDecoderLayer": FamilyAdapter("mixtral", _LLAMA_STYLE),
    "Gemma2DecoderLayer": FamilyAdapter("gemma2", _GEMMA_STYLE),
    "Gemma3DecoderLayer": FamilyAdapter("gemma3", _GEMMA_STYLE),
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
