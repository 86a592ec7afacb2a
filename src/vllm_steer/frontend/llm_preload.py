"""Start-up modules (``steer.modules``) for in-process engines: a ``vllm.LLM`` (its ``LLMEngine``) registers them
when it is built, as the API server does before it accepts requests (``server/router.py``). Before, an
``LLM(additional_config={"steer": {"modules": ...}})`` never loaded them, and every request naming one was refused
as an unknown module.

Registered with ``replace``: the config says what each name holds, also for a second ``LLM`` in the same process
(the process's module store outlives the first one). A file that cannot be read or over ``steer.max_module_bytes``
stops the constructor naming ``additional_config.steer.modules.<name>``, as it stops a server's start-up.
"""

from __future__ import annotations

from typing import Any


def preload(engine: Any) -> None:
    """Register the engine's ``steer.modules`` through its ``collective_rpc``."""
    from vllm_steer.core.config import steer_config_of

    cfg = steer_config_of(engine.vllm_config)
    if cfg is None or not cfg.modules:
        return
    from vllm_steer.frontend.module_registration import load_path, register_sync
    from vllm_steer.frontend.prepare import SteeringFrontend

    shape = SteeringFrontend(engine.vllm_config).module_shape
    for name, path in cfg.modules.items():
        register_sync(engine.collective_rpc, load_path(name, path, shape), replace=True, max_modules=cfg.max_modules)


def patch_llm_engine_preload() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    original = LLMEngine.__init__
    if getattr(original, "_vllm_steer", False):
        return

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        preload(self)

    __init__._vllm_steer = True  # type: ignore[attr-defined]
    LLMEngine.__init__ = __init__
