"""Puts the steering op into a loaded vLLM model: only at the configured hooks and layers.

Each hooked submodule of a decoder layer gets its class swapped for a subclass whose forward adds
``table[index]`` (one opaque in-place op) on the side named by the family adapter. Parameters,
names and weights are untouched. The table, index and flag tensors are registered as
non-persistent buffers, so torch.compile lifts them as graph inputs and CUDA graphs read their
fixed addresses: the runtime updates them in place. With steering disabled nothing is installed.
"""

from __future__ import annotations

import torch.nn as nn

from vllm_steer.hooks import HookPoint
from vllm_steer.kernels.apply_steering import op as steer_op
from vllm_steer.models import HookSite, UnsupportedModelError, adapter_for_layer
from vllm_steer.runtime.tables import SteeringTables

_BUF_TABLE, _BUF_INDEX, _BUF_ACTIVE = "_steer_table", "_steer_index", "_steer_active"
_STEERED_CLASSES: dict[tuple[type, str], type] = {}


def _forward_residual_in(self, x, residual=None, *args, **kwargs):
    target = x if residual is None else residual
    steer_op.apply_steering_(target, self._steer_table, self._steer_index, self._steer_active)
    return self._steer_base.forward(self, x, residual, *args, **kwargs)


def _forward_input(self, x, *args, **kwargs):
    steer_op.apply_steering_(x, self._steer_table, self._steer_index, self._steer_active)
    return self._steer_base.forward(self, x, *args, **kwargs)


def _forward_output(self, *args, **kwargs):
    out = self._steer_base.forward(self, *args, **kwargs)
    steer_op.apply_steering_(out, self._steer_table, self._steer_index, self._steer_active)
    return out


_FORWARDS = {"residual_in": _forward_residual_in, "input": _forward_input, "output": _forward_output}


def steered_class(base: type, side: str) -> type:
    """The (cached) subclass of ``base`` that steers on ``side``."""
    key = (base, side)
    cls = _STEERED_CLASSES.get(key)
    if cls is None:
        cls = type(f"Steered{base.__name__}", (base,), {"forward": _FORWARDS[side], "_steer_base": base})
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


def install_steering(
    model: nn.Module, tables: SteeringTables, hooked_layers: dict[str, list[int]]
) -> int:
    """Install the op at every (hook, layer) of ``hooked_layers``; returns how many were installed."""
    layers = dict(find_decoder_layers(model))
    installed = 0
    for hook, layer_ids in hooked_layers.items():
        for layer_id in layer_ids:
            layer = layers.get(layer_id)
            if layer is None:
                continue
            site: HookSite = adapter_for_layer(layer).sites[HookPoint(hook)]
            sub = getattr(layer, site.attr)
            if hasattr(sub, "_steer_base"):
                raise RuntimeError(f"layer {layer_id}.{site.attr} is already steered")
            table, active = tables.layer_views(hook, layer_id)
            sub.__class__ = steered_class(type(sub), site.side)
            sub.register_buffer(_BUF_TABLE, table, persistent=False)
            sub.register_buffer(_BUF_INDEX, tables.index, persistent=False)
            sub.register_buffer(_BUF_ACTIVE, active, persistent=False)
            installed += 1
    steer_op.register()
    return installed


def steered_submodules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(type(m), "_steer_base")]


