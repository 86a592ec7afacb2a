"""Puts the steering (and capture) ops into a loaded vLLM model: only at the configured sites.

A hooked module (the decoder layer itself for pre_attn / post_mlp, a fused add+norm for
post_attn) gets its class swapped for a cached subclass whose forward runs, per site and in this
order: ``capture_rows_`` (reads the pristine stream ``a + b``) then the steering add: the opaque
``apply_steering_`` (``table[index]`` in place; config ``apply: kernel``) or, with ``apply:
inline``, ``x + table.index_select(0, index)`` as plain ops for Inductor to fuse. Parameters,
names and weights are untouched. Tables, index, flags, capture pool and plans are registered as
non-persistent buffers: torch.compile lifts them as graph inputs and CUDA graphs read fixed
addresses, which the runtime updates in place. Which sites exist is a class attribute, so the
traced graph holds exactly those ops and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_steer.hooks import HookPoint
from vllm_steer.kernels.apply_steering import live
from vllm_steer.kernels.apply_steering import op as steer_op
from vllm_steer.kernels.capture_rows import op as capture_op
from vllm_steer.models import UnsupportedModelError, adapter_for_layer
from vllm_steer.runtime.tables import SteeringTables

_STEERED_CLASSES: dict[tuple, type] = {}


def _site(self, hook: str, a, b, target):
    """Capture then steer one hook point (both optional, fixed per class); returns the steered target.

    ``kernel`` mode adds in place through the opaque op; ``inline`` mode returns ``target +
    table[index]`` as plain torch ops, which torch.compile fuses into the next add+norm kernel."""
    if hook in self._vs_capture:
        capture_op.capture_rows_(self.vs_capture_pool, a, b, getattr(self, f"vs_{hook}_plan"))
    if hook not in self._vs_steer:
        return target
    table = getattr(self, f"vs_{hook}_table")
    if self._vs_inline:
        if not torch.compiler.is_compiling() and live.may_skip(live.steering_live):
            return target  # eager step with nothing steered (a traced graph always holds the add)
        return target + table.index_select(0, self.vs_index[: target.shape[0]])
    steer_op.apply_steering_(target, table, self.vs_index, getattr(self, f"vs_{hook}_active"))
    return target


def _forward_layer(self, positions, hidden_states, residual, *args, **kwargs):
    if "pre_attn" in self._vs_hooks:
        if residual is None:  # first layer: the stream is the embedding itself
            hidden_states = _site(self, "pre_attn", hidden_states, residual, hidden_states)
        else:
            residual = _site(self, "pre_attn", hidden_states, residual, residual)
    out = self._vs_base.forward(self, positions, hidden_states, residual, *args, **kwargs)
    if "post_mlp" in self._vs_hooks:
        h, r = out
        out = (_site(self, "post_mlp", h, r, h), r)
    return out


def _forward_norm_input(self, x, residual=None, *args, **kwargs):
    x = _site(self, "post_attn", x, residual, x)
    return self._vs_base.forward(self, x, residual, *args, **kwargs)


_FORWARDS = {"layer": _forward_layer, "norm_input": _forward_norm_input}


def hooked_class(base: type, kind: str, steer: tuple[str, ...], capture: tuple[str, ...],
                 inline: bool = False) -> type:
    """The (cached) subclass of ``base`` that captures/steers the given hooks."""
    key = (base, kind, steer, capture, inline)
    cls = _STEERED_CLASSES.get(key)
    if cls is None:
        attrs = {"forward": _FORWARDS[kind], "_vs_base": base, "_vs_steer": steer, "_vs_capture": capture,
                 "_vs_inline": inline, "_vs_hooks": tuple(sorted(set(steer) | set(capture)))}
        cls = type(f"Steered{base.__name__}", (base,), attrs)
        _STEERED_CLASSES[key] = cls
    return cls


def find_decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global layer index, layer) of every decoder layer present on this rank."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"vllm-steer cannot find decoder layers (model.model.layers) in {type(model).__name__}"
        )
    found = [(i, l) for i, l in enumerate(layers) if type(l).__name__ != "PPMissingLayer"]
    for _, layer in found:
        adapter_for_layer(layer)  # raises for unsupported families
    return found


def num_decoder_layers(model: nn.Module) -> int:
    return len(model.model.layers)


def install_steering(model: nn.Module, tables: SteeringTables, hooked_layers: dict[str, list[int]],
                     capture: object | None = None, inline: bool = False) -> int:
    """Install the ops at every (hook, layer) of ``hooked_layers``; returns how many sites.

    ``capture`` (a CaptureBuffers) adds a capture op at every site too; ``inline`` steers with
    plain torch ops instead of the opaque op (config ``apply``)."""
    layers = dict(find_decoder_layers(model))
    plan: dict[tuple[nn.Module, str], dict[str, list[str]]] = {}
    for hook, layer_ids in hooked_layers.items():
        for layer_id in layer_ids:
            layer = layers.get(layer_id)
            if layer is None:
                continue
            site = adapter_for_layer(layer).sites[HookPoint(hook)]
            module = getattr(layer, site.attr) if site.attr else layer
            kind = "layer" if not site.attr else site.side
            entry = plan.setdefault((module, kind), {"steer": [], "capture": [], "layer": layer_id})
            entry["steer"].append(hook)
            if capture is not None:
                entry["capture"].append(hook)
    for (module, kind), entry in plan.items():
        if hasattr(type(module), "_vs_base"):
            raise RuntimeError(f"{type(module).__name__} is already steered")
        layer_id = entry["layer"]
        module.__class__ = hooked_class(type(module), kind, tuple(entry["steer"]), tuple(entry["capture"]), inline)
        module.register_buffer("vs_index", tables.index, persistent=False)
        for hook in entry["steer"]:
            table, active = tables.layer_views(hook, layer_id)
            module.register_buffer(f"vs_{hook}_table", table, persistent=False)
            module.register_buffer(f"vs_{hook}_active", active, persistent=False)
        if entry["capture"]:
            module.register_buffer("vs_capture_pool", capture.pool, persistent=False)
            for hook in entry["capture"]:
                module.register_buffer(f"vs_{hook}_plan", capture.plan_view(hook, layer_id), persistent=False)
    steer_op.register()
    capture_op.register()
    return sum(len(e["steer"]) for e in plan.values())
