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
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.steer")  # vLLM's handler: the engine log shows it

FUSED_LAYOUTS = ("fused", "post_add")  # the norms whose input vLLM's pattern sees as an all-reduce's output


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
