"""What a request (or a consumer's global spec) captures: sites x positions.

``{"layers": [..] | "all", "hooks": [..] | "all", "positions": "all_prompt" | "all_generated" |
"last_prompt" | "all" | [absolute token indices]}`` plus consumer-specific keys, which each
consumer validates itself. The sites are every (hook, layer) of ``layers`` x ``hooks``; or, instead
of those two keys (not beside them), ``"sites": [..]`` names them one by one in either spelling of
``core.site_names`` (``"blocks.3.hook_resid_post"``, ``"pre_attn.5"``): exactly those are captured.
Positions are absolute (prompt tokens 0..P-1, then generated ones); a generated token's residual
exists once it is fed back, so the last sampled token has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.site_names import parse_site_name

Site = tuple[str, int]
POSITION_MODES = ("all_prompt", "all_generated", "last_prompt", "all")


class CaptureSpecError(ValueError):
    """Invalid capture spec; the message starts with the field (``capture.<instance>...``)."""

    @property
    def field(self) -> str:
        return str(self).split(": ", 1)[0]

    @property
    def reason(self) -> str:
        return str(self).split(": ", 1)[-1]


# position classes of a token: before the last prompt token, the last prompt token, generated; the classes
# each position mode covers (explicit positions may fall in any)
POSITION_CLASSES = {"all": (0, 1, 2), "all_prompt": (0, 1), "last_prompt": (1,), "all_generated": (2,)}


@dataclass(frozen=True)
class CaptureSpec:
    sites: tuple[Site, ...]  # (hook, layer), in hook order then layer order
    positions: str | tuple[int, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def select(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """Mask over absolute ``positions`` of the tokens this spec captures."""
        mode = self.positions
        if mode == "all":
            return np.ones(positions.shape, dtype=bool)
        if mode == "all_prompt":
            return positions < prompt_len
        if mode == "all_generated":
            return positions >= prompt_len
        if mode == "last_prompt":
            return positions == prompt_len - 1
        return np.isin(positions, np.asarray(mode, dtype=np.int64))


def _layers(where: str, raw: Any, num_layers: int) -> list[int]:
    layers = list(range(num_layers)) if raw == "all" else raw
    if not isinstance(layers, list) or not layers or not all(isinstance(l, int) and not isinstance(l, bool) for l in layers):
        raise CaptureSpecError(f"{where}.layers: expected 'all' or a non-empty list of layer indices")
    bad = [l for l in layers if not 0 <= l < num_layers]
    if bad:
        raise CaptureSpecError(f"{where}.layers: layer {bad[0]} out of range (the model has {num_layers} layers)")
    return layers


def _check_hook(field: str, hook: str, hooks_enabled: tuple[str, ...]) -> None:
    if hook not in HOOK_NAMES:
        raise CaptureSpecError(f"{field}: unknown hook point {hook!r}")
    if hook not in hooks_enabled:
        raise CaptureSpecError(f"{field}: hook point {hook!r} is not enabled on this server")


def _hooks(where: str, raw: Any, hooks_enabled: tuple[str, ...]) -> list[str]:
    hooks = list(hooks_enabled) if raw == "all" else raw
    if not isinstance(hooks, list) or not hooks:
        raise CaptureSpecError(f"{where}.hooks: expected 'all' or a non-empty list of hook points")
    for h in hooks:
        _check_hook(f"{where}.hooks", h, hooks_enabled)
    return hooks


def _sites(where: str, raw: Any, num_layers: int, hooks_enabled: tuple[str, ...]) -> list[Site]:
    if not isinstance(raw, list) or not raw:
        raise CaptureSpecError(f"{where}.sites: expected a non-empty list of site names")
    out = []
    for i, name in enumerate(raw):
        field = f"{where}.sites[{i}]"
        try:
            hook, layer = parse_site_name(name)
        except ValueError as e:
            raise CaptureSpecError(f"{field}: {e}") from None
        _check_hook(field, hook, hooks_enabled)
        if layer >= num_layers:
            raise CaptureSpecError(f"{field}: layer {layer} out of range (the model has {num_layers} layers)")
        out.append((hook, layer))
    return out


def parse_capture_spec(instance: str, raw: Any, num_layers: int, hooks_enabled: tuple[str, ...]) -> CaptureSpec:
    where = f"capture.{instance}"
    if not isinstance(raw, dict):
        raise CaptureSpecError(f"{where}: expected an object with layers, hooks (or sites), positions")
    if "sites" in raw:
        if "layers" in raw or "hooks" in raw:
            raise CaptureSpecError(f"{where}.sites: give either sites or layers/hooks, not both")
        sites = _sites(where, raw["sites"], num_layers, hooks_enabled)
    else:
        layers = _layers(where, raw.get("layers", "all"), num_layers)
        sites = [(h, l) for h in _hooks(where, raw.get("hooks", "all"), hooks_enabled) for l in layers]
    positions = raw.get("positions", "all_prompt")
    if isinstance(positions, list):
        if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in positions):
            raise CaptureSpecError(f"{where}.positions: explicit positions must be non-negative integers")
        positions = tuple(positions)
    elif positions not in POSITION_MODES:
        raise CaptureSpecError(f"{where}.positions: expected one of {list(POSITION_MODES)} or a list of indices")
    return CaptureSpec(tuple(sorted(set(sites), key=lambda s: (HOOK_NAMES.index(s[0]), s[1]))), positions,
                       spec_params(raw))


def spec_params(raw: dict) -> dict:
    """A spec's consumer-specific keys (what is not where it captures)."""
    return {k: v for k, v in raw.items() if k not in ("layers", "hooks", "sites", "positions")}
