"""Issue 40: the install warning about vLLM's all-reduce + RMSNorm fusion (runtime.allreduce_fusion), without a GPU:
vLLM's own config objects set as a TP=2 CUDA engine has them (the CPU platform never turns the fusion on)."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def gpu_tp2_config():
    """A VllmConfig with what vLLM 0.26 resolves on 2 Hoppers with FlashInfer: the pass on, TP 2, Inductor."""
    from vllm.config import VllmConfig
    from vllm.config.compilation import CompilationMode

    cfg = VllmConfig()
    cfg.compilation_config.pass_config.fuse_allreduce_rms = True
    cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
    cfg.parallel_config.tensor_parallel_size = 2
    return cfg


def test_steered_norms_after_an_all_reduce_lose_the_fusion_where_vllm_fuses(gpu_tp2_config):
    """Counted: the steered norms vLLM's pattern would have fused (fused and post_add layouts); nothing where vLLM
    fuses nothing (pass off or unresolved, TP 1, no Inductor graph) or nothing is steered."""
    from vllm.config import VllmConfig
    from vllm.config.compilation import CompilationMode

    from vllm_steer.runtime.allreduce_fusion import lost_fusions

    modes = ["fused"] * 64 + ["post_add", "in_place", "hyper"]
    cfg = gpu_tp2_config
    assert lost_fusions(cfg, modes) == 65
    assert lost_fusions(cfg, []) == 0
    assert lost_fusions(cfg, ["in_place", "hyper"]) == 0
    cfg.parallel_config.tensor_parallel_size = 1
    assert lost_fusions(cfg, modes) == 0
    cfg.parallel_config.tensor_parallel_size = 4
    assert lost_fusions(cfg, modes) == 65
    cfg.compilation_config.mode = CompilationMode.NONE  # --enforce-eager: no pass runs
    assert lost_fusions(cfg, modes) == 0
    cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
    for off in (False, None):  # -O1 / --compilation-config ... fuse_allreduce_rms false; or not yet resolved
        cfg.compilation_config.pass_config.fuse_allreduce_rms = off
        assert lost_fusions(cfg, modes) == 0
    assert lost_fusions(VllmConfig(), modes) == 0  # this CPU box's own resolution: vLLM does not fuse here


def test_the_warning_names_the_loss_once_per_stage(gpu_tp2_config, caplog):
    """One warning on TP rank 0 naming the count, the setting and where the docs say more; none on other ranks."""
    from vllm_steer.runtime.allreduce_fusion import warn_lost

    modes = ["fused"] * 65
    with caplog.at_level(logging.WARNING, logger="vllm.steer"):
        assert warn_lost(gpu_tp2_config, modes, tp_rank=1) == 65
        assert not caplog.records
        assert warn_lost(gpu_tp2_config, modes, tp_rank=0) == 65
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert rec.levelno == logging.WARNING
    assert "65 of 65 steered norms" in msg and "fuse_allreduce_rms" in msg and "TP 2" in msg
    assert 'docs/operating.md "Parallelism"' in msg
