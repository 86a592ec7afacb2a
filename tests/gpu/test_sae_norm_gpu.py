"""GPU checks of the steered norm's SAE clamps on its Triton path (clamp-only SAE packs; runs only where CUDA is
available).

- Triton vs the plain-torch reference (``steered_norm_naive`` with ``sae_a`` / ``sae_b``) for (N, D, dtype, SAE slots,
  vector tables, clamp-set size): within float32 rounding (the clamps' dot products sum in another
  order), tokens whose pre-activation sits on a threshold left out (there a rounding flips the feature);
- tokens of row 0, of an OFF row or of a row without codes equal the no-SAE kernel bit for bit;
- prefill sizes (past the split walk's 64 tokens: the clamps over token tiles before the norm,
  ``kernels/sae_clamp/tiled_triton.py``) on a prefill step's rows (decode tokens of several rows, two prompts, an
  unsteered prompt, OFF and code-less rows) as the reference and as the walk in the norm;
- the registered op routes clamp-only packs to Triton and full packs (TopK / reconstruct) to the full
  kernels (kernels/sae_clamp/full_triton.py) before it; inside a CUDA graph captured while every row was OFF, mode / code / value rows changed in
  place afterwards take effect at replay.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("full_fp32_matmuls")]

from tests.sae_packs import IDLE_ROWS, R, clamp_pack, prefill_rows, token_rows  # noqa: E402
from tests.gpu.norm_inputs import DTYPES, check_outputs, full_fp32_matmuls, norm_inputs  # noqa: E402,F401
from vllm_steer.kernels.sae_clamp.packed import apply_site_naive  # noqa: E402
from vllm_steer.kernels.steered_rms_norm import op  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4),  # D-long fp32 dots, cuBLAS vs one program: order differs
       torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
EPS = 1e-5
MARGIN = 1e-3  # |pre - threshold| (or |pre|, the only_if_active gate) below this: rounding may flip f



def _case(n: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    return x, r, w, ta, tb, token_rows(n, "cuda")


def _flag(v: int) -> torch.Tensor:
    return torch.full((1,), v, dtype=torch.uint8, device="cuda")


def _vecs(ta: torch.Tensor, tb: torch.Tensor, tables: str = "ab") -> dict:
    """The vector descriptors of the slots named in ``tables``, each table active."""
    return {f"vec_{slot}": (t, _flag(1)) for slot, t in (("a", ta), ("b", tb)) if slot in tables}


def _ambiguous(x, r, index, vec, pa, pb) -> torch.Tensor:
    """[N] bool: tokens with a clamped feature whose pre-activation (as the reference computes it) is
    within MARGIN of its threshold or of 0, where the two implementations may legitimately disagree."""
    n = x.shape[0]
    rows = index[:n].long()
    s = x.float() + r.float()
    out = torch.zeros(n, dtype=torch.bool, device=x.device)
    for pack, slot in ((pa, "vec_a"), (pb, "vec_b")):
        if pack:
            mode, code, _, enc, _, bias, thr = pack[:7]
            pre = s @ enc.T + bias
            near = ((pre - thr).abs() < MARGIN) | (pre.abs() < MARGIN)
            live = (code[rows] != 0) & (mode[rows] != 0)[:, None]
            out |= (near & live).any(dim=1)
            s = apply_site_naive(s, rows, pack, 0)
        if slot in vec:
            s = s + vec[slot][0][rows].float()
    return out


def _check(got, want, plain, index, dtype, ambiguous):
    check_outputs(got, want, plain, index, TOL[dtype], ambiguous, IDLE_ROWS)


CASES = [pytest.param(n, d, name, sae, tables, 37, id=f"N{n}-D{d}-{name}-sae_{sae}-vec_{tables}-C37")
         for n in (1, 7, 300) for d in (80, 4096, 4099) for name in DTYPES
         for sae in ("a", "b", "ab") for tables in ("none", "ab")]
CASES += [pytest.param(64, 4096, "bfloat16", "ab", "ab", c, id=f"N64-D4096-bfloat16-sae_ab-vec_ab-C{c}")
          for c in (1, 300, 4096, 9000)]  # 9000: several SAEs' regions sharing one site's pack
CASES += [pytest.param(16, 8192, "float32", "ab", "ab", 130, id="N16-D8192-float32-sae_ab-vec_ab-C130")]


@pytest.mark.parametrize("n,d,dtype_name,sae,tables,c", CASES)
def test_triton_sae_matches_reference(n, d, dtype_name, sae, tables, c):
    dtype = DTYPES[dtype_name]
    x, r, w, ta, tb, index = _case(n, d, dtype, seed=n * 31 + d + c)
    offset = 1.0 if d % 2 else 0.0  # GemmaRMSNorm's weight at odd D
    pa = clamp_pack(d, c, seed=d + c, jumprelu=True, device="cuda") if "a" in sae else []
    pb = clamp_pack(d, c, seed=d + c + 1, jumprelu=False, device="cuda") if "b" in sae else []
    vec = _vecs(ta, tb, tables)
    got = steered_norm_triton(x, r, w, EPS, offset, index, **vec, sae_a=pa, sae_b=pb)
    want = steered_norm_naive(x, r, w, EPS, offset, index, **vec, sae_a=pa, sae_b=pb)
    plain = steered_norm_triton(x, r, w, EPS, offset, index, **vec)
    _check(got, want, plain, index, dtype, _ambiguous(x, r, index, vec, pa, pb))
    if n >= 7:  # the clamps moved the steered tokens
        rows = index[:n].long()
        live = ~torch.isin(rows, torch.tensor(IDLE_ROWS, device="cuda"))
        assert not torch.allclose(got[1][live].float(), plain[1][live].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,c", [(2, 300), (16, 64), (16, 300), (48, 4096)])
def test_split_walks_match_the_serial_walk_and_leave_no_count(n, c):
    """The clamps shared by several programs per token (the default at decode sizes) against one program
    walking them all, every split from 2 to 16, and the counts back at zero after each launch."""
    from vllm_steer.kernels.steered_rms_norm.triton import split_buffers, split_of

    d, dtype = 4096, torch.bfloat16
    x, r, w, ta, tb, index = _case(n, d, dtype, seed=n + c)
    pa = clamp_pack(d, c, seed=c, jumprelu=True, device="cuda")
    vec = _vecs(ta, tb)
    serial = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, split=1)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, sae_a=pa)
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec)
    ambiguous = _ambiguous(x, r, index, vec, pa, [])
    assert split_of(n) > 1
    for split in sorted({2, 5, 16, split_of(n)}):
        got = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, split=split)
        _check(got, want, plain, index, dtype, ambiguous)
        keep = ~ambiguous
        for g, s_ in zip(got, serial):
            torch.testing.assert_close(g[keep], s_[keep], **TOL[dtype])
        assert not split_buffers(x.device, d)[1].any(), split


PREFILL = [pytest.param(n, "bfloat16", sae, c, id=f"N{n}-bfloat16-sae_{sae}-C{c}")
           for n in (300, 2048) for sae in ("a", "b", "ab") for c in (1, 64, 200)]
PREFILL += [pytest.param(2048, "float32", "ab", 64, id="N2048-float32-sae_ab-C64")]


@pytest.fixture()
def tiled_on(monkeypatch):
    """The tiled prefill clamps on (``VLLM_STEER_SAE_TILED``: off by default until these tests pass on a GPU)."""
    from vllm_steer.kernels.steered_rms_norm import triton as kernel

    monkeypatch.setattr(kernel, "TILED", True)


@pytest.mark.parametrize("n,dtype_name,sae,c", PREFILL)
def test_prefill_tiles_match_reference_and_the_walk(n, dtype_name, sae, c, tiled_on):
    """Prefill sizes: the clamps over token tiles (the default past 64 tokens) against the reference and against
    the walk in the norm (``tiled=False``: one program per token), slot B encoded after slot A's edit and vectors;
    tokens of row 0, OFF rows and rows without codes bit for bit the kernel without SAE."""
    from vllm_steer.kernels.steered_rms_norm.triton import tiled_of

    d, dtype = 4096, DTYPES[dtype_name]
    x, r, w, ta, tb, _ = _case(n, d, dtype, seed=n + c)
    index = prefill_rows(n, "cuda")
    pa = clamp_pack(d, c, seed=c + 5, jumprelu=True, device="cuda") if "a" in sae else []
    pb = clamp_pack(d, c, seed=c + 6, jumprelu=False, device="cuda") if "b" in sae else []
    vec = _vecs(ta, tb)
    assert tiled_of(n)
    got = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb)
    walk = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb, tiled=False)
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec)
    ambiguous = _ambiguous(x, r, index, vec, pa, pb)
    _check(got, want, plain, index, dtype, ambiguous)
    for g, s_ in zip(got, walk):
        torch.testing.assert_close(g[~ambiguous], s_[~ambiguous], **TOL[dtype])
    rows = index[:n].long()
    live = ~torch.isin(rows, torch.tensor(IDLE_ROWS, device="cuda"))
    assert not torch.allclose(got[1][live].float(), plain[1][live].float(), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def registered():
    """The registered op called with vector and SAE descriptors only (every other feature off; its schema has no
    defaults: vec_a, vec_b, sae_a, sae_b, topk_a, topk_b, cond, gate, plan_a, plan_b, pool, proj_a, proj_b)."""
    op.register()

    def steered_norm(x, r, w, index, vec, sae_a, sae_b, topk_a=0, topk_b=0):
        return torch.ops.vllm_steer.steered_norm(x, r, w, EPS, 0.0, index, list(vec.get("vec_a", ())),
                                                 list(vec.get("vec_b", ())), list(sae_a), list(sae_b), topk_a, topk_b,
                                                 [], None, None, None, None, [], [], [])

    return SimpleNamespace(steered_norm=steered_norm)


def _full(pack: list[torch.Tensor], d: int, seed: int) -> list[torch.Tensor]:
    """``pack`` grown into a full pack (TopK / reconstruct): the whole SAE, its clampable slots
    consistent with the clamp-only part."""
    g = torch.Generator().manual_seed(seed)
    feats = pack[7].cpu()
    f = int(feats.max()) + 3
    w_enc = torch.randn(d, f, generator=g) * 0.05
    w_dec = torch.randn(f, d, generator=g) * 0.3
    b_enc, thr_f = torch.randn(f, generator=g) * 0.5, torch.zeros(f)
    w_enc[:, feats] = pack[3].T.cpu()
    w_dec[feats] = pack[4].cpu()
    b_enc[feats] = pack[5].cpu()
    thr_f[feats] = pack[6].cpu()
    dev = pack[0].device
    return pack + [t.to(dev) for t in (w_enc, b_enc, thr_f, w_dec, torch.randn(d, generator=g) * 0.1)]


@pytest.mark.parametrize("which", ["a", "b"])
def test_op_routes_clamp_only_to_triton_and_full_packs_to_the_full_kernels(registered, which, monkeypatch):
    """Clamp-only packs: the one Triton launch, bit for bit; full packs (float32 weights here: IEEE dots) through
    the tensor-core path (``tests/gpu/test_sae_full_gpu.py`` tests it in depth; the default, VLLM_STEER_SAE_FULL_KERNELS=0 turns it off),
    the reference's result."""
    monkeypatch.setattr(op, "FULL_KERNELS", True)
    n, d, dtype = 32, 512, torch.bfloat16
    x, r, w, ta, tb, index = _case(n, d, dtype, seed=3)
    pa = clamp_pack(d, 37, seed=4, device="cuda")
    pb = clamp_pack(d, 37, seed=5, jumprelu=False, device="cuda")
    vec = _vecs(ta, tb)
    got = registered.steered_norm(x, r, w, index, vec, pa, pb)
    assert all(torch.equal(a, b) for a, b in zip(got, steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, sae_a=pa,
                                                                          sae_b=pb)))
    if which == "a":
        pa, topk = _full(pa, d, seed=6), (4, 0)
    else:
        pb, topk = _full(pb, d, seed=7), (0, 0)
        pb[0][1] = 2  # RECONSTRUCT: only a full pack can
    got = registered.steered_norm(x, r, w, index, vec, pa, pb, *topk)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb, topk_a=topk[0], topk_b=topk[1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


def _captured_idle(registered, x, r, w, index, vec, pa, pb):
    """(graph, its outputs, the plain kernel's) of the SAE op captured while every row is OFF; the
    outputs equal the plain kernel's at the first replay."""
    registered.steered_norm(x, r, w, index, vec, pa, pb)  # JIT outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = registered.steered_norm(x, r, w, index, vec, pa, pb)
    graph.replay()
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec)
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    return graph, out, plain


@pytest.mark.parametrize("n", [24, 300], ids=["decode-N24", "prefill-N300"])
def test_op_in_cuda_graph_follows_sae_rows_changed_after_capture(registered, n, tiled_on):
    """N 24: the walk in the norm (split); N 300 (a prefill step's rows): the tiled clamps before it, whose tiles are
    found on the device at each replay."""
    d, dtype = 4096, torch.bfloat16
    x, r, w, ta, tb, index = _case(n, d, dtype, seed=11)
    if n > 64:
        index = prefill_rows(n, "cuda")
    pa = clamp_pack(d, 37, seed=12, device="cuda")
    pb = clamp_pack(d, 37, seed=13, jumprelu=False, device="cuda")
    vec = _vecs(ta, tb)
    steered = [[t.clone() for t in p[:3]] for p in (pa, pb)]  # mode, code, value as written later
    for p in (pa, pb):
        p[0].zero_()
        p[1].zero_()
        p[2].zero_()
    graph, (out, res), plain = _captured_idle(registered, x, r, w, index, vec, pa, pb)

    for p, rows in zip((pa, pb), steered):  # the engine writes rows in place (SaeTables.write_row)
        for t, v in zip(p[:3], rows):
            t.copy_(v)
    graph.replay()
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb)
    _check((out, res), want, plain, index, dtype, _ambiguous(x, r, index, vec, pa, pb))
    assert not torch.equal(res, plain[1])

    pa[2].mul_(-2.0)  # other values, and row 5 of B switched off
    pb[0][5] = 0
    graph.replay()
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb)
    _check((out, res), want, plain, index, dtype, _ambiguous(x, r, index, vec, pa, pb))

    if n > 64:  # another step's token -> row map, written in place (as step_index does): other tiles at replay
        index.copy_(token_rows(n, "cuda"))
        graph.replay()
        want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb)
        plain = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec)
        _check((out, res), want, plain, index, dtype, _ambiguous(x, r, index, vec, pa, pb))

    pa[0].zero_()
    pb[0].zero_()
    graph.replay()
    assert torch.equal(out, plain[0]) and torch.equal(res, plain[1])


def test_runtime_sae_staged_into_a_reserved_site_after_capture(registered, tmp_path):
    """A site reserved by ``steer.sae_slots`` (SaeTables, empty pack) inside a CUDA graph captured before
    any SAE existed: staging one (``load_runtime``) and writing rows in place take effect at replay; a
    second SAE with fewer features staged over it leaves nothing of the first."""
    import numpy as np

    from tests.sae_writers import random_sae, write_gemma_scope
    from vllm_steer.core.sae_catalog import Slot
    from vllm_steer.core.sae_paths import runtime_access
    from vllm_steer.core.sae_rows import DELTA, SET, wire_entry
    from vllm_steer.runtime.sae_tables import SaeTables

    n, d, dtype, site = 24, 1024, torch.bfloat16, ("post_mlp", 3)
    x, r, w, ta, tb, index = _case(n, d, dtype, seed=21)
    sae = SaeTables({}, {site: Slot(48)}, {site}, R, d, torch.device("cuda"), runtime_access((str(tmp_path),), 1 << 30))
    pa, pb = sae.packs[site], clamp_pack(d, 8, seed=22, device="cuda")
    pb[0].zero_()
    vec = _vecs(ta, tb)
    graph, (out, res), plain = _captured_idle(registered, x, r, w, index, vec, pa, pb)

    for seed, features in ((23, list(range(40))), (24, [5, 9, 33])):
        path = write_gemma_scope(str(tmp_path / f"s{seed}"), random_sae(d, 64, "jumprelu", seed=seed))
        assert sae.load_runtime(path, None, "post_mlp.3", tuple(features), [site]) == [site]
        slots = np.arange(len(features), dtype=np.int32)
        sae.write_row(1, [wire_entry(f"s{seed}", *site, DELTA, slots, np.full(len(slots), SET, np.int32),
                                     np.full(len(slots), 6.0, np.float32))])
        graph.replay()
        want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, sae_a=pa, sae_b=pb)
        _check((out, res), want, plain, index, dtype, _ambiguous(x, r, index, vec, pa, pb))
        assert not torch.equal(res, plain[1])
        assert int(torch.count_nonzero(pa[3][len(features):])) == 0  # the slots past its features are empty
