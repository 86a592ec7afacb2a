"""The ``steer`` block of vLLM's ``additional_config``: one typed, validated config object.

``--additional-config '{"steer": {...}}'`` (or ``LLM(additional_config={"steer": {...}})``) turns
steering on; no ``steer`` key, or ``"enabled": false``, leaves the plugin loaded and steering off.
Because the block lives in ``additional_config`` it is part of vLLM's compile-cache hash.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vllm_steer.hooks import HOOK_NAMES

HookName = Literal["pre_attn", "post_attn", "post_mlp"]


class SteerConfigError(ValueError):
    """A malformed ``steer`` block; the message names the offending key."""


class SteerConfig(BaseModel):
    """Engine-wide steering settings (all optional; ``{}`` means defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = True
    max_configs: int = Field(default=32, ge=2, le=4096)
    """Rows per hook table, row 0 included (the zero no-op): ``max_configs - 1`` distinct
    steering configs can be live at once; further requests wait in the scheduler."""
    hooks: tuple[HookName, ...] = HOOK_NAMES  # type: ignore[assignment]
    """Hook points that get a steering op in the graph; others cost nothing."""
    layers: tuple[int, ...] | None = None
    """Layers that get a steering op (default: all)."""
    api_key: str | None = None
    """Bearer token required for mutations of /v1/steering/modules (None: vLLM's own --api-key)."""
    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    """Largest decoded steering payload one request may carry."""
    modules: dict[str, str] = Field(default_factory=dict)
    """Named modules to load at start-up: name -> file path."""

    @field_validator("hooks", mode="before")
    @classmethod
    def _hooks_list(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple) and len(set(v)) != len(v):
            raise ValueError("duplicate hook names")
        if isinstance(v, tuple) and not v:
            raise ValueError("at least one hook point is required")
        return v

    @field_validator("layers", mode="before")
    @classmethod
    def _layers_list(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple) and any(isinstance(x, int) and x < 0 for x in v):
            raise ValueError("layer indices must be >= 0")
        return v

    @property
    def usable_rows(self) -> int:
        """Distinct non-zero configs that fit at once."""
        return self.max_configs - 1


def parse_steer_config(additional_config: dict[str, Any] | None) -> SteerConfig | None:
    """Return the enabled config, or None when steering is off. Raises SteerConfigError."""
    if not additional_config or "steer" not in additional_config:
        return None
    raw = additional_config["steer"]
    if not isinstance(raw, dict):
        raise SteerConfigError(
            f"additional_config.steer: expected an object, got {type(raw).__name__}"
        )
    try:
        cfg = SteerConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "steer"
        raise SteerConfigError(
            f"additional_config.steer.{key}: {err['msg']} (got {err.get('input')!r})"
        ) from None
    return cfg if cfg.enabled else None


def steer_config_of(vllm_config: Any) -> SteerConfig | None:
    """The enabled steer config of a VllmConfig (None when steering is off)."""
    return parse_steer_config(getattr(vllm_config, "additional_config", None))
