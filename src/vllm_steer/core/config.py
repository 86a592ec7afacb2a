"""The ``steer`` block of vLLM's ``additional_config``: one typed, validated config object.

``--additional-config '{"steer": {...}}'`` (or ``LLM(additional_config={"steer": {...}})``) turns
steering on; no ``steer`` key, or ``"enabled": false``, leaves the plugin loaded and steering off.
Because the block lives in ``additional_config`` it is part of vLLM's compile-cache hash.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vllm_steer.core.hooks import HOOK_NAMES

HookName = Literal["pre_attn", "post_attn", "post_mlp"]


class SteerConfigError(ValueError):
    """A malformed ``steer`` block; the message names the offending key."""


class ConsumerConfig(BaseModel):
    """One capture consumer instance: the entry-point name, its instance name, its params."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    instance: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def instance_name(self) -> str:
        return self.instance or self.name


def parse_consumer_shorthand(text: str) -> dict[str, Any]:
    """``name:key=val,key=val`` (values parsed as JSON when they parse, else kept as strings)."""
    import json

    name, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"expected key=value in {item!r}")
        try:
            params[key.strip()] = json.loads(val)
        except json.JSONDecodeError:
            params[key.strip()] = val
    instance = params.pop("instance", None)
    return {"name": name.strip(), "instance": instance, "params": params}


class SaeModuleConfig(BaseModel):
    """One SAE to load at start-up (``steer.sae.<name>``); docs/sae.md has the formats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: str
    """A Gemma Scope ``params.npz`` (or its folder), a sae-lens folder, a manifest folder, or an EleutherAI
    sparsify hookpoint folder (or its checkpoint root)."""
    format: Literal["gemma_scope", "sae_lens", "manifest", "sparsify", "dictionary_learning"] | None = None
    """None: told by the files."""
    site: str | None = None
    """The site of a single-site file (sae-lens and sparsify name their own; with a sparsify root, the one
    hookpoint to load): ``post_mlp.12`` or
    ``blocks.12.hook_resid_post`` (``core.site_names``)."""
    features: tuple[int, ...] | None = None
    """The features requests may clamp (their encoder columns / decoder rows are staged on every
    worker); None: all of them, allowed up to MAX_CLAMPABLE features."""
    reconstruct: bool = False
    """Keep the whole SAE on the workers so requests may ask for ``mode: reconstruct``."""

    @field_validator("features", mode="before")
    @classmethod
    def _features_list(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple):
            if not v:
                raise ValueError("at least one feature")
            if len(set(v)) != len(v):
                raise ValueError("duplicate feature ids")
            if any(isinstance(x, int) and x < 0 for x in v):
                raise ValueError("feature ids must be >= 0")
        return v


MAX_CLAMPABLE = 4096  # clampable features per SAE site


class SaeSlotConfig(BaseModel):
    """A site reserved for a runtime SAE of any architecture (``steer.sae_slots.<site>`` as an object): the whole
    SAE is staged there (TopK ranks every feature; reconstruct decodes them all), so its size is reserved too."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    features: int = Field(ge=1, le=MAX_CLAMPABLE)
    """How many features requests may clamp (the SAE's ``features`` list, or all of a small one)."""
    d_sae: int = Field(ge=1)
    """The most features an SAE registered here may have (4 * d_model * d_sae bytes of bfloat16 weights)."""
    k: int = Field(default=0, ge=0)
    """The TopK k of the SAEs registered here (0: ReLU / JumpReLU ones); the norm's op is built for it."""
    reconstruct: bool = False
    """Whether an SAE registered here may be registered with ``reconstruct: true``."""


def upload_cap(max_bytes: int) -> int:
    """The largest body worth reading for ``max_bytes`` of vectors: twice them (packed in base64
    JSON they are 4/3 as large) plus 1 MiB for the rest of the body."""
    return 2 * max_bytes + (1 << 20)


class SteerConfig(BaseModel):
    """Engine-wide steering settings (all optional; ``{}`` means defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = True
    max_configs: int = Field(default=32, ge=2, le=4096)
    """Rows per hook table, row 0 included (the zero no-op): ``max_configs - 1`` distinct
    steering configs can be live at once; further requests wait in the scheduler."""
    max_row_wait_s: float = Field(default=60.0, ge=0)
    """How long a steered request may wait for a row held by running requests before it is refused
    (503); 0: refuse at once instead of waiting."""
    hooks: tuple[HookName, ...] = HOOK_NAMES  # type: ignore[assignment]
    """Hook points that can be steered; the norms that receive no hooked site stay vLLM's."""
    layers: tuple[int, ...] | None = None
    """Layers that can be steered (default: all)."""
    api_key: str | None = None
    """Bearer token required for mutations of /v1/steering/modules (None: vLLM's own --api-key)."""
    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    """Largest decoded steering payload one request may carry."""
    max_body_bytes: int | None = Field(default=None, ge=1)
    """Largest completion / chat request body the server reads (413 beyond it, before parsing);
    None: ``2 * max_request_bytes + 1 MiB`` (the cap's payload packed, in base64 JSON, plus the
    rest of the request)."""
    modules: dict[str, str] = Field(default_factory=dict)
    """Named modules to load at start-up: name -> file path."""
    max_modules: int = Field(default=256, ge=1)
    """Named modules one API server process holds (preloaded ones included); registering a new
    name beyond it is a 409 (replacing an existing name is not a new module)."""
    max_module_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    """Largest module, in bytes of its float32 vectors (all tiers; ``GET .../modules`` ``bytes``):
    a 413 beyond it. A registration body or file larger than ``module_body_cap`` is refused
    before it is read further."""
    capture: tuple[ConsumerConfig, ...] = ()
    """Capture consumers (objects, or ``"name:key=val,..."`` strings). None: no capture ops."""
    capture_max_rows: int = Field(default=4096, ge=16)
    """Residual rows one step can capture across all sites (the device pool's size)."""
    capture_reduce_rows: int = Field(default=2048, ge=0)
    """Accumulator rows for consumers that only want a per-site reduction (``device_reduce``, e.g.
    ``activations``): one per (request, consumer, site) for the request's life, reduced on the device
    (``runtime.capture_reduce``). Memory: ``rows x hidden x (model dtype bytes + 4)`` (2048 rows at
    hidden 4096, bf16: 48 MiB). A request that finds too few free rows is captured step by step
    instead (correct, slower; ``reduce_fallbacks``). 0: never reduced on the device."""
    loop_stall_warn_s: float = Field(default=10.0, ge=0)
    """An API process whose event loop runs nothing this long logs where it is blocked and counts it
    (``server.loop_watch``); 0: not watched."""
    capture_result_timeout_s: float = Field(default=30.0, ge=0)
    """How long a finished request's response (or ``capture.collect``) waits for its driver
    consumers' results; after it, each driver instance without one gets
    ``{"error": "timeout", "message": ...}`` in ``capture``. Results never delay other requests."""
    sae: dict[str, SaeModuleConfig] = Field(default_factory=dict)
    """SAEs requests may clamp features of (``"sae": {"name": ...}``), by name."""
    sae_slots: dict[str, int | SaeSlotConfig] = Field(default_factory=dict)
    """Sites reserved for SAEs registered while the server runs (``POST /v1/steering/sae``):
    site name (``"hook.layer"`` or TransformerLens', ``core.site_names``) -> how many clampable
    features the site holds (a clamp-only ReLU / JumpReLU SAE; it may share the site with start-up
    SAEs), or a ``SaeSlotConfig`` (any architecture, TopK and reconstruct too; alone at its site). Its
    tables are allocated at start-up, so CUDA graphs and torch.compile see them from the first step."""
    sae_root: tuple[str, ...] | None = None
    """The directories (absolute; one string or a list) whose files runtime SAE registrations may
    read (``core.sae_paths``); None: registration by path is refused (403). ``steer.sae`` is not
    restricted."""
    max_sae_bytes: int = Field(default=4 << 30, ge=1)
    """Largest file a runtime SAE registration reads (each file on its own; 4 GiB by default)."""
    max_projections: int = Field(default=0, ge=0, le=64)
    """Directions one steering config may project the stream onto at one site (``steering_projections``:
    ablate or cap). 0: no projection tables and no projection step in any norm (the op is as without the
    feature). K > 0: every steered norm's slot gets a count ``[max_configs]`` int32, directions
    ``[max_configs, K, hidden]`` float32 and bounds ``[max_configs, K, 2]`` float32 on each worker:
    ``max_configs x K x hidden x 4`` bytes per hooked site (e.g. 32 x 1 x 4096 x 4 = 512 KiB, so 48 MiB for the
    96 sites of a 32-layer model with every hook)."""
    site_norms: str | None = None
    """A file of typical residual norms per site (``vllm-steer calibrate``'s JSON, or a module file ``vllm-steer
    extract`` wrote): what a ``"norm"`` strength of inline vectors (and of modules without norms of their own)
    is relative to (``core.site_norms``). None: such requests are refused, naming how to get the norms."""
    conditions: bool = False
    """Allow ``steering_condition`` (steering scaled per token by a probe's gate): every steered norm
    then runs the conditional op, with a probe table ``[max_configs, hidden]`` float32 and a per-token
    gate buffer beside the steering tables."""

    @field_validator("capture", mode="before")
    @classmethod
    def _capture_list(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = tuple(parse_consumer_shorthand(x) if isinstance(x, str) else x for x in v)
        return v

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

    @field_validator("sae_root", mode="before")
    @classmethod
    def _roots(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = (v,)
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple):
            if not v:
                raise ValueError("at least one directory (or leave sae_root out)")
            if not all(isinstance(r, str) and os.path.isabs(r) for r in v):
                raise ValueError("expected absolute directory paths")
        return v

    @field_validator("sae_slots", mode="after")
    @classmethod
    def _slot_sizes(cls, v: Any) -> Any:
        for site, n in v.items():
            if isinstance(n, SaeSlotConfig):
                if n.k > n.d_sae or n.features > n.d_sae:
                    raise ValueError(f"{site}: k and features must not exceed d_sae ({n.d_sae})")
            elif not 1 <= n <= MAX_CLAMPABLE:
                raise ValueError(f"{site}: between 1 and {MAX_CLAMPABLE} clampable features, got {n}")
        return v

    @field_validator("capture", mode="after")
    @classmethod
    def _unique_instances(cls, v: Any) -> Any:
        names = [c.instance_name for c in v]
        if len(set(names)) != len(names):
            raise ValueError("capture consumer instance names must be unique")
        return v

    @property
    def body_cap(self) -> int:
        return self.max_body_bytes or upload_cap(self.max_request_bytes)

    @property
    def module_body_cap(self) -> int:
        """Largest module registration body (JSON or multipart) the server reads."""
        return upload_cap(self.max_module_bytes)

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
    if len(cfg.modules) > cfg.max_modules:
        raise SteerConfigError(
            f"additional_config.steer.modules: {len(cfg.modules)} modules to preload, over "
            f"steer.max_modules ({cfg.max_modules})"
        )
    return cfg if cfg.enabled else None


def steer_config_of(vllm_config: Any) -> SteerConfig | None:
    """The enabled steer config of a VllmConfig (None when steering is off)."""
    return parse_steer_config(getattr(vllm_config, "additional_config", None))
