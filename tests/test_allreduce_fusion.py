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


_STANDIN: list = []


def _targets_pass(all_reduce_op):
    """The post-grad pass with the all-reduce rewrite alone (``all_reduce_op`` standing in for vLLM's), keeping the
    rewritten graph's op targets (``targets``)."""
    from vllm_steer.runtime.fp8_fusion import SteeredNormQuantPass

    class Pass(SteeredNormQuantPass):
        def __call__(self, graph):
            super().__call__(graph)
            self.targets = [str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
                            for n in graph.nodes if n.op == "call_function"]

    return Pass(fp8=False, all_reduce=True, ar_ops=(all_reduce_op,))


def _standin_all_reduce():
    """``vllm_steer_test::all_reduce(tensor, group_name)``: vLLM's ``vllm.all_reduce`` schema, as a TP group of two
    equal partials (``2 * tensor``) without a process group."""
    import torch

    if not _STANDIN:
        lib = torch.library.Library("vllm_steer_test_ar", "FRAGMENT")
        lib.define("all_reduce(Tensor tensor, str group_name) -> Tensor")
        lib.impl("all_reduce", lambda tensor, group_name: tensor * 2, "CPU")
        torch.library.register_fake("vllm_steer_test_ar::all_reduce",
                                    lambda tensor, group_name: torch.empty_like(tensor), lib=lib)
        _STANDIN.append(lib)
    return torch.ops.vllm_steer_test_ar.all_reduce


@pytest.mark.parametrize("second_reader", [False, True])
def test_an_all_reduce_into_a_steered_norm_becomes_the_norm_with_the_all_reduce_inside(monkeypatch, second_reader):
    """Inductor compiles an all-reduce (vLLM's schema) and the steered norm that reads it; the post-grad pass with the
    all-reduce rewrite on puts ``steered_norm_plain_ar`` of the partial in place of both: the same stream, output
    and capture as unfused (on the CPU the op all-reduces, then normalizes). An all-reduce read elsewhere too stays."""
    import torch

    from tests.test_fp8_fusion import _compile, _inputs
    from vllm_steer.kernels.steered_rms_norm import op
    op.register()
    ar = _standin_all_reduce()
    monkeypatch.setattr(op, "all_reduce", lambda x, group: ar(x, group))

    def model(x, res, w, index, table, flag, plan, pool):
        reduced = ar(x, "tp:0")
        out, stream = torch.ops.vllm_steer.steered_norm_plain(reduced, res, w, 1e-6, 0.0, index, table, flag, None,
                                                              None, plan, None, pool)
        return (out, stream, reduced.sum(-1)) if second_reader else (out, stream)

    x, res, w, index, table, flag = _inputs(3)
    plan = torch.tensor([2, -1, 0, 5, -1, 1, 3], dtype=torch.int32)
    rec = _targets_pass(ar.default)
    pool = torch.zeros(8, x.shape[1], dtype=x.dtype)
    got = _compile(model, rec)(x, res, w, index, table, flag, plan, pool)
    want_pool = torch.zeros_like(pool)
    want = model(x, res, w, index, table, flag, plan, want_pool)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(pool, want_pool)
    if second_reader:
        assert rec.ar_matched == 0 and any("steered_norm_plain.default" in t for t in rec.targets), rec.targets
    else:
        assert rec.ar_matched == 1, rec.targets
        assert any("steered_norm_plain_ar" in t for t in rec.targets), rec.targets
        assert not any("all_reduce" in t for t in rec.targets), rec.targets


def test_the_all_reduce_rewrite_is_opt_in_at_tp_2_compiled(monkeypatch, gpu_tp2_config):
    """``VLLM_STEER_AR_NORM=1`` at TP >= 2 compiled by Inductor puts the pass in (the FP8 rewrite off for a bf16
    model), and changes the compile-cache key; unset, TP 1, or no Inductor graph: off."""
    from vllm.config.compilation import CompilationMode

    from vllm_steer.core.engine_config import data_plane_digest
    from vllm_steer.runtime import allreduce_fusion, fp8_fusion

    monkeypatch.delenv(allreduce_fusion.ENV, raising=False)
    monkeypatch.delenv(fp8_fusion.ENV, raising=False)
    off = data_plane_digest()
    gpu_tp2_config.additional_config = {"steer": {"max_configs": 4}}
    assert not allreduce_fusion.enabled(gpu_tp2_config) and not fp8_fusion.register_in(gpu_tp2_config)
    monkeypatch.setenv(allreduce_fusion.ENV, "1")
    assert data_plane_digest() != off
    assert allreduce_fusion.enabled(gpu_tp2_config)
    gpu_tp2_config.parallel_config.tensor_parallel_size = 1
    assert not allreduce_fusion.enabled(gpu_tp2_config)
    gpu_tp2_config.parallel_config.tensor_parallel_size = 2
    gpu_tp2_config.compilation_config.mode = CompilationMode.NONE
    assert not allreduce_fusion.enabled(gpu_tp2_config)
    gpu_tp2_config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    assert fp8_fusion.register_in(gpu_tp2_config)
    held = gpu_tp2_config.compilation_config.inductor_compile_config[fp8_fusion.PASS_KEY]
    assert held.all_reduce and not held.fp8
    assert allreduce_fusion.make_workspace(gpu_tp2_config, __import__("torch").device("cpu"), None, 64) is None


def test_a_workspace_that_cannot_be_made_leaves_the_norms_unfused(monkeypatch, gpu_tp2_config, caplog):
    """No symmetric memory on this machine (the workspace's constructor raises): one warning naming the variable, no
    workspace, and the engine starts (the op all-reduces unfused)."""
    import types

    import torch
    import vllm.distributed.parallel_state as ps

    from vllm_steer.kernels.allreduce_norm import triton as ar_triton
    from vllm_steer.runtime import allreduce_fusion

    def refuse(*args, **kwargs):
        raise RuntimeError("symmetric memory is not available")

    monkeypatch.setenv(allreduce_fusion.ENV, "1")
    monkeypatch.setattr(ps, "get_tp_group", lambda: types.SimpleNamespace(unique_name="tp:test", device_group=None))
    monkeypatch.setattr(ar_triton, "ArNormWorkspace", refuse)
    with caplog.at_level(logging.WARNING, logger="vllm.steer"):
        got = allreduce_fusion.make_workspace(gpu_tp2_config, torch.device("cuda", 0), torch.bfloat16, 64)
    assert got is None and "tp:test" not in ar_triton.WORKSPACES
    assert any(allreduce_fusion.ENV in r.getMessage() and "unfused" in r.getMessage() for r in caplog.records)


def test_a_projecting_norm_after_an_all_reduce_becomes_the_full_op_with_the_all_reduce_inside(monkeypatch):
    """The full op (``steered_norm``: here slot A projecting a direction) after an all-reduce: rewritten into
    ``steered_norm_ar`` of the partial, the same output and stream as unfused."""
    import torch

    from tests.test_fp8_fusion import _compile, _inputs
    from vllm_steer.kernels.steered_rms_norm import op
    op.register()
    ar = _standin_all_reduce()
    monkeypatch.setattr(op, "all_reduce", lambda x, group: ar(x, group))
    x, res, w, index, table, flag = _inputs(4)
    rows, d = table.shape
    dirs = torch.nn.functional.normalize(torch.randn(rows, 1, d, generator=torch.Generator().manual_seed(1)), dim=-1)
    proj = [torch.ones(rows, dtype=torch.int32), dirs, torch.zeros(rows, 1, 2)]

    def model(x, res, w, index, table, flag, count, dirs, bounds):
        out, stream = torch.ops.vllm_steer.steered_norm(ar(x, "tp:0"), res, w, 1e-6, 0.0, index, [table, flag], [],
                                                        [], [], 0, 0, [], None, None, None, None,
                                                        [count, dirs, bounds], [], [])
        return out, stream

    rec = _targets_pass(ar.default)
    got = _compile(model, rec)(x, res, w, index, table, flag, *proj)
    want = model(x, res, w, index, table, flag, *proj)
    assert rec.ar_matched == 1 and any("steered_norm_ar" in t for t in rec.targets), rec.targets
    assert not any("all_reduce" in t for t in rec.targets), rec.targets
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_ar_ops_are_their_base_op_of_the_all_reduced_stream_on_the_cpu(monkeypatch):
    """Each ``_ar`` op's schema is its base op's plus ``group_name``; on the CPU it is the base op of vLLM's all-reduce
    of ``x`` (here a stand-in), whether the group is named, given by position or left out."""
    import torch

    from tests.test_fp8_fusion import _inputs
    from vllm_steer.kernels.steered_rms_norm import op

    op.register()
    groups = []
    monkeypatch.setattr(op, "all_reduce", lambda x, group: groups.append(group) or x * 2)
    ops = torch.ops.vllm_steer
    for base, fused in ((ops.steered_norm_plain, ops.steered_norm_plain_ar), (ops.steered_norm, ops.steered_norm_ar)):
        base_args = [a.name for a in base.default._schema.arguments]
        assert [a.name for a in fused.default._schema.arguments] == base_args + ["group_name"]
    x, res, w, index, table, flag = _inputs(6)
    plain = (res, w, 1e-6, 0.0, index, table, flag, None, None, None, None, None)
    full = (res, w, 1e-6, 0.0, index, [table, flag], [], [], [], 0, 0, [], None, None, None, None, [], [], [])
    want_plain, want_full = ops.steered_norm_plain(x * 2, *plain), ops.steered_norm(x * 2, *full)
    for got, want in ((ops.steered_norm_plain_ar(x, *plain, "tp:0"), want_plain),
                      (ops.steered_norm_plain_ar(x, *plain), want_plain),
                      (ops.steered_norm_ar(x, *full, 0, group_name="tp:1"), want_full),
                      (ops.steered_norm_ar(x, *full), want_full)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert groups == ["tp:0", "", "tp:1", ""]
