"""``steered_rms_norm`` as plain ATen ops for Inductor to compile into its own kernel, in the compile
ranges where the op would be launched from Python.

Inside a CUDA graph a launch costs nothing on the host, and the op's Triton kernel is the one to
run. Steps larger than vLLM's largest CUDA graph run the compiled pieces without a graph: there
Inductor's wrapper launches every op from Python and our op costs ~55 µs of host time per call
(dispatcher, arguments, launch; ``bench/op_host_cost.py``), 64 calls per step at 8B, against a few
µs for a kernel Inductor launches itself. For those compile ranges the op is decomposed (the same
math as ``naive.steered_rms_norm_naive``, with each table's flag applied as data, so nothing
branches on a tensor while tracing) and Inductor fuses the gather, the adds and the norm as it
fuses vLLM's own ``fused_add_rms_norm``.

``register(should_decompose)`` puts the decomposition in Inductor's table (once per process) and
sets the question asked while each graph is traced (vLLM compiles each compile range separately):
False keeps the op.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from vllm_steer.kernels.steered_rms_norm.naive import _normalize

logger = logging.getLogger("vllm.steer")
_ask: Callable[[], bool] | None = None


def steered_rms_norm_decomposed(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    table_a: torch.Tensor | None = None,
    flag_a: torch.Tensor | None = None,
    table_b: torch.Tensor | None = None,
    flag_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's result in traceable ops: ``s = x + residual (+ A[index] if flag_a) (+ B[index] if
    flag_b)`` in float32, the residual out ``s`` in x's dtype, the output vLLM's RMSNorm of ``s``."""
    s = x.float() + residual.float()
    rows = index[: x.shape[0]].long()
    for table, flag in ((table_a, flag_a), (table_b, flag_b)):
        if table is None:
            continue
        add = table.index_select(0, rows).float()
        if flag is not None:
            add = torch.where(flag.bool(), add, 0.0)
        s = s + add
    return _normalize(s, weight, eps, weight_offset, x.dtype), s.to(x.dtype)


def _decomposition(*args, **kwargs):
    if _ask is None or not _ask():
        return NotImplemented
    return steered_rms_norm_decomposed(*args, **kwargs)


def register(should_decompose: Callable[[], bool]) -> bool:
    """Decompose the op in the graphs being traced while ``should_decompose()`` is True. Returns
    False (and the op stays the op everywhere) if this torch's Inductor does not take it."""
    global _ask
    if _ask is not None:
        _ask = should_decompose
        return True
    op = torch.ops.vllm_steer.steered_rms_norm.default
    try:
        from torch._inductor import decomposition as inductor_decomps
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag

        # Inductor refuses an op that has a decomposition and meets a graph undecomposed ("both a
        # fallback and a decomp"), unless its fallback was made with override_decomp: make it now,
        # with the layout constraint Inductor's implicit fallback would give it.
        if op not in lowering.lowerings:
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)
        inductor_decomps.decompositions[op] = _decomposition
    except (ImportError, AttributeError, TypeError, AssertionError) as e:  # another Inductor
        logger.warning("vllm-steer: the steered norm stays an op in every step (%s: %s)", type(e).__name__, e)
        return False
    cached = getattr(inductor_decomps, "fast_random_decomps", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()  # a table copied before this registration would miss it
    _ask = should_decompose
    return True
