"""What ``Client`` / ``AsyncClient`` return: msgspec Structs, one per answer of the vllm-steer routes and of a
steered completion, decoded with ``decoded(body, T)`` (``msgspec.convert``).

The shapes follow the routes (``server/router.py``, ``modules_routes.py``, ``sae_routes.py``; documented for
OpenAPI in ``server/schemas.py``) and the ``steering`` field of responses (``frontend/applied_report.py``).
Keys a struct does not name are ignored (a newer server may add fields); a missing required key or a value of
another type is a ``msgspec.ValidationError`` (a ``ValueError``) naming where (``$.model.hooks``).
A ``Completion`` keeps the whole answer as ``.raw``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from vllm_steer.core.struct_info import prebuild

T = TypeVar("T")


class _Answer(msgspec.Struct):
    """Base of the answers: ``as_dict()`` for JSON output."""

    def as_dict(self) -> dict:
        return msgspec.to_builtins(self)


class ModelSites(_Answer):
    """The served model as steering vectors must fit it (``GET /v1/steering``'s ``model``)."""

    num_layers: int
    hidden_size: int  # the length of every steering vector
    hooks: list[str]  # hook points enabled on this server (pre_attn, post_attn, post_mlp)
    dtype: str


class Worker(_Answer):
    """One worker's view (``GET /v1/steering``'s ``workers``): its pid and, with steering installed, its ops and
    row usage; ``capture``: the capture pool's counters (None without capture)."""

    pid: int
    runner: str | None = None
    steering: bool = False
    ops: int | None = None
    steered_norms: int | None = None
    hooks: Any = None
    rows: int | None = None  # steer.max_configs
    live_configs: int | None = None
    peak_live_configs: int | None = None
    preemptions_seen: int | None = None
    row_uploads: int | None = None
    row_upload_bytes: int | None = None
    row_evictions: int | None = None
    module_versions: int | None = None
    capture: dict[str, int] | None = None


class Status(_Answer):
    """``GET /v1/steering``: the plugin's version, whether steering is on, the served model's sites (None when off),
    the ``steer`` block (its ``api_key`` left out; None when off) and every worker's view (of every DP engine)."""

    version: str
    enabled: bool
    model: ModelSites | None
    config: dict[str, Any] | None
    workers: list[Worker] = []


class Module(_Answer):
    """A named steering module (``POST`` / ``GET /v1/steering/modules[/NAME]``). ``sites``: per tier holding
    vectors, its sites (``post_mlp.12``); ``bytes``: its float32 vectors, all tiers; ``created``: seconds since the
    epoch; ``condition`` / ``projections`` / ``site_norms``: what it carries (None: nothing); ``in_flight``:
    unfinished requests using it (a listing or a get; None in a registration's answer)."""

    name: str
    description: str
    source: str  # json | safetensors | gguf
    version: int
    hooks: list[str]
    layers: list[int]
    tiers: list[str]
    dtype: str
    bytes: int
    created: float
    sites: dict[str, list[str]] = {}  # {} from a server older than per-tier sites
    condition: dict[str, Any] | None = None
    projections: dict[str, dict[str, list[str]]] | None = None
    site_norms: dict[str, float] | None = None
    in_flight: int | None = None


class ModuleList(_Answer):
    """``GET /v1/steering/modules``."""

    data: list[Module]
    object: str = "list"


class Sae(_Answer):
    """An SAE requests may clamp (``GET /v1/steering/sae[/NAME]``, a registration's answer). ``source``: config
    (``steer.sae``) or runtime; ``clampable``: how many features requests may clamp (``features``: which, None: all);
    ``in_flight``: None in a registration's answer."""

    name: str
    source: str
    sites: list[str]
    d_sae: int
    activation: str
    k: int | None
    dtype: str
    modes: list[str]  # delta, reconstruct
    clampable: int
    features: list[int] | None
    in_flight: int | None = None


class SaeSlot(_Answer):
    """A site reserved for runtime SAEs (``steer.sae_slots``) and the SAE holding it (None: free)."""

    site: str
    clampable: int
    sae: str | None = None


class SaeList(_Answer):
    """``GET /v1/steering/sae``: the SAEs, and the sites reserved for runtime ones."""

    data: list[Sae]
    slots: list[SaeSlot] = []
    object: str = "list"


class Deleted(_Answer):
    """A delete's answer: the name deleted."""

    deleted: str


class AppliedModule(_Answer):
    """The named module a request used: its version when the request was prepared, and its strength (``scale``,
    or ``norm``: a fraction of each site's typical residual norm)."""

    name: str
    version: int | None = None
    scale: float | None = None
    norm: float | None = None


class Applied(_Answer):
    """A steered response's ``steering`` field (``frontend.applied_report``): the two phases' config keys (None:
    that phase unsteered), the module, the count of sites whose residual a vector moves, the SAEs clamped, whether a
    condition gates it, the count of sites with projections, and the capture consumer instances it feeds."""

    prefill: str | None = None
    decode: str | None = None
    module: AppliedModule | None = None
    sites: int = 0
    sae: list[str] | None = None
    condition: bool = False
    projections: int | None = None
    capture: list[str] | None = None


class Message(_Answer):
    """A chat choice's message."""

    role: str
    content: str | None = None


class Choice(_Answer):
    """One choice of a completion (``text``) or chat answer (``message``), with what was asked for (``logprobs``,
    ``prompt_logprobs``, ``token_ids`` / ``prompt_token_ids`` with ``return_token_ids``) as the server sent it."""

    index: int = 0
    text: str | None = None
    message: Message | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None
    prompt_logprobs: Any = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None

    @property
    def content(self) -> str:
        """The generated text, a completion's or a chat message's."""
        return (self.text if self.message is None else self.message.content) or ""


class Usage(_Answer):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Completion(_Answer):
    """``POST /v1/completions`` or ``/v1/chat/completions``: the choices, usage, what steering was applied
    (``steering``, None: unsteered), the capture consumers' results (``capture``: ``{instance: result}`` for one
    prompt, ``{request_id: {instance: result}}`` for several; None without capture), and the whole answer (``raw``)."""

    id: str
    model: str
    choices: list[Choice]
    object: str = ""
    created: int = 0
    usage: Usage | None = None
    steering: Applied | None = None
    capture: dict[str, Any] | None = None
    raw: dict[str, Any] = {}

    @property
    def text(self) -> str:
        """The first choice's text."""
        return self.choices[0].content if self.choices else ""

    @property
    def texts(self) -> list[str]:
        """Every choice's text, in index order."""
        return [c.content for c in sorted(self.choices, key=lambda c: c.index)]

    def as_dict(self) -> dict:
        """The whole answer as the server sent it."""
        return self.raw


def decoded(body: Any, kind: type[T]) -> T:
    """``body`` (parsed JSON) as ``kind``; a ``Completion`` keeps ``body`` as ``raw``."""
    out = msgspec.convert(body, kind)
    if isinstance(out, Completion):
        out.raw = body
    return out


prebuild(Status, Module, ModuleList, Sae, SaeList, Deleted, Completion)  # the Client's threads may decode at once
