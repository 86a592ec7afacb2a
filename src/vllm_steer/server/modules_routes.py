"""/v1/steering/modules: register (JSON, or a .safetensors / GGUF file upload), list, get, delete.

Errors use vLLM's error shape ``{"error": {"message", "type", "param", "code"}}``. Mutations need
``Authorization: Bearer <steer.api_key>`` when one is configured; reads follow vLLM's own
``--api-key`` (its middleware guards every /v1 path).

Limits: a registration body larger than ``steer.module_body_cap`` (2 x ``max_module_bytes`` +
1 MiB) is a 413 before it is read further (declared length first, then as it arrives); a module
over ``max_module_bytes`` a 413 naming the field; a new name beyond ``max_modules`` a 409. 409,
not 507: the refusal comes from the collection's current state, which the client can change
(delete a module, or replace an existing name, which is not a new module); it is no server
failure, and a retry without a change cannot succeed (clients retry 5xx).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_steer.frontend.module_registration import (
    check_replace,
    module_from_file,
    module_from_json,
    register_async,
    unregister_async,
)
from vllm_steer.frontend.module_store import MODULE_SYNC, STORE
from vllm_steer.frontend.named_store import NameLimitError, NameTakenError
from vllm_steer.core.compat import counts_of_every_engine
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.server.request_body import BodyTooLarge, drain_refused_body
from vllm_steer.server.errors import error, mutation_denied
from vllm_steer.server.schemas import (
    Deleted,
    ModuleInfo,
    ModuleList,
    ModuleRegistration,
    ModuleSummary,
    ModuleUpload,
    NAMED,
    REPLACE_QUERY,
    errors,
    request_body,
)

logger = logging.getLogger("vllm.steer")
router = APIRouter(prefix="/v1/steering/modules", tags=["steering"])


async def _users(raw: Request) -> dict[str, int]:
    return await counts_of_every_engine(raw.app.state.steer_engine_client, "vllm_steer_module_users")


async def _synced(raw: Request) -> None:
    """This process's store brought up to the engine core's registry (several API processes)."""
    state = raw.app.state
    if state.steer_frontend is not None:
        await MODULE_SYNC.refresh(state.steer_engine_client.collective_rpc, state.steer_frontend.shape.hidden_size)


def _capped(receive: Any, cap: int) -> Any:
    """A receive callable that raises BodyTooLarge once more than ``cap`` body bytes arrived."""
    size = 0

    async def capped() -> dict:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > cap:
            raise BodyTooLarge(whole=not message.get("more_body"))
        return message

    return capped


@router.post("", status_code=201, responses={201: {"model": ModuleSummary}, **errors(400, 401, 409, 413)},
             openapi_extra={**request_body(json=ModuleRegistration, form=ModuleUpload), "parameters": [REPLACE_QUERY]})
async def register(raw: Request) -> JSONResponse:
    if (denied := mutation_denied(raw, "registering or deleting steering modules")) is not None:
        return denied
    state = raw.app.state
    cfg = state.steer_config
    if cfg is None:
        return error(400, "steering is disabled on this server")
    shape = state.steer_frontend.module_shape
    multipart = raw.headers.get("content-type", "").startswith("multipart/")
    try:
        declared = int(raw.headers.get("content-length", "0"))
    except ValueError:
        declared = 0
    body_field, cap = ("file" if multipart else "body"), cfg.module_body_cap
    try:
        if declared > cap:
            raise BodyTooLarge
        request = Request(raw.scope, _capped(raw.receive, cap))
        if multipart:
            async with request.form() as form:
                upload = form.get("file")
                if upload is None or isinstance(upload, str):
                    raise SteeringSpecError("file", "a multipart registration needs a 'file' part")
                module = module_from_file(form.get("name"), await upload.read(), upload.filename or "",
                                          shape, form.get("description"), cfg.conditions, cfg.max_projections,
                                          form.get("as_ablation"), form.get("site_norms"))
                replace = check_replace(form.get("replace")) or check_replace(raw.query_params.get("replace"))
        else:
            try:
                body = json.loads(await request.body())
            except (ValueError, RecursionError) as e:
                raise SteeringSpecError("body", f"invalid JSON: {str(e)[:200]}") from None
            if not isinstance(body, dict):
                raise SteeringSpecError("body", "expected a JSON object")
            module = module_from_json(body, shape, cfg.conditions, cfg.max_projections)
            replace = check_replace(body.get("replace")) or check_replace(raw.query_params.get("replace"))
    except BodyTooLarge as e:
        await drain_refused_body(raw.receive, dict(raw.scope.get("headers") or []), e)
        return error(413, f"module registration larger than the server's cap of {cap} bytes "
                          f"(2 x steer.max_module_bytes + 1 MiB); not read further", body_field)
    except SteeringSpecError as e:  # SteeringTooLarge: 413
        return error(e.status, str(e), e.field)
    except Exception as e:  # no input may become a 500: name what was being read
        logger.exception("vllm-steer: reading a module registration failed")
        return error(400, f"could not read the module registration: {type(e).__name__}: {str(e)[:300]}", body_field)
    try:
        await _synced(raw)
        module = await register_async(state.steer_engine_client.collective_rpc, module, replace, cfg.max_modules)
    except NameTakenError as e:
        return error(409, f"steering module {e.args[0]!r} exists; pass replace=true to replace it", "name")
    except NameLimitError as e:
        return error(409, f"the server holds steer.max_modules ({e.limit}) steering modules; delete one "
                          "or replace an existing name", "name")
    return JSONResponse(module.summary(), status_code=201)


@router.get("", responses={200: {"model": ModuleList}})
async def list_modules(raw: Request) -> JSONResponse:
    await _synced(raw)
    users = await _users(raw)
    data = [{**m.summary(), "in_flight": users.get(m.name, 0)} for m in STORE.all()]
    return JSONResponse({"object": "list", "data": data})


@router.get("/{name}", responses={200: {"model": ModuleInfo}, **errors(404)}, openapi_extra=NAMED)
async def get_module(raw: Request) -> JSONResponse:
    name = raw.path_params["name"]
    await _synced(raw)
    module = STORE.get(name)
    if module is None:
        return error(404, f"unknown steering module {name!r}", "name")
    users = await _users(raw)
    return JSONResponse({**module.summary(), "in_flight": users.get(name, 0)})


@router.delete("/{name}", responses={200: {"model": Deleted}, **errors(401, 404)}, openapi_extra=NAMED)
async def delete_module(raw: Request) -> JSONResponse:
    name = raw.path_params["name"]
    if (denied := mutation_denied(raw, "registering or deleting steering modules")) is not None:
        return denied
    await _synced(raw)
    if STORE.get(name) is None or await unregister_async(raw.app.state.steer_engine_client.collective_rpc,
                                                         name) is None:
        return error(404, f"unknown steering module {name!r}", "name")
    return JSONResponse({"deleted": name})
