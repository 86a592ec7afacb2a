"""What a request (or a consumer's global spec) captures: layers x hooks x positions.

``{"layers": [..] | "all", "hooks": [..] | "all", "positions": "all_prompt" | "all_generated" |
"last_prompt" | "all" | [absolute token indices]}`` plus consumer-specific keys, which each
consumer validates itself. Positions are absolute (prompt tokens 0..P-1, then generated ones);
a generated token's residual exists once it is fed back, so the last sampled token has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_steer.core.hooks import HOOK_NAMES

POSITION_MODES = ("all_prompt", "all_generated", "last_prompt", "all")


class CaptureSpecError(ValueError):
    """Invalid capture spec; the message starts with the field (``capture.<instance>...``)."""

    @property
    def field(self) -> str:
        return str(self).split(": ", 1)[0]

    @property
    def reason(self) -> str:
        return str(self).split(": ", 1)[-1]


@dataclass(frozen=True)
class CaptureSpec:
    layers: tuple[int, ...]
    hooks: tuple[str, ...]
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


def parse_capture_spec(instance: str, raw: Any, num_layers: int, hooks_enabled: tuple[str, ...]) -> CaptureSpec:
    where = f"capture.{instance}"
    if not isinstance(raw, dict):
        raise CaptureSpecError(f"{where}: expected an object with layers, hooks, positions")
    layers = raw.get("layers", "all")
    if layers == "all":
        layers = list(range(num_layers))
    if not isinstance(layers, list) or not layers or not all(isinstance(l, int) and not isinstance(l, bool) for l in layers):
        raise CaptureSpecError(f"{where}.layers: expected 'all' or a non-empty list of layer indices")
    bad = [l for l in layers if not 0 <= l < num_layers]
    if bad:
        raise CaptureSpecError(f"{where}.layers: layer {bad[0]} out of range (the model has {num_layers} layers)")
    hooks = raw.get("hooks", "all")
    if hooks == "all":
        hooks = list(hooks_enabled)
    if not isinstance(hooks, list) or not hooks:
        raise CaptureSpecError(f"{where}.hooks: expected 'all' or a non-empty list of hook points")
    for h in hooks:
        if h not in HOOK_NAMES:
            raise CaptureSpecError(f"{where}.hooks: unknown hook point {h!r}")
        if h not in hooks_enabled:
            raise CaptureSpecError(f"{where}.hooks: hook point {h!r} is not enabled on this server")
    positions = raw.get("positions", "all_prompt")
    if isinstance(positions, list):
        if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in positions):
            raise CaptureSpecError(f"{where}.positions: explicit positions must be non-negative integers")
        positions = tuple(positions)
    elif positions not in POSITION_MODES:
        raise CaptureSpecError(f"{where}.positions: expected one of {list(POSITION_MODES)} or a list of indices")
    params = {k: v for k, v in raw.items() if k not in ("layers", "hooks", "positions")}
    return CaptureSpec(tuple(sorted(set(layers))), tuple(h for h in HOOK_NAMES if h in hooks), positions, params)
