"""Entry point of ``vllm.general_plugins`` (named ``steer``): runs in every vLLM process.

It checks the vLLM version (a release newer than the supported range must still have every internal
listed in ``vllm_steer.patches`` as the plugin relies on it), then applies the general patches listed
there, each idempotent and inert while the ``steer`` block is absent from ``additional_config``.
"""

from __future__ import annotations

from vllm_steer.core.compat import check_vllm_version

_done = False


def register() -> None:
    """The general plugin: version guard, then every general patch."""
    global _done
    if _done:
        return
    from vllm_steer.patches import apply_general, vllm_problems

    check_vllm_version(problems=vllm_problems)  # the internals are read only for a newer vLLM
    apply_general()
    _done = True
