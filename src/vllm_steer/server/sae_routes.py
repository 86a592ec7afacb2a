"""/v1/steering/sae: list the SAEs requests may clamp, register one at a reserved site (JSON naming
its files on the server, inside steer.sae_root: 403 otherwise), get and delete one. Errors use vLLM's error shape; mutations need the steer
api_key like module mutations. Engine work goes through ``frontend.sae_registration``; with several API
processes each route first brings this process's SAEs up to the engine core's (``SAE_SYNC``, ``frontend.sae_registry``)."""

from __future__ import annotations

import json
import logging
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_steer.core.compat import counts_of_every_engine, rpc_every_engine
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import SlotError
from vllm_steer.core.sae_paths import SaePathError
from vllm_steer.frontend.sae_registration import (
    SaeExistsError,
    register_sae_async,
    sae_summary,
    unregister_sae_async,
)
from vllm_steer.frontend.sae_registry import REGISTRY, SAE_SYNC
from vllm_steer.server.errors import error, mutation_denied
from vllm_steer.server.metrics import SAE_REFUSED
from vllm_steer.server.schemas import NAMED, Deleted, SaeInfo, SaeList, SaeRegistration, SaeSummary, errors, request_body

logger = logging.getLogger("vllm.steer")
router = APIRouter(prefix="/v1/steering/sae", tags=["steering"])


_LABELS = {"body", "name", "path", "format", "site", "features", "reconstruct", "replace"}  # a bounded label set


def _refused(status: int, message: str, field: str | None = None) -> JSONResponse:
    """A refused registration: counted on /metrics (``vllm_steer_sae_registrations_refused_total``)."""
    top = (field or "body").split(".")[0]
    SAE_REFUSED.labels(status=str(status), field=top if top in _LABELS else "other").inc()
    return error(status, message, field)


async def _users(raw: Request) -> dict[str, int]:
    return await counts_of_every_engine(raw.app.state.steer_engine_client, "vllm_steer_sae_users", "names")


def _frontend(raw: Request):
    return getattr(raw.app.state, "steer_frontend", None)


async def _synced(raw: Request):
    """The front end, its runtime SAEs brought up to the engine core's registry (several API processes)."""
    frontend = _frontend(raw)
    if frontend is not None and raw.app.state.steer_engine_client is not None:
        await SAE_SYNC.refresh(raw.app.state.steer_engine_client.collective_rpc, frontend)
    return frontend


@router.get("", responses={200: {"model": SaeList}})
async def list_sae(raw: Request) -> JSONResponse:
    """Every SAE requests may clamp (``steer.sae`` and registered ones), and the reserved sites."""
    frontend = await _synced(raw)
    catalog = frontend.sae if frontend is not None else {}
    users = await _users(raw) if catalog and raw.app.state.steer_engine_client is not None else {}
    data = [{**sae_summary(e), "in_flight": users.get(name, 0)} for name, e in catalog.items()]
    slots = [{"site": f"{h}.{l}", "clampable": slot.features, "sae": REGISTRY.holder((h, l))}
             for (h, l), slot in (frontend.sae_slots if frontend is not None else {}).items()]
    return JSONResponse({"object": "list", "data": data, "slots": slots})


@router.get("/{name}", responses={200: {"model": SaeInfo}, **errors(404)}, openapi_extra=NAMED)
async def get_sae(raw: Request) -> JSONResponse:
    name = raw.path_params["name"]
    frontend = await _synced(raw)
    entry = (frontend.sae if frontend is not None else {}).get(name)
    if entry is None:
        return error(404, f"unknown SAE {name!r}", "name")
    return JSONResponse({**sae_summary(entry), "in_flight": (await _users(raw)).get(name, 0)})


@router.post("", status_code=201, responses={201: {"model": SaeSummary}, **errors(400, 401, 403, 409)},
             openapi_extra=request_body(json=SaeRegistration))
async def register(raw: Request) -> JSONResponse:
    if (denied := mutation_denied(raw, "registering or deleting SAEs")) is not None:
        return denied
    frontend = _frontend(raw)
    if raw.app.state.steer_config is None or frontend is None:
        return error(400, "steering is disabled on this server")
    if not frontend.sae_slots:
        return _refused(409, "this server reserved no site for runtime SAEs (start it with steer.sae_slots)", "site")
    client = raw.app.state.steer_engine_client
    # data parallelism: every engine answers for itself before any stages the SAE
    rpc_each = partial(rpc_every_engine, client) if getattr(raw.app.state, "steer_engines", 1) > 1 else None
    try:
        body = json.loads(await raw.body())
        if not isinstance(body, dict):
            raise SteeringSpecError("body", "expected a JSON object")
        entry = await register_sae_async(client.collective_rpc, frontend, body, rpc_each)
    except (ValueError, RecursionError) as e:
        if isinstance(e, SteeringSpecError):
            return _refused(400, str(e), e.field)
        return _refused(400, f"invalid JSON: {str(e)[:200]}", "body")
    except SaePathError as e:  # one answer whatever the reason: it never tells whether a file exists
        return _refused(403, str(e), "path")
    except SaeExistsError as e:
        return _refused(409, e.args[0], "name")
    except SlotError as e:
        return _refused(409, str(e), "site")
    except Exception as e:  # no input may become a 500: name what was being read
        logger.exception("vllm-steer: an SAE registration failed")
        return _refused(400, f"could not register the SAE: {type(e).__name__}: {str(e)[:300]}", "body")
    return JSONResponse(sae_summary(entry), status_code=201)


@router.delete("/{name}", responses={200: {"model": Deleted}, **errors(401, 404, 409)}, openapi_extra=NAMED)
async def delete(raw: Request) -> JSONResponse:
    name = raw.path_params["name"]
    if (denied := mutation_denied(raw, "registering or deleting SAEs")) is not None:
        return denied
    frontend = _frontend(raw)
    if frontend is not None and name in frontend.sae_config:
        return error(409, f"SAE {name!r} was loaded at start-up (steer.sae) and cannot be deleted", "name")
    if frontend is None or await unregister_sae_async(raw.app.state.steer_engine_client.collective_rpc, frontend,
                                                      name) is None:
        return error(404, f"unknown SAE {name!r}", "name")
    return JSONResponse({"deleted": name})
