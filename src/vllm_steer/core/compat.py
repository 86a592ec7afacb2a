"""Which vLLM this plugin supports, and the check that refuses anything else at plugin load."""

from __future__ import annotations

import os

SUPPORTED = ((0, 26), (0, 27))  # [0.26.0, 0.27.0): vLLM internals move every release
SUPPORTED_RANGE = ">=0.26.0,<0.27.0"
OVERRIDE_ENV = "VLLM_STEER_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVllmError(RuntimeError):
    pass


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_vllm_version(version: str | None = None) -> str:
    """Return vLLM's version; raise UnsupportedVllmError outside SUPPORTED unless overridden."""
    if version is None:
        import vllm

        version = vllm.__version__
    lo, hi = SUPPORTED
    try:
        ok = lo <= _release(version) < hi
    except (ValueError, IndexError):
        ok = False
    if not ok and os.environ.get(OVERRIDE_ENV) != "1":
        raise UnsupportedVllmError(
            f"vllm-steer supports vLLM {SUPPORTED_RANGE}, found {version}. "
            f"Install a supported vLLM, or set {OVERRIDE_ENV}=1 to try anyway."
        )
    return version
