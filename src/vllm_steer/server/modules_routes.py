"""/v1/steering/modules: register (JSON, or a .safetensors / GGUF file upload), list, get, delete.

Errors use vLLM's error shape ``{"error": {"message", "type", "param", "code"}}``. Mutations need
``Authorization: Bearer <steer.api_key>`` when one is configured; reads follow vLLM's own
``--api-key`` (its middleware guards every /v1 path).
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_steer.frontend.module_registration import (
    check_replace,
    module_from_file,
    module_from_json,
    register_async,
    unregister_async,
)
from vllm_steer.frontend.module_store import STORE, ModuleExistsError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.server.errors import error_body

logger = logging.getLogger("vllm.steer")
router = APIRouter(prefix="/v1/steering/modules", tags=["steering"])


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _unauthorized(raw: Request) -> JSONResponse | None:
    cfg = raw.app.state.steer_config
    key = cfg.api_key if cfg is not None else None
    if key and raw.headers.get("authorization") != f"Bearer {key}":
        return error(401, "registering or deleting steering modules needs the steer api_key (Authorization: Bearer ...)")
    return None


async def _users(raw: Request) -> dict[str, int]:
    engine = raw.app.state.steer_engine_client
    per_core = await engine.collective_rpc("vllm_steer_module_users")  # answered by the engine core
    return per_core[0] if per_core else {}


@router.post("")
async def register(raw: Request) -> JSONResponse:
    if (denied := _unauthorized(raw)) is not None:
        return denied
    state = raw.app.state
    if state.steer_config is None:
        return error(400, "steering is disabled on this server")
    shape = state.steer_frontend.shape
    try:
        if raw.headers.get("content-type", "").startswith("multipart/form-data"):
            form = await raw.form()
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise SteeringSpecError("file", "a multipart registration needs a 'file' part")
            module = module_from_file(form.get("name"), await upload.read(), upload.filename or "",
                                      shape, form.get("description"))
            replace = check_replace(form.get("replace")) or check_replace(raw.query_params.get("replace"))
        else:
            try:
                body = json.loads(await raw.body())
            except (ValueError, RecursionError) as e:
                raise SteeringSpecError("body", f"invalid JSON: {str(e)[:200]}") from None
            if not isinstance(body, dict):
                raise SteeringSpecError("body", "expected a JSON object")
            module = module_from_json(body, shape)
            replace = check_replace(body.get("replace")) or check_replace(raw.query_params.get("replace"))
    except SteeringSpecError as e:
        return error(400, str(e), e.field)
    except Exception as e:  # no input may become a 500: name what was being read
        logger.exception("vllm-steer: reading a module registration failed")
        return error(400, f"could not read the module registration: {type(e).__name__}: {str(e)[:300]}",
                     "file" if raw.headers.get("content-type", "").startswith("multipart/") else "body")
    try:
        module = await register_async(state.steer_engine_client.collective_rpc, module, replace)
    except ModuleExistsError as e:
        return error(409, f"steering module {e.args[0]!r} exists; pass replace=true to replace it", "name")
    return JSONResponse(module.summary(), status_code=201)


@router.get("")
async def list_modules(raw: Request) -> JSONResponse:
    users = await _users(raw)
    data = [{**m.summary(), "in_flight": users.get(m.name, 0)} for m in STORE.all()]
    return JSONResponse({"object": "list", "data": data})


@router.get("/{name}")
async def get_module(name: str, raw: Request) -> JSONResponse:
    module = STORE.get(name)
    if module is None:
        return error(404, f"unknown steering module {name!r}", "name")
    users = await _users(raw)
    return JSONResponse({**module.summary(), "in_flight": users.get(name, 0)})


@router.delete("/{name}")
async def delete_module(name: str, raw: Request) -> JSONResponse:
    if (denied := _unauthorized(raw)) is not None:
        return denied
    if STORE.get(name) is None:
        return error(404, f"unknown steering module {name!r}", "name")
    await unregister_async(raw.app.state.steer_engine_client.collective_rpc, name)
    return JSONResponse({"deleted": name})
