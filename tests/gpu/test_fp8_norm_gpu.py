"""GPU checks of the steered norm's FP8 output (``QUANT``, issue 43's give-back; runs only where CUDA is available):
``steered_norm_fp8_triton`` against what a compiled stock engine computes after our norm, i.e. the norm's output fed
to vLLM's ``QuantFP8.forward_native`` compiled by Inductor (its own Triton kernel), static per-tensor and dynamic
per-token, at decode and prefill sizes; and ``runtime.fp8_fusion``'s pass on the CUDA graph Inductor compiles: one
``steered_norm_plain_fp8`` where ``steered_norm_plain`` + the quant were, the same bits out. Block FP8 (QUANT 3):
the same against vLLM's ``fp8_utils.per_token_group_quant_fp8`` (the CUDA op ``_C.per_token_group_fp8_quant``) in the
scale layouts its linears read (row-major for Triton, column-major for CUTLASS, TMA-aligned with UE8M0 for DeepGEMM
on Hopper), and the pass matching the real op."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from tests.gpu.norm_inputs import norm_inputs  # noqa: E402

EPS = 1e-5


@pytest.fixture(scope="module")
def quant():
    """vLLM's QuantFP8 as a compiled stock engine runs it (custom ops off: ``forward_native``)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from vllm_steer.kernels.steered_rms_norm import op

    op.register()
    ctx = set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"])))
    ctx.__enter__()
    made = {s: QuantFP8(static=s, group_shape=GroupShape.PER_TENSOR if s else GroupShape.PER_TOKEN)
            for s in (True, False)}
    assert all(q._forward_method.__name__ == "forward_native" for q in made.values())
    yield made
    ctx.__exit__(None, None, None)


def _inputs(n: int, d: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, tb = norm_inputs(g, n, d, torch.bfloat16, 6)
    index = torch.randint(0, 6, (n,), generator=g, device="cuda", dtype=torch.int32)
    on = torch.ones(1, dtype=torch.uint8, device="cuda")
    return x, r, w, index, ta, on, tb, on


@pytest.mark.parametrize("n", [1, 16, 300])
@pytest.mark.parametrize("static", [True, False], ids=["static_per_tensor", "dynamic_per_token"])
def test_fp8_output_equals_the_norm_then_inductors_quant(quant, n, static):
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_fp8_triton

    d = 4096
    x, r, w, index, ta, fa, tb, fb = _inputs(n, d, seed=n)
    scale = torch.tensor([0.02], dtype=torch.float32, device="cuda") if static else None
    q, s, stream = steered_norm_fp8_triton(x, r, w, EPS, 0.0, index, (ta, fa), (tb, fb), quant_scale=scale)
    out, want_stream = torch.ops.vllm_steer.steered_norm_plain(x, r, w, EPS, 0.0, index, ta, fa, tb, fb,
                                                               None, None, None)
    compiled = torch.compile(lambda o, sc: quant[static](o, sc), fullgraph=True)
    want_q, want_s = compiled(out, scale)
    assert torch.equal(stream, want_stream)
    if not static:
        assert torch.equal(s, want_s)
    same = q.view(torch.uint8) == want_q.view(torch.uint8)
    # Inductor's division and ours may round a value on a code boundary differently: one code at most, rarely
    assert same.float().mean() > 0.999, f"{(~same).sum().item()} codes differ"
    diff = (q.float() - want_q.float()).abs()
    assert (diff <= want_q.float().abs() * 2 ** -3 + 2 ** -9).all()


def test_pass_on_cuda_gives_the_same_bits(quant):
    """The pass in Inductor's post-grad pipeline (auto_functionalized v1, as vLLM sets it) on CUDA: matched once,
    the compiled model's fp8 output and scale equal the unfused compiled model's."""
    import torch._inductor.config as ic

    from vllm_steer.runtime.fp8_fusion import SteeredNormQuantPass

    def model(x, r, w, index, ta, fa, tb, fb):
        out, stream = torch.ops.vllm_steer.steered_norm_plain(x, r, w, EPS, 0.0, index, ta, fa, tb, fb,
                                                              None, None, None)
        q, s = quant[False](out)
        return q, s, stream

    args = _inputs(16, 4096, seed=7)
    results = []
    for custom in (None, SteeredNormQuantPass()):
        torch._dynamo.reset()
        with ic.patch(post_grad_custom_post_pass=custom, enable_auto_functionalized_v2=False, fx_graph_cache=False):
            results.append(torch.compile(model, fullgraph=True)(*args))
        if custom is not None:
            assert custom.calls >= 1 and custom.matched == custom.calls, (custom.calls, custom.matched)
    (q0, s0, st0), (q1, s1, st1) = results
    assert torch.equal(st0, st1) and torch.equal(s0, s1)
    assert (q0.view(torch.uint8) == q1.view(torch.uint8)).float().mean() > 0.999


# (column_major_scales, tma_aligned_scales, use_ue8m0) as vLLM's block-FP8 linears ask for them (0.26-0.32):
# Triton / BlockScaledMMLinearKernel's default, CUTLASS, DeepGEMM on Hopper (VLLM_USE_DEEP_GEMM_E8M0 on)
GROUP_LAYOUTS = {"triton": (False, False, False), "cutlass": (True, False, False), "deepgemm": (True, True, True)}


def _group_reference(out, layout):
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    col, tma, ue8m0 = GROUP_LAYOUTS[layout]
    return per_token_group_quant_fp8(out, 128, column_major_scales=col, tma_aligned_scales=tma, use_ue8m0=ue8m0)


def _same_group_quant(q, s, want_q, want_s):
    """Scales as the op's within an ulp (its division may be nvcc's, ours is div_rn), codes one step apart at most and
    equal but rarely (a value on a code boundary)."""
    assert s.stride() == want_s.stride()
    torch.testing.assert_close(s, want_s, rtol=2 ** -22, atol=0)
    same = q.view(torch.uint8) == want_q.view(torch.uint8)
    assert same.float().mean() > 0.999, f"{(~same).sum().item()} codes differ"
    diff = (q.float() - want_q.float()).abs()
    assert (diff <= want_q.float().abs() * 2 ** -3 + 2 ** -9).all()


@pytest.mark.parametrize("n", [1, 16, 300])
@pytest.mark.parametrize("layout", list(GROUP_LAYOUTS))
def test_group_fp8_output_equals_the_norm_then_vllms_group_quant(quant, n, layout):
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_fp8_triton

    d = 4096
    x, r, w, index, ta, fa, tb, fb = _inputs(n, d, seed=100 + n)
    out, want_stream = torch.ops.vllm_steer.steered_norm_plain(x, r, w, EPS, 0.0, index, ta, fa, tb, fb,
                                                               None, None, None)
    want_q, want_s = _group_reference(out, layout)
    s = torch.empty_strided(want_s.shape, want_s.stride(), dtype=torch.float32, device="cuda").fill_(float("nan"))
    q, ret, stream = steered_norm_fp8_triton(x, r, w, EPS, 0.0, index, (ta, fa), (tb, fb), group_scale=s,
                                             group_size=128, group_eps=1e-10, ue8m0=GROUP_LAYOUTS[layout][2])
    assert ret.numel() == 0 and torch.equal(stream, want_stream)
    _same_group_quant(q, s, want_q, want_s)


def test_group_pass_on_cuda_gives_the_same_bits(quant):
    """The pass on the real ``_C.per_token_group_fp8_quant`` (DeepGEMM's layout: TMA-aligned, UE8M0), the token count
    dynamic: matched once in each graph compiled (s33's H200 compiled two: DeepGEMM's TMA-aligned stride guards the
    token count), the compiled model's codes and scales the unfused compiled model's."""
    import torch._inductor.config as ic

    from vllm_steer.runtime.fp8_fusion import SteeredNormQuantPass

    def model(x, r, w, index, ta, fa, tb, fb):
        out, stream = torch.ops.vllm_steer.steered_norm_plain(x, r, w, EPS, 0.0, index, ta, fa, tb, fb,
                                                              None, None, None)
        q, s = _group_reference(out.view(-1, out.shape[-1]), "deepgemm")
        return q, s, stream

    results = {}
    for custom in (None, SteeredNormQuantPass()):
        torch._dynamo.reset()
        with ic.patch(post_grad_custom_post_pass=custom, enable_auto_functionalized_v2=False, fx_graph_cache=False):
            compiled = torch.compile(model, fullgraph=True)
            for n in (37, 16):
                args = _inputs(n, 4096, seed=n)
                for a in (args[0], args[1], args[3]):
                    torch._dynamo.mark_dynamic(a, 0)
                results[custom is None, n] = compiled(*args)
        if custom is not None:
            assert custom.calls >= 1 and custom.matched == custom.calls, (custom.calls, custom.matched)
    for n in (37, 16):
        (q0, s0, st0), (q1, s1, st1) = results[True, n], results[False, n]
        assert torch.equal(st0, st1)
        _same_group_quant(q1, s1, q0, s0)
