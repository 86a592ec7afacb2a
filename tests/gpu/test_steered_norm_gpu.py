"""GPU checks of the steered norm's Triton kernel (runs only where CUDA is available).

- Triton vs the plain-torch reference for every (N, D, dtype, norm kind, tables): the new residual
  bit for bit (the same float32 sums in the same order), the normalized output within a few units
  in the last place (the reductions sum in another order);
- unsteered tokens equal vLLM's own norm: its CUDA kernel (``_C.fused_add_rms_norm``) and its native
  implementation compiled by Inductor;
- inside a CUDA graph captured while the tables were idle, tables, index and flags changed in place
  afterwards take effect at replay; under ``torch.compile(fullgraph=True)`` zero tables are not
  folded away (the op is opaque).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from vllm_steer.kernels.steered_rms_norm import op  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton  # noqa: E402
from tests.gpu.norm_inputs import DTYPES, TOL, norm_inputs, same_rows  # noqa: E402

R = 9
EPS = 1e-5


def _case(n: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    index = torch.randint(1, R, (n + 37,), generator=g, device="cuda", dtype=torch.int32)
    index[: n : 3] = 0
    return x, r, w, ta, tb, index


def _flag(v: int) -> torch.Tensor:
    return torch.full((1,), v, dtype=torch.uint8, device="cuda")


CASES = [pytest.param(n, d, name, kind, tables, id=f"N{n}-D{d}-{name}-{kind}-{tables}")
         for n in (1, 7, 256, 8192) for d in (64, 4096, 4099, 8192) for name in DTYPES
         for kind in ("rms", "gemma") for tables in ("none", "ab")]
CASES += [pytest.param(16, 4096, name, "rms", tables, id=f"N16-D4096-{name}-rms-{tables}")
          for name in DTYPES for tables in ("a", "b")]


@pytest.mark.parametrize("n,d,dtype_name,kind,tables", CASES)
def test_triton_matches_reference(n, d, dtype_name, kind, tables):
    dtype = DTYPES[dtype_name]
    x, r, w, ta, tb, index = _case(n, d, dtype, seed=n * 31 + d)
    offset = 1.0 if kind == "gemma" else 0.0
    vec = {f"vec_{slot}": (t, _flag(1)) for slot, t in (("a", ta), ("b", tb)) if slot in tables}
    out, res = steered_norm_triton(x, r, w, EPS, offset, index, **vec)
    want_out, want_res = steered_norm_naive(x, r, w, EPS, offset, index, **vec)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    if tables != "none":  # unsteered tokens are exactly the unsteered norm's rows
        plain_out, plain_res = steered_norm_triton(x, r, w, EPS, offset, torch.zeros_like(index))
        rows = index[:n] == 0
        same_rows(out[rows], plain_out[rows])
        same_rows(res[rows], plain_res[rows])


def _views(n: int, d: int, shift: int, seed: int):
    """The case's x and residual as views whose data starts ``shift`` elements into a buffer."""
    x, r, w, ta, tb, index = _case(n, d, torch.bfloat16, seed)
    out = []
    for t in (x, r):
        buf = torch.empty(n * d + shift, dtype=t.dtype, device="cuda")
        v = buf[shift:].view(n, d)
        v.copy_(t)
        out.append(v)
    return (*out, w, ta, tb, index)


def test_cached_launch_keeps_each_specialization_apart():
    """kernels.launch_cache: a repeated specialization launches the cached compiled kernel directly;
    a base pointer off 16-byte alignment or a row stride that is no multiple of 16 gets its own
    kernel. Interleaved calls (aligned, shifted, odd D) each equal the reference, the first call of
    each (Triton's own launch) equals the later ones (the direct launch) bit for bit."""
    from vllm_steer.kernels.launch_cache import CachedLauncher
    from vllm_steer.kernels.steered_rms_norm import triton as tri

    assert CachedLauncher.direct, "the installed Triton's launcher is not the one the direct path calls"
    cases = [(9, 4096, 0), (9, 4096, 1), (9, 4099, 0), (9, 4096, 8), (300, 4096, 3)]
    first = {}
    for rnd in range(3):
        for n, d, shift in cases:
            x, r, w, ta, tb, index = _views(n, d, shift, seed=n + d + shift)
            vec = {"vec_a": (ta, _flag(1)), "vec_b": (tb, _flag(1))}
            out, res = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec)
            want_out, want_res = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec)
            assert torch.equal(res, want_res), (n, d, shift, rnd)
            torch.testing.assert_close(out, want_out, **TOL[torch.bfloat16])
            if rnd == 0:
                first[(n, d, shift)] = (out, res)
            else:
                assert torch.equal(out, first[(n, d, shift)][0]) and torch.equal(res, first[(n, d, shift)][1])
    keys = list(tri._KERNEL.cache)
    # every address 16-byte aligned: the wrapper's own flat key (x's dtype first); else spec_of's (x's alignment bit)
    aligned = {isinstance(k[0][0], torch.dtype) or k[0][0][1] for k in keys}
    assert aligned == {True, False} and CachedLauncher.direct


@pytest.mark.parametrize("slots, captured", [("ab", "ab"), ("a", ""), ("b", "a")])
def test_plain_op_equals_the_full_op_on_cuda(slots, captured):
    """``steered_norm_plain`` (a site with vectors and capture only: 13 arguments, no lists) launches the same
    kernel as ``steered_norm``: outputs, new residual and pool rows equal bit for bit, eager and in a CUDA graph."""
    op.register()
    n, d = 24, 4096
    x, r, w, ta, tb, index = _case(n, d, torch.bfloat16, seed=21)
    tables = {s: (t, _flag(1)) if s in slots else (None, None) for s, t in (("a", ta), ("b", tb))}
    plans = {s: None for s in "ab"}
    for k, s in enumerate(captured):
        plans[s] = torch.full((n,), -1, dtype=torch.int32, device="cuda")
        plans[s][[1, 5 + k, 20]] = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda") + k
    pools = [torch.zeros(6, d, dtype=torch.bfloat16, device="cuda") if captured else None for _ in range(3)]

    def plain(pool):
        return torch.ops.vllm_steer.steered_norm_plain(x, r, w, EPS, 0.0, index, *tables["a"], *tables["b"],
                                                       plans["a"], plans["b"], pool)

    full = torch.ops.vllm_steer.steered_norm(x, r, w, EPS, 0.0, index, [t for t in tables["a"] if t is not None],
                                             [t for t in tables["b"] if t is not None], [], [], 0, 0, [], None,
                                             plans["a"], plans["b"], pools[0], [], [], [])
    eager = plain(pools[1])
    plain(pools[2])  # compiled outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = plain(pools[2])
    graph.replay()
    for got in (eager, replayed):
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
    if captured:
        assert torch.equal(pools[1], pools[0]) and torch.equal(pools[2], pools[0]) and pools[0].any()


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 16, 2048])
def test_unsteered_equals_vllm_norm_kernels(n, dtype_name):
    """Against vLLM's CUDA fused_add_rms_norm (eager vLLM) and its native op compiled by Inductor."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    dtype = DTYPES[dtype_name]
    x, r, w, ta, _, index = _case(n, 4096, dtype, seed=n)
    out, res = steered_norm_triton(x, r, w, EPS, 0.0, index, vec_a=(ta, _flag(0)))
    cx, cr = x.clone(), r.clone()
    torch.ops._C.fused_add_rms_norm(cx, cr, w, EPS)
    assert torch.equal(res, cr)
    torch.testing.assert_close(out, cx, **TOL[dtype])
    native = torch.compile(fused_add_rms_norm.impls["native"].impl_fn, fullgraph=True)
    nx, nr = native(x, r, w, EPS)
    assert torch.equal(res, nr)
    torch.testing.assert_close(out, nx, **TOL[dtype])


@pytest.fixture(scope="module")
def registered():
    """The registered op called with vector descriptors only (every other feature off; its schema has no
    defaults: vec_a, vec_b, sae_a, sae_b, topk_a, topk_b, cond, gate, plan_a, plan_b, pool, proj_a, proj_b)."""
    op.register()

    def steered_norm(x, r, w, index, vec_a, vec_b=()):
        return torch.ops.vllm_steer.steered_norm(x, r, w, EPS, 0.0, index, list(vec_a), list(vec_b), [], [], 0, 0,
                                                 [], None, None, None, None, [], [], [])

    return SimpleNamespace(steered_norm=steered_norm)


def test_op_in_cuda_graph_follows_tables_changed_after_capture(registered):
    n, d, dtype = 16, 4096, torch.bfloat16
    x, r, w, ta, tb, index = _case(n, d, dtype, seed=7)
    steered_index = index.clone()
    index.zero_()
    fa, fb = _flag(0), _flag(0)
    registered.steered_norm(x, r, w, index, (ta, fa), (tb, fb))  # JIT outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = registered.steered_norm(x, r, w, index, (ta, fa), (tb, fb))
    graph.replay()
    plain = steered_norm_naive(x, r, w, EPS, 0.0, torch.zeros_like(index))
    torch.testing.assert_close(out, plain[0], **TOL[dtype])
    index.copy_(steered_index)
    fa.fill_(1)
    fb.fill_(1)
    graph.replay()
    want = steered_norm_naive(x, r, w, EPS, 0.0, steered_index, vec_a=(ta, fa), vec_b=(tb, fb))
    assert torch.equal(res, want[1])
    torch.testing.assert_close(out, want[0], **TOL[dtype])
    fa.fill_(0)
    fb.fill_(0)
    graph.replay()
    assert torch.equal(res, plain[1])


def test_op_stays_opaque_under_torch_compile(registered):
    n, d, dtype = 8, 256, torch.float32
    x, r, w, ta, _, index = _case(n, d, dtype, seed=9)
    table = torch.zeros_like(ta)
    flag = _flag(1)

    @torch.compile(fullgraph=True)
    def f(x, r):
        return registered.steered_norm(x, r, w, index, (table, flag))

    first = f(x, r)
    torch.testing.assert_close(first[1], (x.float() + r.float()).to(dtype), rtol=0, atol=0)
    table.copy_(ta)  # after compilation: a folded zero table would ignore this
    second = f(x, r)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, vec_a=(ta, flag))
    assert torch.equal(second[1], want[1])
