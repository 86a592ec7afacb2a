"""Building and (un)registering named modules: validate the input, ship the tiers to every worker
once (``collective_rpc``), then publish the name. The same steps serve the HTTP routes (async
engine client), start-up preload, and Python users of ``vllm.LLM`` (sync).

Limits (``steer.max_modules``, ``steer.max_module_bytes``): modules are parsed against the
*module* shape (``SteeringFrontend.module_shape``, whose ``max_bytes`` is ``max_module_bytes``),
so a module over the byte cap raises SteeringTooLarge naming the field (413 over HTTP); a new
name beyond ``max_modules`` raises NameLimitError (409)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Awaitable, Callable

from vllm_steer.core.rpc import Name, RegisterModule, call_args
from vllm_steer.core.config import SteerConfigError, upload_cap
from vllm_steer.core.errors import SteeringSpecError, SteeringTooLarge
from vllm_steer.core.payload import tiers_to_wire
from vllm_steer.core.site_norms import METADATA_KEY, Norms, as_json, parse_norms
from vllm_steer.core.vectors import CONDITION_FIELD, PROJECTION_FIELDS, TIER_FIELDS
from vllm_steer.frontend.condition_spec import module_condition
from vllm_steer.frontend.module_store import MODULE_SYNC, STORE, SteeringModule
from vllm_steer.frontend.named_store import NameLimitError, NameTakenError
from vllm_steer.frontend.module_files import read_gguf_control_vector, read_safetensors
from vllm_steer.frontend.projection_spec import ablations_of, module_projections
from vllm_steer.frontend.spec import ModelShape, parse_spec

GGUF_MAGIC = b"GGUF"


NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
NAME_RULE = "1 to 128 letters, digits, '-', '_' or '.', not starting with '.'"
MAX_DESCRIPTION = 4096


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 64 else repr(name[:64]) + "..."
        raise SteeringSpecError("name", f"a module name is {NAME_RULE}; got {shown}")
    return name


def check_description(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_DESCRIPTION:
        raise SteeringSpecError("description", f"expected a string of at most {MAX_DESCRIPTION} characters")
    return value


def check_replace(value: Any) -> bool:
    """``replace``: a JSON boolean, or in a form / query string one of true/false/1/0/yes/no."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
        return value.lower() in ("1", "true", "yes")
    raise SteeringSpecError("replace", f"expected true or false, got {value!r}")


def check_as_ablation(value: Any) -> bool:
    """``as_ablation``: the module's vectors become ablation directions at their sites (a GGUF / repeng
    control vector used to remove its direction); JSON boolean, or true/false/1/0/yes/no in a form."""
    try:
        return check_replace(value)
    except SteeringSpecError:
        raise SteeringSpecError("as_ablation", f"expected true or false, got {value!r}") from None


def with_projections(module: SteeringModule, fields: dict, shape: ModelShape, max_projections: int,
                     as_ablation: bool) -> SteeringModule:
    """The module with its projections: ``fields``' projection fields (checked as a request's), and, with
    ``as_ablation``, its vectors turned into ablations (it then adds no vector)."""
    if as_ablation:
        if any(fields.get(f) is not None for f in PROJECTION_FIELDS):
            raise SteeringSpecError("as_ablation", "a module given as an ablation takes its directions from its "
                                                   "vectors: leave out the projection fields")
        fields = ablations_of(module.tiers)
        module.tiers = {t: {} for t in TIER_FIELDS}
    module.projections = module_projections(fields, shape, max_projections)
    return module


def module_from_json(body: dict, shape: ModelShape, conditions: bool = False, max_projections: int = 0) -> SteeringModule:
    """A module from its JSON registration; ``conditions`` (``steer.conditions``): it may carry a
    ``steering_condition`` for the requests that name it; ``max_projections`` (``steer.max_projections``):
    projection fields (as in requests), or ``as_ablation``."""
    extra = set(body) - {"name", "description", "replace", "as_ablation", "site_norms", CONDITION_FIELD,
                         *TIER_FIELDS, *PROJECTION_FIELDS}
    if extra:
        raise SteeringSpecError(sorted(extra)[0], "unknown field in a module registration")
    name = check_name(body.get("name"))
    description = check_description(body.get("description"))
    check_replace(body.get("replace"))
    try:
        spec = parse_spec({k: body.get(k) for k in TIER_FIELDS}, shape)
    except SteeringTooLarge as e:  # a tier (or one packed hook) alone is over the cap
        raise SteeringTooLarge(e.field, f"{str(e).split(': ', 1)[-1]} (steer.max_module_bytes)") from None
    module = SteeringModule(name, spec.tiers, description, "json", dtype=shape.dtype,
                            site_norms=check_site_norms(body.get("site_norms"), shape))
    with_projections(module, body, shape, max_projections, check_as_ablation(body.get("as_ablation")))
    if not module.has_vectors and not module.projections:
        raise SteeringSpecError("steering_vectors", "a module needs at least one vector (or projection)")
    if body.get(CONDITION_FIELD) is not None:
        module.condition = module_condition(body[CONDITION_FIELD], module, shape,
                                            {m.name: m for m in STORE.all()}, conditions)
    sizes = {t: sum(v.nbytes for ls in vecs.values() for v in ls.values()) for t, vecs in spec.tiers.items()}
    check_module(module, shape, max(sizes, key=sizes.__getitem__))
    return module


def check_site_norms(raw: Any, shape: ModelShape, field: str = "site_norms") -> Norms | None:
    """A registration's ``site_norms`` (``{"post_mlp.14": 9.8}``, or the JSON text of a file ``vllm-steer
    calibrate`` wrote, as a form field sends it): the typical norms its ``norm`` strength reads; None: none."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise SteeringSpecError(field, f"not JSON: {str(e)[:200]}") from None
    return parse_norms(raw, field, shape.num_layers)


def check_module(module: SteeringModule, shape: ModelShape, field: str) -> None:
    """SteeringTooLarge (naming ``field``) when the module's float32 vectors exceed the cap;
    SteeringSpecError when its rows at scale 1 do not fit the model's dtype (e.g. float16's 65504)."""
    if module.nbytes > shape.max_bytes:
        raise SteeringTooLarge(field, f"the module holds {module.nbytes} bytes of float32 vectors, over "
                                      f"the server's cap of {shape.max_bytes} (steer.max_module_bytes)")
    try:
        module.keys
    except ValueError as e:
        raise SteeringSpecError(field, str(e)) from None


def _json_file(name: str, data: bytes, shape: ModelShape, description: str, conditions: bool,
               max_projections: int, as_ablation: bool = False) -> SteeringModule:
    """A .json module file: the registration object's fields (``as_ablation``: the registration's flag, applied
    as the file's own would be); its errors are named under ``file``."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SteeringSpecError("file", f"not a readable JSON module file: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise SteeringSpecError("file", "a JSON module file holds an object of steering fields")
    try:
        module = module_from_json({**body, "name": name, **({"as_ablation": True} if as_ablation else {})}, shape,
                                  conditions, max_projections)
    except SteeringSpecError as e:
        if e.field == "name":
            raise
        raise type(e)(f"file.{e.field}", str(e).split(": ", 1)[-1]) from None
    if description:
        module.description = description
    return module


def module_from_file(name: str, data: bytes, filename: str, shape: ModelShape, description: str = "",
                     conditions: bool = False, max_projections: int = 0, as_ablation: Any = None,
                     site_norms: Any = None) -> SteeringModule:
    """A module from a file (``as_ablation``: its vectors become ablation directions, e.g. a GGUF / repeng
    control vector's); safetensors files may carry projections (``module_files``) and their typical
    norms (metadata ``site_norms``, what ``vllm-steer extract`` writes); ``site_norms`` (the registration's)
    wins over the file's."""
    norms = check_site_norms(site_norms, shape)
    check_name(name)
    description = check_description(description or None)
    ablation = check_as_ablation(as_ablation)
    projections: dict = {}
    if data[:4] == GGUF_MAGIC or filename.endswith(".gguf"):
        tiers, meta = read_gguf_control_vector(data, shape)
        source = "gguf"
    elif filename.endswith(".json"):
        module = _json_file(name, data, shape, description, conditions, max_projections, ablation)
        module.site_norms = norms or module.site_norms
        return module
    elif filename.endswith(".safetensors") or not filename:
        tiers, meta, projections = read_safetensors(data, shape)
        source = "safetensors"
    else:
        raise SteeringSpecError("file", f"unsupported module file {filename!r}: expected .safetensors, .gguf or .json")
    if norms is None and meta.get(METADATA_KEY):
        norms = check_site_norms(meta[METADATA_KEY], shape, f"file.metadata.{METADATA_KEY}")
    module = SteeringModule(name, tiers, description or meta.get("description", ""), source, dtype=shape.dtype,
                            site_norms=norms)
    try:
        with_projections(module, projections, shape, max_projections, ablation)
    except SteeringSpecError as e:
        if e.field == "as_ablation":
            raise
        raise type(e)(f"file.{e.field}", str(e).split(": ", 1)[-1]) from None
    check_module(module, shape, "file")
    return module


def _register_args(module: SteeringModule, replace: bool, max_modules: int | None) -> tuple:
    """The RPC's arguments: the workers' four, and what the engine core's registry decides on."""
    keys = [k for k in module.keys if k is not None]
    meta = {"description": module.description, "source": module.source, "dtype": module.dtype,
            "created": module.created, "condition": module.condition, "projections": module.projections,
            "site_norms": as_json(module.site_norms) if module.site_norms else None}
    policy = {"replace": replace, "max_modules": max_modules, "meta": meta}
    return call_args(RegisterModule(module.name, module.version, tiers_to_wire(module.tiers), keys, policy))


def _refused(answers: list | None) -> dict | None:
    """The engine core's refusal, if it gave one instead of the workers' answers."""
    return next((a for a in answers or () if isinstance(a, dict) and "refused" in a), None)


def _raise_refusal(name: str, refusal: dict) -> None:
    if refusal["refused"] == "limit":
        raise NameLimitError(refusal["limit"])
    raise NameTakenError(name)  # "exists" (another API process registered it) or "stale"


def prepare(module: SteeringModule, replace: bool, max_modules: int | None = None) -> SteeringModule:
    """Claim the name and give the module its version: an existing name without ``replace`` is a
    NameTakenError, a new name beyond ``max_modules`` a NameLimitError (both 409)."""
    STORE.claim(module.name, replace, max_modules)
    module.version = STORE.next_version()
    return module


STALE_RETRIES = 3  # another process replaced the name with a newer version meanwhile: take a newer one


async def register_async(rpc: Callable[..., Awaitable[Any]], module: SteeringModule, replace: bool,
                         max_modules: int | None = None) -> SteeringModule:
    async with MODULE_SYNC.lock:  # a registry pull of this process never undoes this publish
        prepare(module, replace, max_modules)
        try:
            for _ in range(STALE_RETRIES):
                refusal = _refused(await rpc("vllm_steer_register_module",
                                             args=_register_args(module, replace, max_modules)))
                if refusal is None or refusal["refused"] != "stale":
                    break
                module.version = STORE.next_version()
            if refusal is not None:
                _raise_refusal(module.name, refusal)
        except BaseException:
            STORE.unclaim(module.name)
            raise
        return STORE.publish(module)  # only now can a request name it (workers already have it)


def register_sync(rpc: Callable[..., Any], module: SteeringModule, replace: bool,
                  max_modules: int | None = None) -> SteeringModule:
    prepare(module, replace, max_modules)
    try:
        refusal = _refused(rpc("vllm_steer_register_module", args=_register_args(module, replace, max_modules)))
        if refusal is not None:
            _raise_refusal(module.name, refusal)
    except BaseException:
        STORE.unclaim(module.name)
        raise
    return STORE.publish(module)


async def unregister_async(rpc: Callable[..., Awaitable[Any]], name: str) -> SteeringModule | None:
    """Delete ``name``; None when it was not registered (another API process deleted it first)."""
    async with MODULE_SYNC.lock:
        module = STORE.drop(name)  # new requests of this process are refused from here on
        answers = await rpc("vllm_steer_unregister_module", args=call_args(Name(name)))
    return None if _refused(answers) is not None or module is None else module


def load_path(name: str, path: str, shape: ModelShape) -> SteeringModule:
    """A start-up preload (``steer.modules``), ``shape`` the module shape: a file or module over
    the byte cap is a SteerConfigError naming the key (a file too large is not read)."""
    p = Path(path)
    where = f"additional_config.steer.modules.{name}"
    size, cap = p.stat().st_size, upload_cap(shape.max_bytes)
    if size > cap:
        raise SteerConfigError(f"{where}: {path} is {size} bytes, more than a module of at most "
                               f"steer.max_module_bytes ({shape.max_bytes}) needs ({cap}); not read")
    try:
        return module_from_file(name, p.read_bytes(), p.name, shape)
    except SteeringTooLarge as e:
        raise SteerConfigError(f"{where}: {path}: {str(e).split(': ', 1)[-1]}") from None


def register_module(llm: Any, name: str, replace: bool = False, description: str = "", **tiers: Any) -> dict:
    """Register a named module on a ``vllm.LLM`` (tiers as in requests: ``steering_vectors=...``,
    ``steering_condition=...`` under ``steer.conditions``, ``steering_projections=...`` or ``as_ablation=True``
    under ``steer.max_projections``)."""
    from vllm_steer.frontend.prepare import SteeringFrontend

    frontend = SteeringFrontend(llm.llm_engine.vllm_config)
    conditions = frontend.cfg is not None and frontend.cfg.conditions
    max_projections = frontend.cfg.max_projections if frontend.cfg is not None else 0
    module = module_from_json({"name": name, "description": description, **tiers}, frontend.module_shape, conditions,
                              max_projections)
    max_modules = frontend.cfg.max_modules if frontend.cfg is not None else None
    return register_sync(llm.collective_rpc, module, replace, max_modules).summary()


def unregister_module(llm: Any, name: str) -> dict:
    """Delete a named module of a ``vllm.LLM`` (as ``DELETE /v1/steering/modules/{name}``); KeyError
    for an unknown name. Requests already using it finish with it."""
    module = STORE.drop(name)
    if module is None:
        raise KeyError(f"unknown steering module {name!r}")
    llm.collective_rpc("vllm_steer_unregister_module", args=call_args(Name(name)))
    return module.summary()
