"""Entry point of ``vllm.general_plugins`` (named ``steer``): runs in every vLLM process.

It checks the vLLM version, then applies the class patches, each idempotent and inert while the
``steer`` block is absent from ``additional_config``. Every patch of a vLLM internal is applied
from here and lives in the module that says what it patches and why.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from vllm_steer.compat import check_vllm_version
from vllm_steer.config import parse_steer_config, steer_config_of

_done = False


def data_plane_digest() -> str:
    """Hash of everything that shapes the compiled graph (mixed into vLLM's compile-cache key)."""
    import vllm_steer.kernels.apply_steering as kernel
    from vllm_steer import __version__

    root = Path(__file__).parent
    files = sorted(
        [root / "runtime" / "install.py", root / "models" / "__init__.py"]
        + list(Path(kernel.__file__).parent.glob("*.py"))
    )
    h = hashlib.sha256(__version__.encode())
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def _patch_engine_config() -> None:
    """EngineArgs.create_engine_config: reject a malformed steer block before anything starts.
    VllmConfig.compute_hash: with steering on, also hash the plugin's data plane, so a plugin
    change never loads a stale compiled graph."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "_vllm_steer", False):
        return
    orig_create, orig_hash = EngineArgs.create_engine_config, VllmConfig.compute_hash

    def create_engine_config(self, *args, **kwargs):
        parse_steer_config(self.additional_config if isinstance(self.additional_config, dict) else None)
        return orig_create(self, *args, **kwargs)

    def compute_hash(self) -> str:
        base = orig_hash(self)
        if steer_config_of(self) is None:
            return base
        return hashlib.sha256(f"{base}:{data_plane_digest()}".encode()).hexdigest()[: len(base)]

    create_engine_config._vllm_steer = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config
    VllmConfig.compute_hash = compute_hash


def register() -> None:
    """The general plugin: version guard, then every patch (each a no-op while steering is off)."""
    global _done
    if _done:
        return
    check_vllm_version()
    from vllm_steer.decode_block_salt import patch_scheduler_add_request
    from vllm_steer.frontend import patch_input_processor
    from vllm_steer.runtime.runner_v1 import patch_v1_runner
    from vllm_steer.runtime.runner_v2 import patch_v2_runner
    from vllm_steer.scheduler_gate import patch_scheduler
    from vllm_steer.worker_rpc import patch_worker

    _patch_engine_config()
    patch_input_processor()
    patch_scheduler()
    patch_scheduler_add_request()
    patch_worker()
    patch_v1_runner()
    patch_v2_runner()
    _done = True
