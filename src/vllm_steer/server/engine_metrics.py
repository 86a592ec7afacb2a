"""Engine-side values on ``/metrics``, fetched only when it is scraped: nothing runs per step.

A pure ASGI middleware in front of vLLM's ``/metrics`` asks the engine core
(``collective_rpc("vllm_steer_metrics")`` to every engine core, answered between steps by ``engine.metrics_rpc``,
summed over data-parallel engines) and
writes the answer into ``server.metrics`` before vLLM renders the page; the API process's own values
(module and SAE counts) are set at the same time. One question at a time per API process: a scrape
waits at most ``WAIT_S`` from when the question was asked, else it is served the last values; a late
answer is still written (no counter increment is lost). A question unanswered for ``STALE_S`` is left
to land on its own and a new one is asked, so a lost or stuck answer delays the values by at most
``STALE_S``, never for good, and a busy or dead engine gets one question per ``STALE_S`` (scrapes
never hang or pile up). ``vllm_steer_engine_metrics_updated_seconds`` says when values last came in."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from vllm_steer.core.compat import rpc_every_engine
from vllm_steer.frontend.module_store import STORE
from vllm_steer.frontend.sae_registry import REGISTRY as SAE_REGISTRY
from vllm_steer.server.metrics import MODULES, ROWS_CAPACITY, SAE_SLOTS, SAES, apply_engine

logger = logging.getLogger("vllm.steer")

WAIT_S = 2.0
STALE_S = 10.0


def merge_engines(answers: list[dict]) -> dict:
    """One report from each engine core's answer: data-parallel engines each hold their own rows,
    captures and counters, so gauges and increments are summed over engines."""
    merged: dict = {"gauges": {}, "increments": {}}
    for answer in answers:
        for part in ("gauges", "increments"):
            for name, value in answer.get(part, {}).items():
                merged[part][name] = merged[part].get(name, 0) + value
    return merged


class _Fetcher:
    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.asked = 0.0
        self.failing = False
        self._late: set[asyncio.Task] = set()  # questions past STALE_S, kept referenced until they land

    async def refresh(self, engine: Any) -> None:
        now = time.monotonic()
        if self.task is not None and not self.task.done() and now - self.asked > STALE_S:
            logger.warning("vllm-steer: the engine has not answered /metrics for %.0f s; asking again", now - self.asked)
            self._late.add(self.task)
            self.task.add_done_callback(self._late.discard)
            self.task = None
        if self.task is None or self.task.done():
            self.asked = now
            self.task = asyncio.ensure_future(self._ask(engine))
        wait = self.asked + WAIT_S - time.monotonic()
        if wait > 0:
            await asyncio.wait({self.task}, timeout=wait)  # never cancels the question

    async def _ask(self, engine: Any) -> None:
        try:
            apply_engine(merge_engines(await rpc_every_engine(engine, "vllm_steer_metrics")))
        except Exception as e:  # engine dead or restarting: keep the last values
            if not self.failing:
                logger.warning("vllm-steer: the engine did not answer for /metrics (%s: %s); serving the last "
                               "values", type(e).__name__, e)
            self.failing = True
            return
        self.failing = False


_FETCHER = _Fetcher()


class EngineMetricsMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope.get("path", "").rstrip("/") == "/metrics":
            state = scope["app"].state
            cfg = getattr(state, "steer_config", None)
            engine = getattr(state, "steer_engine_client", None)
            if cfg is not None and engine is not None:
                frontend = getattr(state, "steer_frontend", None)
                ROWS_CAPACITY.set(cfg.usable_rows * getattr(state, "steer_engines", 1))
                MODULES.set(len(STORE.all()))
                SAES.set(len(frontend.sae) if frontend is not None else 0)
                slots = frontend.sae_slots if frontend is not None else {}
                held = sum(SAE_REGISTRY.holder(site) is not None for site in slots)
                SAE_SLOTS.labels(state="held").set(held)
                SAE_SLOTS.labels(state="free").set(len(slots) - held)
                await _FETCHER.refresh(engine)
        await self.app(scope, receive, send)
