"""GPU checks of full SAE packs (TopK, reconstruct) on the tensor-core path (``kernels/sae_clamp/full_triton.py``
through ``op.triton_path``, what the registered op runs on CUDA); runs only where CUDA is available.

- the op against the reference (``steered_norm_naive`` with the same bf16 weights) for N from 1 to 2048, D 4096 and
  an odd one, d_sae 16384 and one that is not a multiple of the tiles, TopK (k 64) and JumpReLU, slots A / B / both,
  every row kind in the batch (OFF, DELTA, DELTA without codes, RECONSTRUCT); tokens whose TopK boundary (the k-th
  and k+1-th pre-activation) or a clamped feature's threshold sits within MARGIN are left out (a rounding there
  flips a feature); tokens of row 0 / OFF rows / bare DELTA rows equal the kernel without SAE bit for bit;
- inside a CUDA graph captured while every row was OFF, rows written in place afterwards take effect at replay;
- an idle step (no row on) launches only the full path's early-exit kernels (4 per full slot A, 5 per slot B) and
  the norm: no GEMM.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("full_fp32_matmuls")]

from tests.gpu.norm_inputs import DTYPES, check_outputs, full_fp32_matmuls, norm_inputs  # noqa: E402,F401
from tests.sae_packs import R, full_pack, token_rows  # noqa: E402
from vllm_steer.kernels.sae_clamp.packed import _full_features, apply_site_naive  # noqa: E402
from vllm_steer.kernels.steered_rms_norm import op  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton  # noqa: E402

# bf16 model: its rounding (one unit in the last place); float32 model: the stream split into bf16 hi + lo (2^-17
# relative per operand) against the same bf16 weights, sums over d_sae in another order, reconstruct's s + (recon - s)
TOL = {torch.float32: dict(rtol=1e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
EPS = 1e-5
MARGIN = 2e-3
THR = 0.01  # JumpReLU thresholds in [0, THR): a feature flipping at one (a rounding) moves f by < THR
IDLE = (0, 2, 3)  # row 0, an OFF row with codes, a DELTA row without codes



def _case(n, d, f, dtype, slots, topk, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    index = token_rows(n, "cuda")
    packs = {k: full_pack(d, f, 64, seed=seed + i, topk=topk, device="cuda", thr_scale=THR) if k in slots else []
             for i, k in enumerate("ab")}
    a = dict(vec_a=[ta, _flag()], vec_b=[tb, _flag()], sae_a=packs["a"], sae_b=packs["b"],
             topk_a=topk if "a" in slots else 0, topk_b=topk if "b" in slots else 0)
    return x, r, w, index, a


def _flag():
    return torch.ones(1, dtype=torch.uint8, device="cuda")


def _args(x, r, w, index, a):
    return (x, r, w, EPS, 0.0, index, a["vec_a"], a["vec_b"], a["sae_a"], a["sae_b"], a["topk_a"], a["topk_b"], [],
            None, None, None, None, [], [], [])


def _ambiguous(x, r, index, a) -> torch.Tensor:
    """[N] bool: tokens whose TopK boundary (k-th vs k+1-th pre) is within MARGIN, or one of whose clamped features'
    pre is within MARGIN / 20 of its threshold (only_if_active flips there), at either slot. JumpReLU thresholds are
    small here (``THR``), so an unclamped feature flipping at its threshold moves the stream by less than the
    tolerance."""
    n = x.shape[0]
    rows = index[:n].long()
    s = x.float() + r.float()
    out = torch.zeros(n, dtype=torch.bool, device="cuda")
    for pack, k, vec in ((a["sae_a"], a["topk_a"], a["vec_a"]), (a["sae_b"], a["topk_b"], a["vec_b"])):
        if pack:
            pre = s @ pack[8].float() + pack[9]
            if k:
                top = pre.topk(k + 1, dim=-1).values
                out |= (top[:, k - 1] - top[:, k]).abs() < MARGIN
            else:
                clamped = pre[:, pack[7]]
                out |= ((clamped - pack[10][pack[7]]).abs() < MARGIN / 20).any(dim=-1)
            s = apply_site_naive(s, rows, pack, k)
        s = s + vec[0][rows].float()
    return out


def _check(got, want, plain, index, dtype, ambiguous):
    check_outputs(got, want, plain, index, TOL[dtype], ambiguous, IDLE)


CASES = [pytest.param(n, d, f, name, slots, k, id=f"N{n}-D{d}-F{f}-{name}-{slots}-k{k}")
         for n, d, f in ((1, 4096, 16384), (16, 4096, 16384), (300, 4096, 16384), (2048, 4096, 16384),
                         (37, 4099, 1000), (300, 2048, 40000))
         for name in ("bfloat16", "float32") for slots in ("a", "b", "ab") for k in (0, 64)
         if not (n == 2048 and name == "float32")]


@pytest.mark.parametrize("n,d,f,dtype_name,slots,topk", CASES)
def test_full_slots_match_reference(n, d, f, dtype_name, slots, topk):
    dtype = DTYPES[dtype_name]
    x, r, w, index, a = _case(n, d, f, dtype, slots, topk, seed=n + d + f + topk)
    got = op.triton_path(*_args(x, r, w, index, a))
    want = steered_norm_naive(*_args(x, r, w, index, a))
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, vec_a=a["vec_a"], vec_b=a["vec_b"])
    _check(got, want, plain, index, dtype, _ambiguous(x, r, index, a))
    if n >= 7:
        live = ~torch.isin(index[:n].long(), torch.tensor(IDLE, device="cuda"))
        assert not torch.allclose(got[1][live].float(), plain[1][live].float(), rtol=1e-2, atol=1e-2)


def test_topk_selects_the_reference_features():
    """The TopK search's features are torch.topk's (the decode coefficients of a RECONSTRUCT row with no clamp
    are exactly the reference's activations, ties aside)."""
    from vllm_steer.kernels.sae_clamp import full_triton

    n, d, f, k = 64, 4096, 16384, 64
    pack = full_pack(d, f, 64, seed=5, topk=k, device="cuda", modes=(0, 2, 2, 2, 2, 2))
    pack[1].zero_()
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(n, d, generator=g, device="cuda") * 3
    index = torch.ones(n, dtype=torch.int32, device="cuda")
    seen = {}
    real = full_triton._DECODE

    def spy(grid, args, constexprs, num_warps):  # keeps the coefficients _decode reads
        seen["coef"] = args[0].clone()
        real(grid, args, constexprs, num_warps)

    full_triton._DECODE = spy
    try:
        full_triton.site_edit(x, None, index, pack, k)
    finally:
        full_triton._DECODE = real
    want = _full_features(x.float(), pack, k)
    top = (x.float() @ pack[8].float() + pack[9]).topk(k + 1, dim=-1).values
    keep = (top[:, k - 1] - top[:, k]).abs() >= MARGIN
    assert int(keep.sum()) >= n // 2
    assert torch.equal(seen["coef"][:n][keep] != 0, want[keep] != 0)
    torch.testing.assert_close(seen["coef"][:n][keep], want[keep], rtol=1e-4, atol=1e-4)


def test_full_slots_in_a_cuda_graph_follow_rows_changed_after_capture():
    n, d, f, dtype = 24, 4096, 16384, torch.bfloat16
    x, r, w, index, a = _case(n, d, f, dtype, "ab", 64, seed=11)
    steered = [[t.clone() for t in p[:3]] for p in (a["sae_a"], a["sae_b"])]
    for p in (a["sae_a"], a["sae_b"]):
        for t in p[:3]:
            t.zero_()
    args = _args(x, r, w, index, a)
    op.triton_path(*args)  # JIT outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = op.triton_path(*args)
    graph.replay()
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, vec_a=a["vec_a"], vec_b=a["vec_b"])
    assert torch.equal(out, plain[0]) and torch.equal(res, plain[1])
    for p, rows in zip((a["sae_a"], a["sae_b"]), steered):
        for t, v in zip(p[:3], rows):
            t.copy_(v)
    graph.replay()
    want = steered_norm_naive(*args)
    _check((out, res), want, plain, index, dtype, _ambiguous(x, r, index, a))
    assert not torch.equal(res, plain[1])
    a["sae_a"][0][4] = 1  # a RECONSTRUCT row turned DELTA, B's row 5 off
    a["sae_b"][0][5] = 0
    graph.replay()
    _check((out, res), steered_norm_naive(*args), plain, index, dtype, _ambiguous(x, r, index, a))
    for p in (a["sae_a"], a["sae_b"]):
        p[0].zero_()
    graph.replay()
    assert torch.equal(out, plain[0]) and torch.equal(res, plain[1])


def test_an_idle_step_launches_only_the_early_exit_kernels():
    """Every row OFF: per full slot _compact, (slot B: _gather), _encode, _select, _decode (each returns at once),
    then the norm; no GEMM, no copy, no other kernel."""
    from torch.profiler import ProfilerActivity, profile

    n, d, f = 64, 4096, 16384
    x, r, w, index, a = _case(n, d, f, torch.bfloat16, "ab", 64, seed=21)
    for p in (a["sae_a"], a["sae_b"]):
        p[0].zero_()
    args = _args(x, r, w, index, a)
    op.triton_path(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        op.triton_path(*args)
        torch.cuda.synchronize()
    known = ("_compact", "_gather", "_encode", "_select", "_decode", "_steered_norm_kernel")
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    counts = {k: sum(n.startswith(k) for n in names) for k in known}
    # slot A's GEMMs read x + residual themselves (no _gather); slot B gathers the stream after slot A's features
    assert len(names) == 10 and counts == {**dict.fromkeys(known[:5], 2), "_gather": 1, "_steered_norm_kernel": 1}, names
