"""The steered norm on CPU: its reference equals vLLM's own norm modules (RMSNorm, GemmaRMSNorm, with
and without a residual) bit for bit when nothing is steered, adds the steering rows as the spec says,
and the Triton kernels (run by Triton's interpreter) and the registered ops agree with the reference.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests import background_runs
from vllm_steer.kernels.steered_rms_norm import op
from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NORMS = ("RMSNorm", "GemmaRMSNorm")
R = 6  # table rows, row 0 the zero row


@pytest.fixture(scope="module")
def vllm_norm():
    """Build one of vLLM's norm modules (the real classes, inside a vLLM config context)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import layernorm

    ctx = set_current_vllm_config(VllmConfig())
    ctx.__enter__()

    def make(kind: str, d: int, dtype: torch.dtype, seed: int):
        m = getattr(layernorm, kind)(d, eps=1e-5).to(dtype)
        with torch.no_grad():
            m.weight.copy_(torch.randn(d, generator=torch.Generator().manual_seed(seed)) * 0.5)
        return m, (1.0 if kind == "GemmaRMSNorm" else 0.0)

    yield make
    ctx.__exit__(None, None, None)


def _case(n: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    r = (torch.randn(n, d, generator=g) * 3).to(dtype)
    tables = [(torch.randn(R, d, generator=g) * 2).to(dtype) for _ in range(2)]
    for t in tables:
        t[0] = 0
    index = torch.randint(1, R, (n + 5,), generator=g, dtype=torch.int32)
    index[: n : 3] = 0  # a third of the tokens unsteered
    return x, r, tables, index


def _on() -> torch.Tensor:
    return torch.ones(1, dtype=torch.uint8)


def _off() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.uint8)


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_unsteered_equals_vllm_norm_bit_for_bit(vllm_norm, kind, dtype_name):
    """Row 0 everywhere, or idle tables: exactly vLLM's fused add + RMSNorm, and its plain norm."""
    dtype = DTYPES[dtype_name]
    m, offset = vllm_norm(kind, 96, dtype, seed=1)
    x, r, (ta, tb), index = _case(9, 96, dtype, seed=2)
    want_out, want_res = m.forward_native(x.clone(), r.clone())
    zero = torch.zeros_like(index)
    for idx, fa in ((zero, _on()), (index, _off())):
        out, res = steered_norm_naive(x, r, m.weight.data, m.variance_epsilon, offset, idx, vec_a=(ta, fa),
                                      vec_b=(tb, fa))
        assert torch.equal(out, want_out) and torch.equal(res, want_res)


@pytest.mark.parametrize("kind", NORMS)
def test_steered_rows_follow_the_spec(vllm_norm, kind):
    """float64 numpy of the README's formula: s = x + r + A[i] + B[i], then vLLM's normalization."""
    m, offset = vllm_norm(kind, 64, torch.float32, seed=3)
    x, r, (ta, tb), index = _case(11, 64, torch.float32, seed=4)
    out, res = steered_norm_naive(x, r, m.weight.data, 1e-5, offset, index, vec_a=(ta, _on()), vec_b=(tb, _on()))
    i = index[:11].numpy()
    s = x.double().numpy() + r.double().numpy() + ta.double().numpy()[i] + tb.double().numpy()[i]
    w = m.weight.data.double().numpy() + offset
    want = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(res.numpy(), s, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    # the same stream through vLLM's own norm (x pre-steered by hand) agrees to float32 rounding
    vo, vr = m.forward_native((x + ta[index[:11].long()] + tb[index[:11].long()]).clone(), r.clone())
    torch.testing.assert_close(out, vo, rtol=1e-5, atol=1e-5)
    unsteered = index[:11] == 0
    plain_out, plain_res = m.forward_native(x.clone(), r.clone())
    assert torch.equal(out[unsteered], plain_out[unsteered]) and torch.equal(res[unsteered], plain_res[unsteered])


def test_registered_op_is_the_reference_on_cpu(vllm_norm):
    op.register()
    op.register()  # idempotent
    m, offset = vllm_norm("GemmaRMSNorm", 48, torch.bfloat16, seed=7)
    x, r, (ta, tb), index = _case(5, 48, torch.bfloat16, seed=8)
    # every argument positional: vec_a, vec_b, sae_a, sae_b, topk_a, topk_b, cond, gate, plan_a, plan_b, pool,
    # proj_a, proj_b, tc (the op's schema has no defaults)
    got = torch.ops.vllm_steer.steered_norm(x, r, m.weight, 1e-5, offset, index, [ta, _on()], [], [], [], 0, 0, [],
                                            None, None, None, None, [], [], [])
    want = steered_norm_naive(x, r, m.weight, 1e-5, offset, index, vec_a=(ta, _on()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_triton_kernels_match_reference_under_the_interpreter():
    """The Triton kernels against their references, on CPU, in a process where Triton runs its
    interpreter (TRITON_INTERPRET=1 must be set before Triton is first imported)."""
    rc, output, _ = background_runs.result("interpreted")  # started with the session (tests/background_runs.py)
    tail = output[-3000:]
    assert rc == 0, tail
    m = re.search(r"(\d+) passed", tail)
    assert m and int(m.group(1)) >= 55 and "skipped" not in tail and "failed" not in tail, tail


def test_projections_ablate_and_cap_follow_the_formula():
    """The reference's directional projections against float64 numpy: ablation removes the component
    along the (unit) direction, a cap clamps it into [lo, hi]; two directions apply one after the other;
    then the row's vectors are added (capture -> SAE -> projections -> vectors)."""
    d, n = 64, 6
    x, r, (ta, _), _ = _case(n, d, torch.float32, seed=30)
    g = torch.Generator().manual_seed(31)
    dirs = torch.randn(3, 2, d, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    bounds = torch.tensor([[[0.0, 0.0]] * 2, [[0.0, 0.0]] * 2, [[-0.25, 0.5], [1.0, 2.0]]])
    count = torch.tensor([0, 1, 2], dtype=torch.int32)
    index = torch.tensor([0, 1, 2, 1, 2, 0], dtype=torch.int32)
    w = torch.ones(d)
    _, res = steered_norm_naive(x, r, w, 1e-5, 0.0, index, vec_a=(ta, _on()), proj_a=(count, dirs, bounds))
    want = x.double().numpy() + r.double().numpy()
    for t, row in enumerate(index.tolist()):
        for k in range(count[row]):
            v = dirs[row, k].double().numpy()
            p = want[t] @ v
            want[t] += (min(max(p, float(bounds[row, k, 0])), float(bounds[row, k, 1])) - p) * v
        want[t] += ta[row].double().numpy()
    np.testing.assert_allclose(res.numpy(), want, rtol=1e-5, atol=1e-5)
    ablated = (res[1] - ta[1]).double() @ dirs[1, 0].double()
    assert abs(float(ablated)) < 1e-5
    assert torch.equal(res[[0, 5]], (x[[0, 5]].float() + r[[0, 5]].float()).to(x.dtype))  # row 0 untouched


def test_a_capturing_norm_copies_nothing_on_cpu_while_the_runtime_says_nobody_captures(monkeypatch):
    """The CPU op (the CPU lane's steered norm on a capturing server) skips its capture plans while the worker
    runtime has said nothing is captured this step (``capture_rows.live``): no plan is read, the outputs are
    the same; once a step captures, the plans are read and the pool written."""
    from vllm_steer.kernels.capture_rows import live
    from vllm_steer.kernels.capture_rows import naive as capture_naive

    op.register()
    calls = []
    real = capture_naive.capture_rows_naive
    monkeypatch.setattr(capture_naive, "capture_rows_naive", lambda *a: calls.append(1) or real(*a))
    import vllm_steer.kernels.capture_rows.op as capture_op

    monkeypatch.setattr(capture_op, "capture_rows_naive", capture_naive.capture_rows_naive)
    g = torch.Generator().manual_seed(3)
    n, d = 5, 16
    x, r, w = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.randn(d, generator=g)
    table, off = torch.zeros(R, d), torch.zeros(1, dtype=torch.uint8)
    index, idle = torch.zeros(8, dtype=torch.int32), torch.full((8,), -1, dtype=torch.int32)
    pool = torch.zeros(4, d)

    def run(plan_a, plan_b):
        return torch.ops.vllm_steer.steered_norm(x, r, w, 1e-5, 0.0, index, [table, off], [table, off], [], [], 0, 0,
                                                 [], None, plan_a, plan_b, pool, [], [], [])

    monkeypatch.setattr(live, "capture_live", False)
    skipped = run(idle, idle)
    assert calls == [] and not pool.any()
    monkeypatch.setattr(live, "capture_live", True)
    read = run(idle, idle)
    assert len(calls) == 2 and not pool.any()
    assert all(torch.equal(a, b) for a, b in zip(skipped, read))
    plan = idle.clone()
    plan[1] = 2
    run(plan, idle)
    assert torch.equal(pool[2], (x[1] + r[1]).float()) and not pool[[0, 1, 3]].any()


@pytest.mark.parametrize("tables, captured", [("ab", "ab"), ("a", ""), ("", "b")])
def test_plain_op_is_the_full_op_on_cpu(monkeypatch, tables, captured):
    """``steered_norm_plain`` (what a site with vectors and capture only calls: a slot's table and flag, None for
    none) gives the full op's outputs and pool rows."""
    from vllm_steer.kernels.capture_rows import live

    op.register()
    monkeypatch.setattr(live, "capture_live", True)
    n, d = 6, 32
    x, r, (ta, tb), index = _case(n, d, torch.float32, seed=40)
    w = torch.randn(d, generator=torch.Generator().manual_seed(41))
    plans = {slot: None for slot in "ab"}
    for k, slot in enumerate(captured):
        plans[slot] = torch.full((n + 5,), -1, dtype=torch.int32)
        plans[slot][[1 + k, 4]] = torch.tensor([0, 2], dtype=torch.int32) + k
    pools = [torch.zeros(4, d) if captured else None for _ in range(2)]
    vec = {slot: [t, _on()] if slot in tables else [] for slot, t in (("a", ta), ("b", tb))}
    got = torch.ops.vllm_steer.steered_norm_plain(x, r, w, 1e-5, 0.0, index, *(vec["a"] or [None, None]),
                                                  *(vec["b"] or [None, None]), plans["a"], plans["b"], pools[0])
    want = torch.ops.vllm_steer.steered_norm(x, r, w, 1e-5, 0.0, index, vec["a"], vec["b"], [], [], 0, 0, [], None,
                                             plans["a"], plans["b"], pools[1], [], [], [])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if captured:
        assert torch.equal(pools[0], pools[1]) and pools[0].any()


@pytest.mark.parametrize("kind", ["vectors", "fp8", "projections"])
def test_a_programmatic_dependent_launch_passes_every_constexpr_up_to_its_flag(monkeypatch, kind):
    """``pdl=True``: the launch carries Triton's ``launch_pdl`` and the kernel's PDL constexpr, every constexpr
    before it given (the launcher passes them by position: a short tuple would set the wrong ones); ``pdl=False``
    launches as before (no PDL, no extra constexprs)."""
    from vllm_steer.kernels.steered_rms_norm import triton as tri

    seen = []

    def launch(grid, args, constexprs, num_warps, num_stages=None, spec=None, launch_pdl=False):
        names = tri._steered_norm_kernel.arg_names
        seen.append((dict(zip(names[len(args):], constexprs)), len(args) + len(constexprs) == len(names), launch_pdl))

    monkeypatch.setattr(tri, "_KERNEL", launch)
    monkeypatch.setattr(tri, "_PDL_OK", True)
    x, r, (ta, tb), index = _case(4, 64, torch.bfloat16, seed=40)
    w = torch.ones(64, dtype=torch.bfloat16)
    kw = {"vec_a": (ta, _on()), "vec_b": (tb, _on())}
    if kind == "fp8":
        kw["quant"] = (torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.empty(4, 1), 2)
    if kind == "projections":
        kw["proj_a"] = (torch.ones(R, dtype=torch.int32), torch.ones(R, 1, 64), torch.zeros(R, 1, 2))
    for pdl in (True, False):
        tri.steered_norm_triton(x, r, w, 1e-5, 0.0, index, pdl=pdl, **kw)
    (on, full, pdl_on), (off, _, pdl_off) = seen
    assert full and pdl_on and on["PDL"] is True and on["AR"] == 0 and on["EARLY"] == off["EARLY"]
    assert on["QUANT"] == (2 if kind == "fp8" else 0) and on["PROJ_A"] == (kind == "projections")
    assert not pdl_off and "PDL" not in off
    assert {k: v for k, v in on.items() if k in off} == off  # the same kernel otherwise
