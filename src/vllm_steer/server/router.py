"""The ``steer`` endpoint plugin: routes under /v1/steering on vLLM's OpenAI server.

HTTP surface only (vLLM's EndpointPlugin contract); engine work goes through
``engine_client.collective_rpc`` to the methods vllm_steer.runtime.worker_rpc adds to the workers.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from vllm_steer import __version__
from vllm_steer.core import gc_watch
from vllm_steer.core.compat import rpc_every_engine
from vllm_steer.core.config import steer_config_of
from vllm_steer.frontend.prepare import SteeringFrontend
from vllm_steer.frontend.module_registration import load_path, register_async
from vllm_steer.frontend.named_store import NameTakenError
from vllm_steer.frontend.module_store import MODULE_SYNC
from vllm_steer.frontend.sae_registry import SAE_SYNC
from vllm_steer.patches import apply_server
from vllm_steer.server.engine_metrics import EngineMetricsMiddleware
from vllm_steer.server.loop_watch import watch_running_loop
from vllm_steer.server.openai_fields import endpoint_attached
from vllm_steer.server.modules_routes import router as modules_router
from vllm_steer.server.request_body import SteeringRequestMiddleware
from vllm_steer.server.sae_routes import router as sae_router
from vllm_steer.server.schemas import SteeringStatus, document_request_fields
from vllm_steer.server.response_field import SteeringResponseMiddleware

router = APIRouter(prefix="/v1/steering", tags=["steering"])


@router.get("", responses={200: {"model": SteeringStatus}})
async def steering_status(raw: Request) -> JSONResponse:
    """Whether steering is on, its config, and each worker's view (pid, ops installed, rows)."""
    state = raw.app.state
    engine = getattr(state, "steer_engine_client", None)
    cfg = state.steer_config
    workers: list[Any] = []
    if engine is not None:
        workers = await rpc_every_engine(engine, "vllm_steer_status")  # every worker of every DP engine
    return JSONResponse(
        {
            "version": __version__,
            "enabled": cfg is not None,
            "model": _sites(state.steer_frontend.shape) if cfg is not None else None,
            "config": cfg.model_dump(mode="json", exclude={"api_key"}) if cfg else None,
            "workers": workers,
        }
    )


def _sites(shape: Any) -> dict:
    return {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size, "hooks": list(shape.hooks),
            "dtype": shape.dtype}


class SteeringEndpointPlugin:
    """Factory target of the ``vllm.endpoint_plugins`` entry point ``steer``."""

    name = "steer"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        apply_server()
        endpoint_attached()
        app.include_router(router)
        app.include_router(modules_router)
        app.include_router(sae_router)
        document_request_fields(app)
        app.add_middleware(EngineMetricsMiddleware)  # /metrics only: engine values fetched per scrape
        app.add_middleware(SteeringResponseMiddleware)
        app.add_middleware(SteeringRequestMiddleware)  # added last: runs first, before the holder opens

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        state.steer_engine_client = engine_client
        state.steer_api_servers = getattr(args, "api_server_count", None) or 1
        state.steer_engines = engine_client.vllm_config.parallel_config.data_parallel_size if engine_client else 1
        state.steer_config = steer_config_of(engine_client.vllm_config) if engine_client else None
        # Also with steering off: it answers steering fields with "steering is disabled" (400).
        state.steer_frontend = SteeringFrontend(engine_client.vllm_config) if engine_client else None
        if state.steer_config is None:
            return
        state.steer_loop_watch = watch_running_loop(state.steer_config.loop_stall_warn_s)
        gc_watch.install()  # VLLM_STEER_GC_WATCH: this process's slow collections logged (off by default)
        # Several API processes share the engine core's module and SAE registries (frontend.registry_sync).
        MODULE_SYNC.enabled = SAE_SYNC.enabled = state.steer_api_servers > 1
        # Start-up preload: before the server accepts requests.
        for name, path in state.steer_config.modules.items():
            module = load_path(name, path, state.steer_frontend.module_shape)  # steer.max_module_bytes
            try:
                await register_async(engine_client.collective_rpc, module, replace=False)
            except NameTakenError:  # another API process of this server loaded it first
                pass
        await MODULE_SYNC.refresh(engine_client.collective_rpc, state.steer_frontend.shape.hidden_size)
        await SAE_SYNC.refresh(engine_client.collective_rpc, state.steer_frontend)
