"""GPU checks of full SAE packs (TopK, reconstruct) on the tensor-core path (``kernels/sae_clamp/full_triton.py``
through ``op.triton_path``, what the registered op runs on CUDA); runs only where CUDA is available.

- the op against the reference (``steered_norm_naive`` with the same bf16 weights) for N from 1 to 2048, D 4096 and
  an odd one, d_sae 16384 and one that is not a multiple of the tiles, TopK (k 64) and JumpReLU, slots A / B / both,
  every row kind in the batch (OFF, DELTA, DELTA without codes, RECONSTRUCT), each element within the norm's
  rounding plus a bound derived from the kernels' arithmetic (``_gemm_eps``, ``_slot_bounds``); tokens on which a
  clamped feature may flip (its pre within that bound of its threshold, or of the TopK boundary) are left out;
  with both slots each stage is checked on its own (``_check_case``); tokens of row 0 / OFF rows / bare DELTA rows
  equal the kernel without SAE bit for bit;
- a smaller SAE padded into a runtime full reservation (``_PAD_BIAS``) acts as the SAE itself;
- inside a CUDA graph captured while every row was OFF, rows written in place afterwards take effect at replay;
- an idle step (no row on) launches only the full path's early-exit kernels (5 per full slot A, 6 per slot B at N 64)
  and the norm: no GEMM.
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

# The norm's own rounding (bf16 model: one unit in the last place; float32: sums in another order), to which each
# element's derived bound (``_check_case``) is added
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
EPS = 1e-5
MARGIN = 2e-3  # test_topk_selects_the_reference_features: tokens whose TopK boundary is nearer are left out
THR = 0.01  # JumpReLU thresholds in [0, THR), but the clamped features' in [0, CLAMPED_THR)
CLAMPED_THR = 0.8  # (a rounding flips an unclamped feature by < THR; a clamped feature's threshold moves its f' - f)
DEC_SCALE = 1 / 16  # W_dec scaled (exactly: a power of 2) so a reconstruction has the stream's size, as a trained SAE's
IDLE = (0, 2, 3)  # row 0, an OFF row with codes, a DELTA row without codes
SIGMAS = 6.0  # independent rounding errors summed over a dot product: bounded at 6 standard deviations


def _gemm_eps(k: int) -> float:
    """The full kernels' worst-case GEMM error relative to sum |a| |w| of each output (``full_triton._tile_dot``):
    the float32 operand's bf16 hi + lo split (2^-17: the GPU rounds to nearest, 2^-18; Triton's interpreter
    truncates, 2^-16, but this file runs on CUDA only), the tensor cores' accumulation inside one 64-deep K tile (at
    most one unit of 2^-23 per product, hi and lo: 128 of them, whatever the MMA's order and rounding) and the IEEE
    running sums over the K tiles and the decoder's splits (2^-24 each, at most 16 splits); plus the reference's own
    float32 GEMM (cuBLAS, nearest rounding: unbiased, 6 sigma of sqrt(k) roundings)."""
    return 2.0 ** -17 + 128 * 2.0 ** -23 + (-(-k // 64) + 16) * 2.0 ** -24 + SIGMAS * k ** 0.5 * 2.0 ** -24


def _case(n, d, f, dtype, slots, topk, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    index = token_rows(n, "cuda")
    packs = {k: _shaped(full_pack(d, f, 64, seed=seed + i, topk=topk, device="cuda", thr_scale=THR), seed + i)
             if k in slots else [] for i, k in enumerate("ab")}
    a = dict(vec_a=[ta, _flag()], vec_b=[tb, _flag()], sae_a=packs["a"], sae_b=packs["b"],
             topk_a=topk if "a" in slots else 0, topk_b=topk if "b" in slots else 0)
    return x, r, w, index, a


def _shaped(pack, seed):
    """W_dec scaled by DEC_SCALE; JumpReLU: the clamped features' thresholds drawn from [0, CLAMPED_THR)."""
    pack[4] = pack[4] * DEC_SCALE
    pack[11] = pack[11] * DEC_SCALE
    if bool(pack[10].any()):
        g = torch.Generator().manual_seed(seed)
        thr = (torch.rand(pack[7].shape[0], generator=g) * CLAMPED_THR).to(pack[6].device)
        pack[6] = thr
        pack[10] = pack[10].index_put((pack[7],), thr)
    return pack


def _flag():
    return torch.ones(1, dtype=torch.uint8, device="cuda")


def _args(x, r, w, index, a):
    return (x, r, w, EPS, 0.0, index, a["vec_a"], a["vec_b"], a["sae_a"], a["sae_b"], a["topk_a"], a["topk_b"], [],
            None, None, None, None, [], [], [])


def _dev(e2: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SIGMAS standard deviations of sum_k err_k w_k for independent errors of variance ``e2`` (= bound^2)."""
    return SIGMAS * (e2 @ w2).clamp_min(0).sqrt()


def _slot_bounds(s, err, rows, pack, k) -> tuple[torch.Tensor, torch.Tensor]:
    """(ambiguous [N] bool, err') for one full slot: ``s`` the reference's float32 stream reaching it, ``err`` [N, D] a
    bound on the kernel's stream error there per element, ``err'`` the bound after the slot.

    A bound ``m`` on the kernel's pre-activation error: ``_gemm_eps(D) * sum |s| |W_enc|`` plus ``err`` carried
    through W_enc. A feature within ``m`` of its threshold may flip (kernel and reference both right to their
    rounding): if it is clamped (a code other than NONE) the token is ambiguous (a flip may move f' by a clamp's
    value: SET under only_if_active); at a RECONSTRUCT row an unclamped flip moves f by at most thr + m, which goes
    into the bound through |W_dec|. TopK: where the k-th and k+1-th pre are within 2 max(m), a RECONSTRUCT token is
    ambiguous (its k-th feature may change), a DELTA token only if a clamped feature is in that band. The decode
    adds ``_gemm_eps(F) * sum |coef| |W_dec|`` and the coefficients' own error (m times their slope in pre) carried
    through W_dec."""
    from vllm_steer.kernels.sae_clamp.packed import _clamped

    mode = pack[0][rows]
    on, recon = mode != 0, (mode == 2)[:, None]
    w_enc, w_dec, thr, feats = pack[8].float(), pack[11].float(), pack[10], pack[7]
    pre = s @ w_enc + pack[9]
    m = _gemm_eps(s.shape[1]) * (s.abs() @ w_enc.abs()) + _dev(err * err, w_enc * w_enc)
    f_all = _full_features(s, pack, k)
    code, value = pack[1][rows], pack[2][rows]
    fc = f_all[:, feats]
    fn = _clamped(fc, code, value)
    slope = torch.where(recon, (f_all != 0).float(), torch.zeros_like(f_all))  # d coef / d pre, at most
    slope[:, feats] = torch.where((code & 3) != 0, 1 + value.abs(), slope[:, feats])
    coded = torch.zeros_like(pre, dtype=torch.bool)
    coded[:, feats] = (code & 3) != 0
    if k:  # kernel and reference may rank differently only if the k-th and k+1-th are within 2 M (M: the largest m)
        top = pre.topk(k + 1, dim=-1).values
        big = 2 * m.max(-1, keepdim=True).values
        swap = (top[:, k - 1:k] - top[:, k:]) < big
        band = (pre > top[:, k:] - big) & (pre < top[:, k - 1:k] + big)  # features that may change sides
        amb = on & swap[:, 0] & (recon[:, 0] | (band & coded).any(-1))
        flips = torch.zeros_like(s)
    else:
        near = (pre - thr).abs() < m
        amb = on & (near & coded).any(-1)
        flips = torch.where(near & recon, thr.abs() + m, torch.zeros_like(m)) @ w_dec.abs()
    coef = torch.where(recon, f_all, torch.zeros_like(f_all))
    coef[:, feats] = torch.where(recon, fn, fn - fc)
    e_dec = _gemm_eps(w_dec.shape[0]) * (coef.abs() @ w_dec.abs()) + _dev((m * slope) ** 2, w_dec * w_dec) + flips
    s_new = apply_site_naive(s, rows, pack, k)
    e_dec = e_dec + 2.0 ** -22 * (s.abs() + s_new.abs())  # the edit's (recon + b_dec - s) and the add's roundings
    return amb, torch.where(on[:, None], torch.where(recon, e_dec, err + e_dec), err)


def _out_bound(s, err, w) -> torch.Tensor:
    """The norm's output bound from its stream's: out = w s / rms(s), |d out| <= |w| (err + |s| rms(err) / rms(s)) /
    rms(s) to first order (+1%)."""
    inv = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
    return 1.01 * w.float().abs() * inv * (err + s.abs() * inv * err.pow(2).mean(-1, keepdim=True).sqrt())


def _check_case(got, x, r, w, index, a, plain, dtype):
    """The op's outputs ``got`` against the reference within the derived bounds. One full slot: the reference from
    x + residual. Both: the errors of two GEMM stages compound into bounds too loose to test, so each stage is
    checked tightly on its own: slot A's edit (``site_edit``, what the op adds) against the reference's slot A, then
    the op's outputs against the reference of slot B (and the norm) from the stream the kernels gave slot B (x +
    residual + slot A's edit + A's vectors: what ``_gather`` builds)."""
    from vllm_steer.kernels.sae_clamp.full_triton import site_edit

    n = x.shape[0]
    rows = index[:n].long()
    s = x.float() + r.float()
    zero = torch.zeros_like(s)
    if a["sae_a"] and a["sae_b"]:
        amb_a, err_a = _slot_bounds(s, zero, rows, a["sae_a"], a["topk_a"])
        on_a = (a["sae_a"][0][rows] != 0)[:, None]
        s_a = torch.where(on_a, s + site_edit(x, r, index, a["sae_a"], a["topk_a"]), s)
        want_a = apply_site_naive(s, rows, a["sae_a"], a["topk_a"])
        keep = ~amb_a
        assert n <= 2 or int(keep.sum()) >= (n + 1) // 2, "too many tokens on a threshold at slot A"
        bad = ~((s_a - want_a).abs() <= 1e-5 * want_a.abs() + 1e-5 + err_a)[keep]
        assert not bad.any(), f"slot A's stream: {int(bad.sum())} elements off its bound"
        s = s_a + a["vec_a"][0][rows].float()
        tail = dict(sae_a=a["sae_b"], topk_a=a["topk_b"], vec_a=a["vec_b"])
        want = steered_norm_naive(s, None, w, EPS, 0.0, index, tail["vec_a"], (), tail["sae_a"], (), tail["topk_a"])
        want = tuple(t.to(dtype) for t in want)
        slots = ((a["sae_b"], a["topk_b"], a["vec_b"]),)
    else:
        want = steered_norm_naive(*_args(x, r, w, index, a))
        slots = ((a["sae_a"], a["topk_a"], a["vec_a"]), (a["sae_b"], a["topk_b"], a["vec_b"]))
    err = 2.0 ** -22 * s.abs()  # the kernels' gather (slot B's stream) may round once more than this sum
    amb = torch.zeros(n, dtype=torch.bool, device=x.device)
    for pack, k, vec in slots:
        if pack:
            amb_p, err = _slot_bounds(s, err, rows, pack, k)
            amb |= amb_p
            s = apply_site_naive(s, rows, pack, k)
        s = s + vec[0][rows].float()
    check_outputs(got, want, plain, index, TOL[dtype], amb, IDLE, (_out_bound(s, err, w), err))


CASES = [pytest.param(n, d, f, name, slots, k, id=f"N{n}-D{d}-F{f}-{name}-{slots}-k{k}")
         for n, d, f in ((1, 4096, 16384), (16, 4096, 16384), (300, 4096, 16384), (2048, 4096, 16384),
                         (37, 4099, 1000), (300, 2048, 40000))
         for name in ("bfloat16", "float32") for slots in ("a", "b", "ab") for k in (0, 64)
         if not (n == 2048 and name == "float32")]
# a float32 model past 512 tokens (the profile run): the 128-token tiles' stages overflowed shared memory (360 KB of
# 227 on H100 / H200; found by tests/gpu_e2e/test_sae_full_engine_gpu.py), so a float32 stream takes the 64-token tile
CASES += [pytest.param(2048, 4096, 16384, "float32", "a", 0, id="N2048-D4096-F16384-float32-a-k0")]


@pytest.mark.parametrize("n,d,f,dtype_name,slots,topk", CASES)
def test_full_slots_match_reference(n, d, f, dtype_name, slots, topk):
    dtype = DTYPES[dtype_name]
    x, r, w, index, a = _case(n, d, f, dtype, slots, topk, seed=n + d + f + topk)
    got = op.triton_path(*_args(x, r, w, index, a))
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, vec_a=a["vec_a"], vec_b=a["vec_b"])
    _check_case(got, x, r, w, index, a, plain, dtype)
    if n >= 7:
        live = ~torch.isin(index[:n].long(), torch.tensor(IDLE, device="cuda"))
        assert not torch.allclose(got[1][live].float(), plain[1][live].float(), rtol=1e-2, atol=1e-2)


def _padded(pack, width):
    """``pack`` as a runtime full reservation of ``width`` features holds it (``SaeTables.load_runtime``): W_enc /
    W_dec zero past its d_sae, b_enc ``_PAD_BIAS`` there, thresholds zero."""
    from vllm_steer.runtime.sae_tables import _PAD_BIAS

    d, f = pack[8].shape
    out = list(pack)
    out[8] = torch.zeros(d, width, dtype=pack[8].dtype, device="cuda")
    out[9] = torch.full((width,), _PAD_BIAS, device="cuda")
    out[10] = torch.zeros(width, device="cuda")
    out[11] = torch.zeros(width, d, dtype=pack[11].dtype, device="cuda")
    out[8][:, :f], out[9][:f], out[10][:f], out[11][:f] = pack[8], pack[9], pack[10], pack[11]
    return out


@pytest.mark.parametrize("slots,topk", [("a", 0), ("a", 64), ("ab", 64), ("b", 0)])
def test_a_padded_full_reservation_acts_as_its_sae(slots, topk):
    """A 1000-feature SAE staged in a 16384-feature reservation: the op on the padded pack within the bounds of the
    reference on the SAE's own pack (the padding never activates, never enters a TopK)."""
    n, d, f, dtype = 300, 4096, 1000, torch.bfloat16
    x, r, w, index, a = _case(n, d, f, dtype, slots, topk, seed=77 + topk)
    padded = dict(a, **{f"sae_{k}": _padded(a[f"sae_{k}"], 16384) for k in slots})
    got = op.triton_path(*_args(x, r, w, index, padded))
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, vec_a=a["vec_a"], vec_b=a["vec_b"])
    _check_case(got, x, r, w, index, a, plain, dtype)
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


def test_full_pack_launches_keep_the_direct_launch_path():
    """Every full-pack kernel launched twice on the engine's path (default tuning) goes through the cached direct
    launch: s29's GPU run found ``_encode``'s defaulted constexprs turning it off for the whole process."""
    from vllm_steer.kernels.launch_cache import CachedLauncher
    from vllm_steer.kernels.sae_clamp import full_triton

    pack = full_pack(4096, 16384, 64, seed=5, topk=64, device="cuda", modes=(0, 2, 2, 2, 2, 2))
    x = torch.randn(16, 4096, device="cuda")
    index = torch.ones(16, dtype=torch.int32, device="cuda")
    first = full_triton.site_edit(x, None, index, pack, 64).clone()
    assert CachedLauncher.direct
    torch.testing.assert_close(full_triton.site_edit(x, None, index, pack, 64), first, rtol=0, atol=0)
    assert CachedLauncher.direct and all(launch.cache for launch in (full_triton._ENCODE, full_triton._SELECT))


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
    _check_case((out, res), x, r, w, index, a, plain, dtype)
    assert not torch.equal(res, plain[1])
    a["sae_a"][0][4] = 1  # a RECONSTRUCT row turned DELTA, B's row 5 off
    a["sae_b"][0][5] = 0
    graph.replay()
    _check_case((out, res), x, r, w, index, a, plain, dtype)
    for p in (a["sae_a"], a["sae_b"]):
        p[0].zero_()
    graph.replay()
    assert torch.equal(out, plain[0]) and torch.equal(res, plain[1])


def test_an_idle_step_launches_only_the_early_exit_kernels():
    """Every row OFF: slot A _encode (it lists the on tokens itself up to 256 tokens: no _compact since s30), _select,
    _decode (N 64 splits the decoder over d_sae; its last program a tile adds the splits: no _reduce since s30);
    slot B _compact, _gather, _encode, _select, _decode; each returns at once; then the norm; no GEMM, no copy, no
    other kernel."""
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
    assert len(names) == 9 and counts == {**dict.fromkeys(known[:5], 2), "_compact": 1, "_gather": 1,
                                          "_steered_norm_kernel": 1}, names
