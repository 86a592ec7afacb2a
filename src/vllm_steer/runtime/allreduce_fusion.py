"""What steered norms take from vLLM's all-reduce + RMSNorm fusion, said once at install (issue 40).

vLLM 0.26+ on CUDA at TP >= 2 (Hopper or Blackwell; FlashInfer, which vLLM 0.26 requires, usable: nvcc on PATH or
flashinfer-cubin) turns ``pass_config.fuse_allreduce_rms`` on at its default optimization level (-O2):
``AllReduceFusionPass`` rewrites each
``all_reduce -> fused_add_rms_norm`` (and ``-> rms_norm``) into one FlashInfer kernel (all-reduce, residual add and
norm) for batches up to its max_token_num. A steered norm is our op, not vLLM's norm, so the pattern does not match
there: vLLM's all-reduce and our norm run as two kernels in every step, steered or not, where stock runs one. Norms
nobody steers keep the fusion. Only norms whose input comes straight from an all-reduce were fused in stock: the
``fused`` and ``post_add`` layouts of ``runtime.families`` (an ``in_place`` norm reads a scaled sum, a ``hyper`` one
the mHC kernel's output). The count follows the setting: where FlashInfer cannot make its workspace, vLLM disables the
pass itself and says so in its log. The cost is measured by bench/gpu_session.sh's arfuse steps.

The give-back (``VLLM_STEER_AR_NORM=1``, off by default until measured on two GPUs): ``make_workspace`` gives each TP
group a symmetric-memory workspace at install (``kernels/allreduce_norm``: two epochs of ``[TP, max tokens, D]``),
and ``fuse_allreduce_norms`` (run by ``runtime.fp8_fusion``'s post-grad pass, vLLM's custom-pass slot) rewrites each
``vllm.all_reduce -> steered_norm_plain`` into ``steered_norm_plain_ar``: one launch, the all-reduce inside the
steered norm (batches above the workspace's tokens: vLLM's all-reduce, then the norm, inside the op); the same for
``steered_norm`` (SAE clamps, conditions, projections: ``steered_norm_ar``; a full SAE pack's edit reads ``x`` before
the norm: those norms all-reduce unfused inside the op).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("vllm.steer")  # vLLM's handler: the engine log shows it

FUSED_LAYOUTS = ("fused", "post_add")  # the norms whose input vLLM's pattern sees as an all-reduce's output
ENV = "VLLM_STEER_AR_NORM"
MAX_TOKENS = 512  # the workspace's tokens: vLLM's default largest CUDA graph (decode); a bigger batch is unfused


def lost_fusions(vllm_config, modes: list[str]) -> int:
    """How many of this rank's steered norms (``modes``: each one's ``NormSite.mode``) vLLM would have fused with
    the all-reduce before them; 0 where it fuses none (the pass off, TP 1, no Inductor graph)."""
    from vllm.config.compilation import CompilationMode

    cc = vllm_config.compilation_config
    if not getattr(cc.pass_config, "fuse_allreduce_rms", False):  # None until vLLM resolves its level's default
        return 0
    if vllm_config.parallel_config.tensor_parallel_size < 2 or cc.mode != CompilationMode.VLLM_COMPILE:
        return 0
    return sum(1 for m in modes if m in FUSED_LAYOUTS)


def warn_lost(vllm_config, modes: list[str], tp_rank: int) -> int:
    """The warning, once per pipeline stage (its TP rank 0); returns the count."""
    lost = lost_fusions(vllm_config, modes)
    if lost and tp_rank == 0:
        logger.warning(
            "vllm-steer: %d of %d steered norms lose vLLM's all-reduce + RMSNorm fusion (pass_config.fuse_allreduce_rms"
            " at TP %d): each runs as vLLM's all-reduce, then the steered norm (two kernels where stock runs one, in "
            "every step, steered or not; docs/operating.md \"Parallelism\")",
            lost, len(modes), vllm_config.parallel_config.tensor_parallel_size)
    return lost


def enabled(vllm_config) -> bool:
    """``ENV`` is "1" and the engine is TP >= 2 compiled by Inductor."""
    if os.environ.get(ENV, "0") != "1":
        return False
    from vllm.config.compilation import CompilationMode

    cc = vllm_config.compilation_config
    return vllm_config.parallel_config.tensor_parallel_size >= 2 and cc.mode == CompilationMode.VLLM_COMPILE


def make_workspace(vllm_config, device: torch.device, dtype: torch.dtype, hidden: int):
    """This TP group's workspace, made at install by every rank of the group alike (a collective), kept in
    ``allreduce_norm.triton.WORKSPACES`` under the group's name; None where the fusion is off or not on CUDA."""
    if not enabled(vllm_config) or device.type != "cuda":
        return None
    from vllm.distributed.parallel_state import get_tp_group

    from vllm_steer.kernels.allreduce_norm.triton import WORKSPACES, ArNormWorkspace

    tp = get_tp_group()
    if tp.unique_name not in WORKSPACES:
        cap = vllm_config.compilation_config.max_cudagraph_capture_size or MAX_TOKENS
        try:
            WORKSPACES[tp.unique_name] = ArNormWorkspace(min(cap, MAX_TOKENS), hidden, dtype, device,
                                                         tp.device_group)
        except Exception as exc:  # noqa: BLE001 - no symmetric memory here: the op all-reduces unfused, as before
            logger.warning("vllm-steer: %s=1 but the all-reduce workspace could not be made (%s: %s): steered norms "
                           "all-reduce unfused", ENV, type(exc).__name__, exc)
            return None
    return WORKSPACES[tp.unique_name]


def all_reduce_ops(extra: tuple = ()) -> tuple:
    """The all-reduce ops the rewrite takes out: vLLM's ``vllm.all_reduce`` (``tensor``, ``group_name``), and ``extra``
    (a test's stand-in with its schema)."""
    found = tuple(extra)
    if hasattr(torch.ops, "vllm") and hasattr(torch.ops.vllm, "all_reduce"):
        found += (torch.ops.vllm.all_reduce.default,)
    return found


def fuse_allreduce_norms(graph: torch.fx.Graph, ar_ops: tuple | None = None) -> int:
    """Rewrite every all-reduce whose only reader is a steered norm with a residual (its ``x``) into that norm's
    ``_ar`` op of the all-reduce's input (``steered_norm_plain_ar`` / ``steered_norm_ar``); returns how many."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    ar_ops = all_reduce_ops() if ar_ops is None else ar_ops
    ops = torch.ops.vllm_steer
    fused_op = {ops.steered_norm_plain.default: ops.steered_norm_plain_ar.default,
                ops.steered_norm.default: ops.steered_norm_ar.default}
    fused = 0
    for call in list(graph.nodes):
        if call.op != "call_function" or call.target is not auto_functionalized or call.args[0] not in fused_op:
            continue
        kw = call.kwargs
        reduced = kw.get("x")
        if (kw.get("residual") is None or not isinstance(reduced, torch.fx.Node) or reduced.target not in ar_ops
                or len(reduced.users) != 1):
            continue
        partial = reduced.args[0] if reduced.args else reduced.kwargs["tensor"]
        group = reduced.args[1] if len(reduced.args) > 1 else reduced.kwargs["group_name"]
        with graph.inserting_before(call):
            new = graph.call_function(auto_functionalized, (fused_op[call.args[0]],),
                                      {**kw, "x": partial, "group_name": group})
        new.meta["val"] = call.meta["val"]  # the same outputs (out, residual, the mutated buffers): their values
        call.replace_all_uses_with(new)
        graph.erase_node(call)
        graph.erase_node(reduced)
        fused += 1
    return fused
