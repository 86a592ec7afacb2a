"""Puts steering (and capture) into a loaded vLLM model: only at the norms that receive a hooked site.

Each such fused add + RMSNorm instance gets its class swapped for a cached subclass whose forward
calls ``torch.ops.vllm_steer.steered_norm`` (the same contract as vLLM's norm, with the site's
steering added to the stream inside the kernel) with the descriptors of the features its class has:
vectors per slot, SAE packs, conditions, capture (each captured slot's stream written to the pool in the
same launch, before that slot's steering; layer 0's norm, steered by an in-place add, keeps a
``capture_rows_`` op before it). Parameters,
names and weights are untouched. Tables, index, flags, capture pool and plans are registered as
non-persistent buffers: torch.compile lifts them as graph inputs and CUDA graphs read fixed
addresses, which the runtime updates in place. Which features a norm has are class attributes, so
the traced graph holds exactly that op and nothing else; norms of unhooked sites stay vLLM's.

The adapters of ``runtime.families`` (one stream tensor, branches added outside the norms) use the same op:
an ``in_place`` norm (Granite) is called without a residual on the stream its caller keeps, so it writes the
steered stream back into its input; a ``post_add`` norm (OLMo-3) is given the residual by its layer's
post_add forward (a cached subclass of the layer, only where a norm of it is steered) and returns the steered
sum ``residual + norm(branch)``: its own norm is vLLM's, the op adds and steers (and writes a normalized
output nothing reads: one extra write per steered post_add norm). Their pre_attn.0 (the embeddings, read by
no norm) is held by a ``StreamInput`` of layer 0, steered in place like layer 0's fused norm. A ``hyper`` layer
(DeepSeek-V4) with a steered norm gets ``runtime.hyper``'s forward, which calls that norm on the merged stream its mHC
kernel no longer normalizes; the steered norm returns the normalized output (nothing reads its input after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from vllm_steer.core.hooks import site_order
from vllm_steer.kernels.capture_rows import op as capture_op
from vllm_steer.kernels.steered_rms_norm import op as norm_op
from vllm_steer.runtime.condition_tables import ConditionTables
from vllm_steer.runtime import hyper
from vllm_steer.runtime.families import FINAL_NORM, LayerNorms, UnsupportedModelError, layer_norms, model_problem
from vllm_steer.runtime.projection_tables import ProjectionTables
from vllm_steer.runtime.sae_tables import SaeTables
from vllm_steer.runtime.tables import SteeringTables

Site = tuple[str, int]  # (hook, layer)

_STEERED_CLASSES: dict[tuple, type] = {}


@dataclass(frozen=True)
class NormSite:
    """A fused norm of this rank and the hooked sites folded into it (A first, then B)."""

    name: str
    norm: nn.Module
    a: Site | None
    b: Site | None
    mode: str = "fused"  # runtime.families' layout of the layer: "fused", "in_place", "post_add" or "hyper"
    layer: nn.Module | None = None  # post_add: the layer whose forward passes the residual to this norm; hyper: the
    # layer whose forward unfuses this norm from its mHC kernel (runtime.hyper)


class StreamInput(nn.Module):
    """pre_attn.0 of a post_add model: no norm reads the embeddings, so this site of layer 0 holds the slot's
    buffers and, steered, adds its vectors to the stream in place (after capturing it), as layer 0's fused
    norm does (``_forward`` without a residual). Unsteered it is the identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def find_decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global layer index, layer) of every decoder layer present on this rank; raises UnsupportedModelError
    for a model whose layers or layer loop do not fit ``runtime.families``' fused-norm rule."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"vllm-steer cannot find decoder layers (model.model.layers) in {type(model).__name__}"
        )
    if getattr(inner, "fast_prefill_enabled", False):  # Gemma-4's KV-sharing fast prefill: some layers see a subset
        raise UnsupportedModelError(f"vllm-steer cannot steer {type(model).__name__} with kv_sharing_fast_prefill: "
                                    "its later layers run on fewer tokens than the steering index holds")
    found = [(i, l) for i, l in enumerate(layers) if type(l).__name__ != "PPMissingLayer"]
    for _, layer in found:
        layer_norms(layer)  # raises for layers that do not fit
    problem = model_problem(type(inner))
    if problem is not None:
        raise UnsupportedModelError(f"vllm-steer cannot steer {type(model).__name__}: {problem}")
    return found


def num_decoder_layers(model: nn.Module) -> int:
    return len(model.model.layers)


def norm_sites(model: nn.Module, wanted: set[Site]) -> list[NormSite]:
    """The fused norms of this rank that receive at least one wanted site (see runtime.families)."""
    n_layers = num_decoder_layers(model)

    def pick(hook: str, layer: int) -> Site | None:
        return (hook, layer) if (hook, layer) in wanted else None

    sites, final_mode = [], "fused"
    layers = find_decoder_layers(model)
    if layers and layer_norms(layers[0][1]).layout == "post_add":
        return _post_add_sites(model, layers, pick)
    for i, layer in layers:
        norms = layer_norms(layer)
        mode = norms.layout
        owner = layer if mode == "hyper" else None
        sites.append(NormSite(f"layers.{i}.{norms.input_norm}", getattr(layer, norms.input_norm),
                              pick("post_mlp", i - 1) if i > 0 else None, pick("pre_attn", i), mode, owner))
        sites.append(NormSite(f"layers.{i}.{norms.post_attn_norm}", getattr(layer, norms.post_attn_norm),
                              pick("post_attn", i), None, mode, owner))
        final_mode = mode
    final = getattr(model.model, FINAL_NORM, None)
    if final is not None and type(final).__name__ != "PPMissingLayer":
        sites.append(NormSite(FINAL_NORM, final, pick("post_mlp", n_layers - 1), None, final_mode))
    return [s for s in sites if s.a is not None or s.b is not None]


def _post_add_sites(model: nn.Module, layers: list[tuple[int, nn.Module]], pick) -> list[NormSite]:
    """A post_add model's sites: layer L's attention-branch norm makes post_attn.L, its MLP-branch norm
    post_mlp.L (A) and pre_attn.L+1 (B); pre_attn.0 is layer 0's StreamInput. Not under pipeline parallelism
    (core.hooks.receiving_layer places post_mlp.L on layer L+1's stage)."""
    if len(layers) != len(model.model.layers):
        raise UnsupportedModelError(f"vllm-steer cannot steer {type(model).__name__} under pipeline parallelism: "
                                    "its post-norm layers make post_mlp.L in layer L, not in layer L+1")
    sites = []
    for i, layer in layers:
        norms = layer_norms(layer)
        if i == 0 and pick("pre_attn", 0):
            layer.vs_input = StreamInput()
            sites.append(NormSite("layers.0.vs_input", layer.vs_input, None, pick("pre_attn", 0), "fused", layer))
        sites.append(NormSite(f"layers.{i}.{norms.post_attn_norm}", getattr(layer, norms.post_attn_norm),
                              pick("post_attn", i), None, "post_add", layer))
        sites.append(NormSite(f"layers.{i}.{norms.input_norm}", getattr(layer, norms.input_norm),
                              pick("post_mlp", i), pick("pre_attn", i + 1), "post_add", layer))
    return [s for s in sites if s.a is not None or s.b is not None]


def _norm_params(norm: nn.Module) -> tuple[float, float]:
    """(eps, weight offset) of a vLLM RMSNorm / GemmaRMSNorm; refuses what the kernel cannot mirror."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    if isinstance(norm, StreamInput):
        return 0.0, 0.0  # no norm: the slot's vectors only
    if isinstance(norm, GemmaRMSNorm):
        return float(norm.variance_epsilon), 1.0
    if isinstance(norm, RMSNorm):
        if not norm.has_weight or norm.variance_size_override is not None:
            raise UnsupportedModelError(f"vllm-steer cannot steer through {norm!r} (no weight or a partial variance)")
        return float(norm.variance_epsilon), 0.0
    raise UnsupportedModelError(f"vllm-steer expects vLLM's RMSNorm or GemmaRMSNorm, found {type(norm).__name__}")


def site_gains(sites: list[NormSite]) -> Callable[[Site], np.ndarray | None]:
    """A site -> the gain of the norm whose output it is (slot A's norm; float32 ``weight + offset``: Gemma's
    ``1 + w``), read from the device when asked (start-up, a runtime registration), None for a site without one."""
    norms = {s.a: s.norm for s in sites if s.a is not None and not isinstance(s.norm, StreamInput)}

    def gain(site: Site) -> np.ndarray | None:
        norm = norms.get(site)
        if norm is None:
            return None
        _, offset = _norm_params(norm)
        return (norm.weight.detach().float() + offset).cpu().numpy()

    return gain


def _forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
    """The steered norm: vLLM's fused add + RMSNorm with this site's features (capture, SAE clamps, gated
    rows, vectors) applied in one launch of ``steered_norm``. ``in_place`` (no residual; the caller keeps x as
    the stream): the steered stream is written back into x. ``post_add`` (given the residual by the layer's
    post_add forward): returns ``residual + norm(x)``, steered. ``hyper`` (an mHC layer's merged stream, unfused by
    ``runtime.hyper``, or the final hc_head's; nothing reads either after its norm): the steered norm's output."""
    if self._vs_mode == "hyper":
        return _steered(self, x, None)[0]
    if self._vs_mode == "in_place":
        out, stream = _steered(self, x, None)
        x.copy_(stream)
        return out
    if self._vs_mode == "post_add":
        return _steered(self, self._vs_base.forward(self, x), residual)[1]
    if residual is None:  # the first layer: the stream is x itself, and the caller keeps x as residual
        if "b" in self._vs_capture:
            torch.ops.vllm_steer.capture_rows_(self.vs_pool, x, self.vs_b_plan)
        if self._vs_has_b:
            # In place (x is the caller's residual too), as plain ops: compiled, Inductor fuses the
            # gather and the add into its embedding + RMSNorm kernel (no GEMM here to pull the add
            # into an addmm), so the first layer costs no launch of its own either.
            x.add_(self.vs_b_table.index_select(0, self.vs_index[: x.shape[0]]))
        return self._vs_base.forward(self, x)
    return _steered(self, x, residual)


def _steered(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized output, steered stream) of ``x + residual`` by ``steered_norm`` with this norm's features
    (``steered_norm_plain``, the op of fewer arguments, where they are vectors and capture only)."""
    if self._vs_plain:
        a, b, capture = self._vs_has_a, self._vs_has_b, self._vs_capture
        return torch.ops.vllm_steer.steered_norm_plain(
            x, residual, self.weight, self._vs_eps, self._vs_offset, self.vs_index,
            self.vs_a_table if a else None, self.vs_a_flag if a else None,
            self.vs_b_table if b else None, self.vs_b_flag if b else None,
            self.vs_a_plan if "a" in capture else None, self.vs_b_plan if "b" in capture else None,
            self.vs_pool if capture else None)
    cond = self._vs_cond
    return torch.ops.vllm_steer.steered_norm(
        x, residual, self.weight, self._vs_eps, self._vs_offset, self.vs_index,
        [self.vs_a_table, self.vs_a_flag] if self._vs_has_a else [],
        [self.vs_b_table, self.vs_b_flag] if self._vs_has_b else [],
        *_sae_packs(self), *self._vs_topk,
        [self.vs_cond_site, self.vs_cond_params, self.vs_probe, self.vs_site_ids] if cond else [],
        self.vs_gate if cond else None,
        self.vs_a_plan if "a" in self._vs_capture else None, self.vs_b_plan if "b" in self._vs_capture else None,
        self.vs_pool if self._vs_capture else None,
        [self.vs_a_proj_count, self.vs_a_proj_dirs, self.vs_a_proj_bounds] if "a" in self._vs_proj else [],
        [self.vs_b_proj_count, self.vs_b_proj_dirs, self.vs_b_proj_bounds] if "b" in self._vs_proj else [],
        [getattr(self, f"vs_tc_{i}") for i in range(self._vs_tc)], self._vs_tc_topk)


def _sae_packs(self) -> list[list[torch.Tensor]]:
    """Each slot's SAE pack (its registered buffers in order; [] for a slot without an SAE)."""
    return [[getattr(self, f"vs_{slot}_sae_{i}") for i in range(n)] for slot, n in zip("ab", self._vs_sae or (0, 0))]


def steered_norm_class(base: type, has_a: bool, has_b: bool, capture: tuple[str, ...], eps: float,
                       offset: float, sae: tuple[int, int] = (0, 0), topk: tuple[int, int] = (0, 0),
                       cond: bool = False, proj: tuple[str, ...] = (), tc: int = 0, mode: str = "fused",
                       tc_topk: int = 0) -> type:
    """The (cached) subclass of a norm class that steers (and captures) the given slots; ``sae``:
    the length of each slot's SAE pack (0: no SAE), ``topk`` their TopK k; ``cond``: the condition
    descriptor (``steer.conditions``); ``proj``: the slots with projection tables (``steer.max_projections``);
    ``tc``: the length of a transcoder's pack (0: none; only a post_attn norm, whose output is the MLP's input),
    ``tc_topk`` its TopK k (a full pack); ``mode``: the layer's layout (``_forward``)."""
    key = (base, has_a, has_b, capture, eps, offset, sae, topk, cond, proj, tc, mode, tc_topk)
    cls = _STEERED_CLASSES.get(key)
    if cls is None:
        attrs = {"forward": _forward, "_vs_base": base, "_vs_has_a": has_a, "_vs_has_b": has_b,
                 "_vs_capture": capture, "_vs_eps": eps, "_vs_offset": offset,
                 "_vs_sae": sae if any(sae) else (), "_vs_topk": topk, "_vs_cond": cond, "_vs_proj": proj,
                 "_vs_tc": tc, "_vs_tc_topk": tc_topk, "_vs_mode": mode,
                 "_vs_plain": not (any(sae) or cond or proj or tc)}
        cls = type(f"Steered{base.__name__}", (base,), attrs)
        _STEERED_CLASSES[key] = cls
    return cls


def install_steering(sites: list[NormSite], tables: SteeringTables, capture: object | None = None,
                     sae: SaeTables | None = None, conditions: ConditionTables | None = None,
                     projections: ProjectionTables | None = None) -> int:
    """Swap every site's norm for its steered subclass; returns how many hooked sites it serves.

    ``capture`` (a CaptureBuffers) makes every norm capture its slots in its own launch (the pool, plans);
    ``sae`` gives the norms of its sites the SAE packs (and the op that applies them), and layer L's post_attn
    norm a transcoder's pack (its output is the MLP's input; the clamps' delta goes to the returned residual);
    ``conditions`` gives every steered norm the conditional op (with the SAE, if any) and its buffers;
    ``projections`` gives every steered slot its projection descriptor (count, directions, bounds) but
    layer 0's ``pre_attn`` (steered by an in-place add, not the op: the front end refuses projections there)."""
    packs = sae.packs if sae is not None else {}
    tc_packs = sae.tc_packs if sae is not None else {}  # by post_attn.L: only that norm's slot A is one
    topk_of = sae.topk if sae is not None else {}
    tc_topk_of = sae.tc_topk if sae is not None else {}
    for site in sites:
        norm = site.norm
        if hasattr(type(norm), "_vs_base"):
            raise RuntimeError(f"{site.name} is already steered")
        eps, offset = _norm_params(norm)
        slots = {"a": site.a, "b": site.b}
        captured = tuple(k for k, s in slots.items() if s is not None and capture is not None)
        site_packs = {k: packs.get(s, []) for k, s in slots.items()}
        lengths = (len(site_packs["a"]), len(site_packs["b"]))
        topk = (topk_of.get(site.a, 0), topk_of.get(site.b, 0))
        proj = tuple(k for k, s in slots.items() if s is not None and projections is not None
                     and s in projections.descs and s != ("pre_attn", 0))
        tc = tc_packs.get(site.a, [])
        if tc and site.mode != "fused":
            raise UnsupportedModelError(f"vllm-steer cannot apply a transcoder at {site.name}: its layer adds the "
                                        f"MLP's output outside a fused norm ({site.mode} layout)")
        norm.__class__ = steered_norm_class(type(norm), site.a is not None, site.b is not None, captured, eps, offset,
                                            lengths, topk, conditions is not None, proj, len(tc), site.mode,
                                            tc_topk_of.get(site.a, 0) if tc else 0)
        if site.layer is not None:
            site.layer.__class__ = post_add_layer_class(type(site.layer), layer_norms(site.layer))
        for i, t in enumerate(tc):
            norm.register_buffer(f"vs_tc_{i}", t, persistent=False)
        for slot in proj:
            for name, t in zip(("count", "dirs", "bounds"), projections.descs[slots[slot]]):
                norm.register_buffer(f"vs_{slot}_proj_{name}", t, persistent=False)
        if conditions is not None:
            order = [site_order(*s) if s is not None else -2 for s in (site.a, site.b)]
            norm.register_buffer("vs_site_ids", torch.tensor(order, dtype=torch.int32, device=tables.index.device),
                                 persistent=False)
            for name, t in (("vs_cond_site", conditions.site), ("vs_cond_params", conditions.params),
                            ("vs_probe", conditions.probe), ("vs_gate", conditions.gate)):
                norm.register_buffer(name, t, persistent=False)
        for slot, pack in site_packs.items():
            for i, t in enumerate(pack):
                norm.register_buffer(f"vs_{slot}_sae_{i}", t, persistent=False)
        norm.register_buffer("vs_index", tables.index, persistent=False)
        for slot, where in slots.items():
            if where is None:
                continue
            table, flag = tables.layer_views(*where)
            norm.register_buffer(f"vs_{slot}_table", table, persistent=False)
            norm.register_buffer(f"vs_{slot}_flag", flag, persistent=False)
            if slot in captured:
                norm.register_buffer(f"vs_{slot}_plan", capture.plan_view(*where), persistent=False)
        if captured:
            norm.register_buffer("vs_pool", capture.pool, persistent=False)
    norm_op.register()
    capture_op.register()
    return sum((s.a is not None) + (s.b is not None) for s in sites)


_POST_ADD_LAYERS: dict[type, type] = {}


def post_add_layer_class(base: type, norms: LayerNorms) -> type:
    """The (cached) subclass of a post_add decoder layer whose forward passes the residual to its steered norms,
    or of a hyper one whose forward unfuses its steered norms (idempotent: a subclass maps to itself)."""
    if "_vs_layer_base" in vars(base):
        return base
    cls = _POST_ADD_LAYERS.get(base)
    if cls is None:
        forward = _hf_post_add_layer_forward if norms.hf else _post_add_layer_forward
        attrs = {"forward": forward, "_vs_layer_base": base, "_vs_norms": norms}
        if norms.layout == "hyper":
            attrs.update(forward=hyper.layer_forward, _vs_mhc=hyper.kernels(base))
        cls = type(f"Steered{base.__name__}", (base,), attrs)
        _POST_ADD_LAYERS[base] = cls
    return cls


def _post_add_layer_forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                            residual: torch.Tensor | None = None):
    """vLLM's post_add forward (``runtime.families._LAYOUT_STATEMENTS``), statement for statement, with each
    branch's norm given the residual where it is steered (it adds it and steers the sum); pre_attn.0 first."""
    n = self._vs_norms
    if "vs_input" in self._modules:
        self.vs_input(hidden_states)  # in place: pre_attn.0
    residual = hidden_states
    hidden_states = getattr(self, n.attn)(positions, hidden_states)
    hidden_states = _add_branch(getattr(self, n.post_attn_norm), hidden_states, residual)
    residual = hidden_states
    hidden_states = getattr(self, n.mlp)(hidden_states)
    hidden_states = _add_branch(getattr(self, n.input_norm), hidden_states, residual)
    return (hidden_states, residual) if n.returns_residual else hidden_states


def _hf_post_add_layer_forward(self, hidden_states: torch.Tensor, **kwargs):
    """HF's post_add forward (OLMo-2 in vLLM's Transformers backend; ``runtime.families``' HF statements), the
    same way: the stream is [1, T, D] there (the backend adds a batch dimension), the steered ops see [T, D]."""
    n = self._vs_norms
    if "vs_input" in self._modules:
        self.vs_input(hidden_states.view(-1, hidden_states.shape[-1]))  # in place: pre_attn.0
    residual = hidden_states
    hidden_states, _ = getattr(self, n.attn)(hidden_states=hidden_states, **kwargs)
    hidden_states = _add_branch(getattr(self, n.post_attn_norm), hidden_states, residual)
    residual = hidden_states
    hidden_states = getattr(self, n.mlp)(hidden_states)
    return _add_branch(getattr(self, n.input_norm), hidden_states, residual)


def _add_branch(norm: nn.Module, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + norm(branch)``: by the steered norm where it is one (on [T, D] views), else as the layer does."""
    if getattr(type(norm), "_vs_mode", None) == "post_add":
        d = residual.shape[-1]
        return norm(branch.reshape(-1, d), residual.reshape(-1, d)).view(residual.shape)
    return residual + norm(branch)
