"""The ``steer`` block as vLLM's engine config sees it: validated before anything starts, and part
of the compile-cache key (with the data plane's source) so a plugin change never loads a stale
compiled graph. Runs in every process that builds or hashes a ``VllmConfig``.

An OpenAI server with the block on but without the ``steer`` endpoint plugin (vLLM loads endpoint
plugins only when ``VLLM_PLUGINS`` names them) would steer nothing its clients send: it does not
start, and says to set ``VLLM_PLUGINS=steer``. One that decodes speculatively does not start with a capture consumer
whose global spec captures every request (``core.speculative``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from vllm_steer.core.config import SteerConfigError, parse_steer_config, steer_config_of
from vllm_steer.core.speculative import drafting, refusal


def _package_dir(name: str) -> Path:
    """Where a package's files are, without importing it (the kernels may live outside src/)."""
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations)))


def data_plane_digest() -> str:
    """Hash of everything that shapes the compiled graph: the worker runtime, the kernels, and the post-grad pass's
    environment variables (``runtime.fp8_fusion``'s, whose default follows the model's quantization, which vLLM's own
    cache key holds; ``runtime.allreduce_fusion``'s)."""
    from vllm_steer import __version__

    h = hashlib.sha256(__version__.encode())
    h.update(os.environ.get("VLLM_STEER_FP8_NORM_QUANT", "").encode())
    h.update(os.environ.get("VLLM_STEER_AR_NORM", "").encode())  # runtime.allreduce_fusion's rewrite (TP >= 2)
    for pkg in ("vllm_steer.runtime", "vllm_steer.kernels"):
        root = _package_dir(pkg)
        for f in sorted(root.rglob("*.py")):
            h.update(f"{pkg}/{f.relative_to(root)}".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def endpoint_plugin_named() -> bool:
    """Whether vLLM will load the ``steer`` endpoint plugin (only when ``VLLM_PLUGINS`` names it)."""
    import vllm.envs as envs

    return envs.VLLM_PLUGINS is not None and "steer" in envs.VLLM_PLUGINS


def patch_engine_config() -> None:
    """Patches ``EngineArgs.create_engine_config`` (reject a malformed steer block with one line
    naming the key) and ``VllmConfig.compute_hash`` (with steering on, mix in the data plane)."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "_vllm_steer", False):
        return
    orig_create, orig_hash = EngineArgs.create_engine_config, VllmConfig.compute_hash

    def create_engine_config(self, *args, **kwargs):
        cfg = parse_steer_config(self.additional_config if isinstance(self.additional_config, dict) else None)
        usage = kwargs.get("usage_context", args[0] if args else None)
        if cfg is not None and getattr(usage, "name", None) == "OPENAI_API_SERVER" and not endpoint_plugin_named():
            raise SteerConfigError(
                "additional_config.steer is set but the steer endpoint plugin is not loaded, so requests' steering "
                "fields would be dropped: start the server with VLLM_PLUGINS=steer")
        vllm_config = orig_create(self, *args, **kwargs)
        how = drafting(vllm_config) if cfg is not None else None
        every = [c.instance_name for c in cfg.capture if c.params.get("global_spec")] if how else []
        if every:  # a consumer capturing every request: every request would be refused (core.speculative)
            raise SteerConfigError(refusal(f"steer.capture {every[0]!r} (a global_spec)", how))
        return vllm_config

    def compute_hash(self, *args, **kwargs) -> str:  # vLLM 0.30+ adds include_version
        base = orig_hash(self, *args, **kwargs)
        if steer_config_of(self) is None:
            return base
        return hashlib.sha256(f"{base}:{data_plane_digest()}".encode()).hexdigest()[: len(base)]

    create_engine_config._vllm_steer = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config
    VllmConfig.compute_hash = compute_hash
