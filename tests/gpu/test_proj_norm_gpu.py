"""GPU checks of directional projections in the steered norm (``PROJ_A`` / ``PROJ_B``, issue 38 item 3; runs only
where CUDA is available): the Triton kernel against the plain-torch reference (``steered_norm_naive``) with vectors,
with conditions (rows whose condition gates their projections, at a probe site and after it), and with SAE
clamps, on the EARLY path (the default) and the late one; unprojected rows equal the kernel without projections
(bit for bit but for float32's last ulp); in a CUDA graph captured before any row had projections, a row's
directions written afterwards take effect at replay; a site marked idle (``runtime.projection_tables``) projects
nothing, and its mark follows the rows going live under a graph."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from vllm_steer.kernels.steered_rms_norm.naive import PROJ_GATED, VECTORS_UNGATED, steered_norm_naive  # noqa: E402
from tests.sae_packs import clamp_pack  # noqa: E402
from tests.gpu.norm_inputs import DTYPES, TOL, norm_inputs, same_rows  # noqa: E402

R, K, EPS = 6, 3, 1e-5


def _proj(d: int, seed: int) -> list[torch.Tensor]:
    """Row r: min(r, K) live unit directions; odd rows ablate, even rows cap into [-0.5, 0.5]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dirs = torch.randn(R, K, d, generator=g, device="cuda")
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    bounds = torch.zeros(R, K, 2, device="cuda")
    bounds[0::2, :, 0], bounds[0::2, :, 1] = -0.5, 0.5
    count = torch.tensor([min(r, K) for r in range(R)], dtype=torch.int32, device="cuda")
    return [count, dirs, bounds]


def _op(*args, **kwargs):
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    return steered_norm_triton(*args, **kwargs)


@pytest.mark.parametrize("variant", ["vectors", "cond", "cond-sae"])
@pytest.mark.parametrize("n", [1, 7, 256])
@pytest.mark.parametrize("d", [64, 4096, 4099])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_triton_matches_reference(variant, n, d, dtype_name):
    dtype = DTYPES[dtype_name]
    g = torch.Generator(device="cuda").manual_seed(n * 7 + d)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    index = torch.arange(n + 11, device="cuda", dtype=torch.int32) % R
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    vec = ([ta, one], [tb, one])
    extra = {}
    if variant.startswith("cond"):
        # rows 1 (probe at A, projections gated), 3 (probe at B), 4 (probe earlier, vectors ungated), 5 (not gated)
        site = torch.tensor([-1, 40 | PROJ_GATED, -1, 41 | PROJ_GATED, 7 | PROJ_GATED | VECTORS_UNGATED, 40],
                            dtype=torch.int32, device="cuda")
        params = torch.tensor([[0, 1, 0, 1]] + [[0.1, 2.0, float(i % 2), 0] for i in range(1, R)],
                              dtype=torch.float32, device="cuda")
        probe = torch.randn(R, d, generator=g, device="cuda") / d ** 0.5
        ids = [50, 51] if variant == "cond-sae" else [40, 41]  # no probe at an SAE norm
        extra["cond"] = [site, params, probe, torch.tensor(ids, dtype=torch.int32, device="cuda")]
        if variant == "cond-sae":
            extra |= {"sae_a": clamp_pack(d, 37, seed=5, jumprelu=True, device="cuda"),
                      "sae_b": clamp_pack(d, 37, seed=6, device="cuda")}  # R rows, as here
    gate = torch.rand(n + 11, generator=g, device="cuda")
    pa, pb = _proj(d, seed=1), _proj(d, seed=2)
    g_t, g_r = gate.clone(), gate.clone()
    got = _op(x, r, w, EPS, 0.0, index, *vec, **extra, gate=g_t, proj_a=pa, proj_b=pb)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, *vec, **extra, gate=g_r, proj_a=pa, proj_b=pb)
    tol = TOL[dtype] if "sae" not in variant else {k: max(v, 3e-5) for k, v in TOL[dtype].items()}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(g_t, g_r, rtol=1e-4, atol=1e-4)
    plain = _op(x, r, w, EPS, 0.0, index, *vec, **extra, gate=gate.clone())
    rows = index[:n]
    unprojected = rows == 0
    same_rows(got[0][unprojected], plain[0][unprojected])
    same_rows(got[1][unprojected], plain[1][unprojected])


def test_directions_written_after_graph_capture_take_effect_at_replay():
    d, n = 4096, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    x, r, w, ta, tb = norm_inputs(g, n, d, torch.bfloat16, R)
    index = torch.arange(n, device="cuda", dtype=torch.int32) % R
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    pa = [torch.zeros(R, dtype=torch.int32, device="cuda"), torch.zeros(R, 1, d, device="cuda"),
          torch.zeros(R, 1, 2, device="cuda")]
    out = {}
    _op(x, r, w, EPS, 0.0, index, [ta, one], proj_a=pa)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["y"] = _op(x, r, w, EPS, 0.0, index, [ta, one], proj_a=pa)
    graph.replay()
    before = [t.clone() for t in out["y"]]
    v = torch.randn(d, generator=g, device="cuda")
    pa[1][2, 0].copy_(v / v.norm())
    pa[0][2:3].fill_(1)  # row 2 now ablates v
    graph.replay()
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, [ta, one], proj_a=pa)
    for a, b in zip(out["y"], want):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
    moved = index == 2
    assert not torch.equal(out["y"][1][moved], before[1][moved]) and torch.equal(out["y"][1][~moved], before[1][~moved])


def test_a_site_marked_idle_projects_nothing_and_its_mark_follows_live_rows_under_a_graph():
    """``runtime.projection_tables``' idle marks (``count[site, 0]``) on the GPU: a graph captured while no row is
    live is the kernel without projections, bit for bit; the row going live (its mark landed by a pinned copy into
    the strided column) makes the replay project its tokens as the reference; released, bit for bit as before."""
    import numpy as np

    from vllm_steer.runtime.projection_tables import ProjectionTables

    d, n = 4096, 16
    g = torch.Generator(device="cuda").manual_seed(4)
    x, r, w, ta, tb = norm_inputs(g, n, d, torch.bfloat16, R)
    index = torch.arange(n, device="cuda", dtype=torch.int32) % R
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    tables = ProjectionTables({("post_mlp", 1), ("pre_attn", 2)}, R, 1, d, torch.device("cuda"))
    pa, pb = tables.descs[("post_mlp", 1)], tables.descs[("pre_attn", 2)]
    v = np.random.default_rng(4).standard_normal(d).astype(np.float32)
    tables.write_row(2, [("post_mlp", 1, (v / np.linalg.norm(v)).astype(np.float32).tobytes(),
                          np.zeros(2, np.float32).tobytes())])
    vec = ([ta, one], [tb, one])
    plain = _op(x, r, w, EPS, 0.0, index, *vec)
    _op(x, r, w, EPS, 0.0, index, *vec, proj_a=pa, proj_b=pb)  # compile before capturing
    out = {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["y"] = _op(x, r, w, EPS, 0.0, index, *vec, proj_a=pa, proj_b=pb)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out["y"], plain))  # row 2 written, not live: idle
    tables.set_live(2, True)
    graph.replay()
    torch.cuda.synchronize()
    assert pa[0][0].item() == 0 and pb[0][0].item() == -1  # only post_mlp.1 has a live projecting row
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, *vec, proj_a=pa, proj_b=pb)
    for a, b in zip(out["y"], want):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
    moved = index[:n] == 2
    assert not torch.equal(out["y"][1][moved], plain[1][moved])
    assert torch.equal(out["y"][1][~moved], plain[1][~moved]) and torch.equal(out["y"][0][~moved], plain[0][~moved])
    tables.set_live(2, False)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out["y"], plain))


def _one_direction(d: int, seed: int, at: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """K = 1 tables (a ``max_projections`` 1 server's slot): rows in ``at`` ablate one unit direction (row 4 caps
    into [-0.5, 0.5]), the others none; directions stored in ``dtype``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dirs = torch.randn(R, 1, d, generator=g, device="cuda")
    dirs = (dirs / dirs.norm(dim=-1, keepdim=True)).to(dtype)
    bounds = torch.zeros(R, 1, 2, device="cuda")
    bounds[4, 0, 0], bounds[4, 0, 1] = -0.5, 0.5
    count = torch.tensor([1 if r in at else 0 for r in range(R)], dtype=torch.int32, device="cuda")
    return [count, dirs, bounds]


@pytest.mark.parametrize("dirs_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
@pytest.mark.parametrize("n", [7, 256])
@pytest.mark.parametrize("d", [4096, 4099])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])  # float16 takes bf16's path (16 compiles in all)
def test_issue38_paths_match_reference(early, dirs_name, n, d, dtype_name):
    """Both plain-site paths (``kernels/steered_rms_norm/triton.py``: EARLY, the default, and the late path), with
    float32 or bf16 directions (``runtime.projection_tables.DIRS``): tokens projecting at A (rows 1, 3 with B too, 4
    capped), at B (row 2), none (0, 5) as the reference; unprojected tokens are the late kernel without projections
    (bf16 bit for bit, float32 within a few ulp: ``norm_inputs.same_rows``)."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator(device="cuda").manual_seed(n * 11 + d)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    index = torch.arange(n + 11, device="cuda", dtype=torch.int32) % R
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    vec = ([ta, one], [tb, one])
    pa, pb = (_one_direction(d, seed, at, DTYPES[dirs_name]) for seed, at in ((7, (1, 3, 4)), (8, (2, 3))))
    got = _op(x, r, w, EPS, 0.0, index, *vec, proj_a=pa, proj_b=pb, early=early)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, *vec, proj_a=pa, proj_b=pb)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])
    plain = _op(x, r, w, EPS, 0.0, index, *vec, early=False)
    rows = index[:n]
    unprojected = (rows == 0) | (rows == 5)
    for a, b in zip(got, plain):
        same_rows(a[unprojected], b[unprojected])
