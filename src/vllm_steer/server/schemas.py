"""The documented shapes of the /v1/steering routes, as vLLM's OpenAPI (``/openapi.json``, ``/docs``) shows them,
and the steering fields of ``/v1/completions`` and ``/v1/chat/completions`` (``document_request_fields``: added to
the schemas of vLLM's own request models when the document is built).

Documentation only: the routes parse and check their input by hand (their exact 4xx answers in vLLM's
error shape) and build their answers themselves. These models reach the OpenAPI through FastAPI's
hooks that validate nothing: ``responses=`` on the route decorators (``errors``) and
``openapi_extra`` (``request_body``) for the bodies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.frontend.module_registration import MAX_DESCRIPTION, NAME_PATTERN, NAME_RULE

Name = Annotated[str, Field(pattern=NAME_PATTERN.pattern, description=NAME_RULE)]
Description = Annotated[str, Field(max_length=MAX_DESCRIPTION)]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="e.g. BadRequestError, NotFoundError, ConflictError")
    param: str | None = Field(description="the field at fault (``steering_vectors.post_mlp.3``, ``file``, ``name``)")
    code: int = Field(description="the HTTP status")


class ErrorBody(BaseModel):
    """vLLM's error shape, for every refusal."""

    error: ErrorDetail


class PackedRows(BaseModel):
    """One hook's vectors packed: row i is added at ``layer_indices[i]`` (``vllm_steer.client.pack``)."""

    dtype: Literal["float32", "float16", "bfloat16"]
    shape: list[int] = Field(min_length=2, max_length=2, description="[n, hidden]")
    layer_indices: list[int]
    data: str = Field(description="the rows' little-endian bytes, base64")
    scales: list[float] | None = None
    norm: float | None = Field(None, description="instead of scales: each row scaled to norm x its site's typical "
                                                 "residual L2 norm (steer.site_norms)")


Tier = Annotated[dict[str, dict[str, list[float]] | PackedRows | list[float]],
                 Field(description=f"{{hook: {{layer: [floats]}}}} or {{hook: packed rows}}, hooks {list(HOOK_NAMES)}; "
                                   "and/or {site: [floats]}, a site 'post_mlp.12' or 'blocks.12.hook_resid_post'")]


class ModuleRegistration(BaseModel):
    """``POST /v1/steering/modules`` as JSON: at least one tier; unknown fields are a 400."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    description: Description | None = None
    steering_vectors: Tier | None = None
    prefill_steering_vectors: Tier | None = None
    decode_steering_vectors: Tier | None = None
    steering_condition: dict | None = Field(None, description="steer.conditions: a condition (as in requests) for "
                                                              "every request naming the module without its own")
    steering_projections: dict | None = Field(None, description="steer.max_projections: directions (ablate / cap) "
                                                                "as in requests, for every request naming the module")
    prefill_steering_projections: dict | None = None
    decode_steering_projections: dict | None = None
    as_ablation: bool = Field(False, description="the module's vectors become ablation directions at their sites")
    site_norms: dict[str, float] | None = Field(None, description="typical residual L2 norm per site ({'post_mlp.14': "
                                                                  "9.8}, what vllm-steer calibrate writes): what a "
                                                                  "request's steering_module.norm is relative to")
    replace: bool = Field(False, description="replace a module of that name (else 409)")


class ModuleUpload(BaseModel):
    """``POST /v1/steering/modules`` as a multipart upload."""

    file: bytes = Field(description=".safetensors (tensors [prefill.|decode.]<site>, the site <hook>.<layer> or "
                                    "blocks.<layer>.hook_resid_*), .json (the JSON registration's fields) or a GGUF "
                                    "control vector")
    name: Name
    description: Description | None = None
    replace: Literal["true", "false", "1", "0", "yes", "no"] | None = None
    as_ablation: Literal["true", "false", "1", "0", "yes", "no"] | None = Field(
        None, description="the file's vectors (e.g. a GGUF / repeng control vector) become ablation directions")
    site_norms: str | None = Field(None, description="JSON: typical residual norms per site (a vllm-steer calibrate "
                                                     "file's text); default: the file's metadata 'site_norms'")


class ModuleSummary(BaseModel):
    name: str
    description: str
    source: Literal["json", "safetensors", "gguf"]
    version: int
    hooks: list[str]
    layers: list[int]
    sites: dict[str, list[str]] = Field(description="per tier holding vectors, its sites ('post_mlp.12')")
    tiers: list[str]
    dtype: str
    bytes: int = Field(description="the module's float32 vectors, all tiers")
    created: float = Field(description="seconds since the epoch")
    condition: dict | None = Field(None, description="its steering_condition (an inline probe shown as its length)")
    projections: dict | None = Field(None, description="its projections: per field, per site, the ops' modes")
    site_norms: dict[str, float] | None = Field(None, description="typical residual norms its 'norm' strength reads")


class ModuleInfo(ModuleSummary):
    in_flight: int = Field(description="unfinished requests using it, queued ones included")


class ModuleList(BaseModel):
    object: Literal["list"]
    data: list[ModuleInfo]


class Deleted(BaseModel):
    deleted: str


class SaeRegistration(BaseModel):
    """``POST /v1/steering/sae``: a ``steer.sae`` entry (files inside ``steer.sae_root``) plus ``name``."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    path: str = Field(description="the SAE's files on the server, inside steer.sae_root (else 403)")
    format: Literal["gemma_scope", "sae_lens", "manifest", "sparsify", "dictionary_learning"] | None = Field(
        None, description="None: told by the files")
    site: str | None = Field(None, description="hook.layer (or blocks.L.hook_resid_*), one of steer.sae_slots")
    features: list[int] | None = Field(None, description="the features requests may clamp; None: all")
    reconstruct: bool = Field(False, description="requests may ask for mode reconstruct (a site reserved with "
                                                 "d_sae and reconstruct: true)")
    replace: bool = False


class SaeSummary(BaseModel):
    name: str
    source: Literal["config", "runtime"]
    sites: list[str]
    d_sae: int
    activation: str
    k: int | None
    dtype: str
    modes: list[Literal["delta", "reconstruct"]]
    clampable: int
    features: list[int] | None


class SaeInfo(SaeSummary):
    in_flight: int


class SaeSlot(BaseModel):
    site: str
    clampable: int
    sae: str | None = Field(description="the SAE holding it")


class SaeList(BaseModel):
    object: Literal["list"]
    data: list[SaeInfo]
    slots: list[SaeSlot]


class ModelSites(BaseModel):
    num_layers: int
    hidden_size: int = Field(description="the length of every steering vector")
    hooks: list[str] = Field(description="hook points enabled on this server")
    dtype: str


class SteeringStatus(BaseModel):
    version: str
    enabled: bool
    model: ModelSites | None = Field(description="what vectors must fit (null with steering off)")
    config: dict[str, Any] | None = Field(description="the steer block (its api_key left out)")
    workers: list[dict[str, Any]] = Field(description="each worker's view: pid, ops installed, rows")


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries: these statuses answer in vLLM's error shape."""
    return {status: {"model": ErrorBody} for status in statuses}


def _inlined(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` inlined (``openapi_extra`` bypasses components/schemas)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return inline(schema)


def _param(name: str, where: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "description": description, "schema": schema}


# ``openapi_extra`` of the ``/{name}`` routes: the handlers read the name from the request's path (a
# declared parameter would make FastAPI document a 422 the routes never answer: they answer 404)
NAMED = {"parameters": [_param("name", "path", "the module's or SAE's name", {"type": "string"})]}
# module registration's ``?replace=`` (also a body / form field): true/false/1/0/yes/no
REPLACE_QUERY = _param("replace", "query", "replace a module of this name (as the body's replace field)",
                       {"type": "string", "enum": ["true", "false", "1", "0", "yes", "no"]})


def request_body(**media: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring a route's body, ``json`` / ``form`` naming the models of its media types."""
    types = {"json": "application/json", "form": "multipart/form-data"}
    return {"requestBody": {"required": True,
                            "content": {types[k]: {"schema": _inlined(m)} for k, m in media.items()}}}


class SteeringFields(BaseModel):
    """The fields a completion or chat completion request may carry for steering (docs/requests.md)."""

    steering_vectors: Tier | None = Field(None, description="vectors added at every position")
    prefill_steering_vectors: Tier | None = Field(None, description="vectors added at prompt positions only")
    decode_steering_vectors: Tier | None = Field(None, description="vectors added at generated positions only")
    steering_module: dict[str, Any] | str | None = Field(
        None, description="a registered module: {name, scale | norm, layers?, hooks?} or its name")
    sae: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None, description="SAE feature clamps: {name, clamps: [{feature, mode, value}]} (docs/sae.md)")
    steering_condition: dict[str, Any] | None = Field(
        None, description="steering gated per token by a probe (docs/conditions.md)")
    steering_projections: dict[str, Any] | None = Field(
        None, description="directions ablated or capped at every position (docs/projections.md)")
    prefill_steering_projections: dict[str, Any] | None = Field(None, description="the same, prompt positions only")
    decode_steering_projections: dict[str, Any] | None = Field(None, description="the same, generated positions only")
    capture: dict[str, dict[str, Any]] | None = Field(
        None, description="{consumer instance: {layers, hooks | sites, positions, ...}} (docs/capture.md)")


COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


def document_request_fields(app: Any) -> None:
    """Wrap ``app.openapi`` so the request models of the completion routes list the steering fields."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        fields = _inlined(SteeringFields)["properties"]
        for path in COMPLETION_PATHS:
            body = schema.get("paths", {}).get(path, {}).get("post", {}).get("requestBody", {})
            model = body.get("content", {}).get("application/json", {}).get("schema", {})
            ref = model.get("$ref", "")
            target = schema.get("components", {}).get("schemas", {}).get(ref.rsplit("/", 1)[-1]) if ref else model
            if isinstance(target, dict):
                target.setdefault("properties", {}).update(fields)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
