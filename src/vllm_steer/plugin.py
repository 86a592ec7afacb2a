"""Entry point of ``vllm.general_plugins`` (named ``steer``): runs in every vLLM process.

It checks the vLLM version, then applies the general patches listed in ``vllm_steer.patches``,
each idempotent and inert while the ``steer`` block is absent from ``additional_config``.
"""

from __future__ import annotations

from vllm_steer.core.compat import check_vllm_version

_done = False


def register() -> None:
    """The general plugin: version guard, then every general patch."""
    global _done
    if _done:
        return
    check_vllm_version()
    from vllm_steer.patches import apply_general

    apply_general()
    _done = True
