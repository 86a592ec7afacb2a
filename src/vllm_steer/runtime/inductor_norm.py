"""Worker side of ``core.norm_ranges``: while vLLM compiles a range of steps above the threshold,
the steered norm op is decomposed for Inductor (``kernels/steered_rms_norm/decompose.py``)."""

from __future__ import annotations

import logging
from typing import Any

from vllm_steer.core.compat import compile_range_start
from vllm_steer.core.config import SteerConfig
from vllm_steer.core.norm_ranges import inductor_norm_above
from vllm_steer.kernels.steered_rms_norm import decompose

logger = logging.getLogger("vllm.steer")


class _AboveThreshold:
    """``decompose.register``'s question: is the range being compiled above ``above`` tokens?"""

    def __init__(self, above: int) -> None:
        self.above = above
        self.logged: set[int] = set()

    def __call__(self) -> bool:
        start = compile_range_start()
        if start is None or start <= self.above:
            return False
        if start not in self.logged:
            self.logged.add(start)
            logger.info("vllm-steer: steered norms compiled as Inductor's kernels for steps from %d tokens", start)
        return True


def enable(cfg: SteerConfig, vllm_config: Any, on_cuda: bool) -> int | None:
    """Register the decomposition for this engine's threshold; returns the threshold (None: off)."""
    above = inductor_norm_above(cfg, vllm_config, on_cuda)
    if above is not None:
        decompose.register(_AboveThreshold(above))
    return above
