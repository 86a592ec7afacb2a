"""Building and (un)registering named modules: validate the input, ship the tiers to every worker
once (``collective_rpc``), then publish the name. The same steps serve the HTTP routes (async
engine client), start-up preload, and Python users of ``vllm.LLM`` (sync)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Awaitable, Callable

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.payload import tiers_to_wire
from vllm_steer.core.vectors import TIER_FIELDS
from vllm_steer.frontend.module_store import STORE, ModuleExistsError, SteeringModule
from vllm_steer.frontend.module_files import read_gguf_control_vector, read_safetensors
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


def module_from_json(body: dict, shape: ModelShape) -> SteeringModule:
    extra = set(body) - {"name", "description", "replace", *TIER_FIELDS}
    if extra:
        raise SteeringSpecError(sorted(extra)[0], "unknown field in a module registration")
    name = check_name(body.get("name"))
    description = check_description(body.get("description"))
    check_replace(body.get("replace"))
    spec = parse_spec({k: body.get(k) for k in TIER_FIELDS}, shape)
    if not any(spec.tiers.values()):
        raise SteeringSpecError("steering_vectors", "a module needs at least one vector")
    return SteeringModule(name, spec.tiers, description, "json", dtype=shape.dtype)


def _json_file(name: str, data: bytes, shape: ModelShape, description: str) -> SteeringModule:
    """A .json module file: the registration object's fields; its errors are named under ``file``."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SteeringSpecError("file", f"not a readable JSON module file: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise SteeringSpecError("file", "a JSON module file holds an object of steering fields")
    try:
        module = module_from_json({**body, "name": name}, shape)
    except SteeringSpecError as e:
        if e.field == "name":
            raise
        raise SteeringSpecError(f"file.{e.field}", str(e).split(": ", 1)[-1]) from None
    if description:
        module.description = description
    return module


def module_from_file(name: str, data: bytes, filename: str, shape: ModelShape, description: str = "") -> SteeringModule:
    check_name(name)
    description = check_description(description or None)
    if data[:4] == GGUF_MAGIC or filename.endswith(".gguf"):
        tiers, meta = read_gguf_control_vector(data, shape)
        source = "gguf"
    elif filename.endswith(".json"):
        return _json_file(name, data, shape, description)
    elif filename.endswith(".safetensors") or not filename:
        tiers, meta = read_safetensors(data, shape)
        source = "safetensors"
    else:
        raise SteeringSpecError("file", f"unsupported module file {filename!r}: expected .safetensors, .gguf or .json")
    return SteeringModule(name, tiers, description or meta.get("description", ""), source, dtype=shape.dtype)


def _register_args(module: SteeringModule) -> tuple:
    keys = [k for k in module.keys if k is not None]
    return (module.name, module.version, tiers_to_wire(module.tiers), keys)


def prepare(module: SteeringModule, replace: bool) -> SteeringModule:
    """Give the module its version; refuse an existing name unless ``replace`` (409)."""
    if STORE.get(module.name) is not None and not replace:
        raise ModuleExistsError(module.name)
    module.version = STORE.reserve_version()
    return module


async def register_async(rpc: Callable[..., Awaitable[Any]], module: SteeringModule, replace: bool) -> SteeringModule:
    prepare(module, replace)
    await rpc("vllm_steer_register_module", args=_register_args(module))
    return STORE.publish(module)  # only now can a request name it (workers already have it)


def register_sync(rpc: Callable[..., Any], module: SteeringModule, replace: bool) -> SteeringModule:
    prepare(module, replace)
    rpc("vllm_steer_register_module", args=_register_args(module))
    return STORE.publish(module)


async def unregister_async(rpc: Callable[..., Awaitable[Any]], name: str) -> SteeringModule:
    module = STORE.remove(name)  # new requests are refused from here on
    await rpc("vllm_steer_unregister_module", args=(name,))
    return module


def load_path(name: str, path: str, shape: ModelShape) -> SteeringModule:
    p = Path(path)
    return module_from_file(name, p.read_bytes(), p.name, shape)


def register_module(llm: Any, name: str, replace: bool = False, description: str = "", **tiers: Any) -> dict:
    """Register a named module on a ``vllm.LLM`` (tiers as in requests: ``steering_vectors=...``)."""
    from vllm_steer.frontend.prepare import SteeringFrontend

    shape = SteeringFrontend(llm.llm_engine.vllm_config).shape
    module = module_from_json({"name": name, "description": description, **tiers}, shape)
    return register_sync(llm.collective_rpc, module, replace).summary()
