"""Which steps run the steered norm as Inductor's own kernel instead of launching the op.

Steps larger than vLLM's largest CUDA graph run the compiled pieces without a graph, and there the
op's host time (~55 µs per call from Python, 64 calls per step at 8B) delays the engine loop.
For those steps the op is compiled from its plain-torch form into Inductor's kernel
(``kernels/steered_rms_norm/decompose.py``); steps in CUDA graphs keep the op's Triton kernel.
vLLM compiles each compile range separately, so the threshold is made a range endpoint.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_steer.core.config import SteerConfig

logger = logging.getLogger("vllm.steer")


def inductor_norm_above(cfg: SteerConfig, vllm_config: Any, on_cuda: bool) -> int | None:
    """Token count above which a step's norms are Inductor's kernels; None: never.

    ``steer.inductor_norm_above`` when set; otherwise, on CUDA, the largest CUDA-graph size (0 with
    CUDA graphs off: every step), elsewhere never (no graphs, and the op is plain torch there)."""
    if cfg.inductor_norm_above is not None:
        return cfg.inductor_norm_above
    if not on_cuda:
        return None
    return int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0)


def add_range_endpoint(vllm_config: Any, above: int | None) -> None:
    """Split vLLM's compile ranges at ``above`` (so one range ends there), as vLLM's own fusion
    passes do for their thresholds; nothing when the split would be outside (1, max tokens)."""
    if above is None:
        return
    cc = vllm_config.compilation_config
    endpoints = list(cc.compile_ranges_endpoints or [])
    top = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
    if above <= 1 or top is None or above >= top or above in endpoints:
        return
    cc.compile_ranges_endpoints = sorted(endpoints + [above])
    logger.info("vllm-steer: steps of more than %d tokens run the steered norm as Inductor's kernel "
                "(compile ranges %s)", above, cc.compile_ranges_endpoints)
