"""GPU checks of the steered norm with a condition (its ``cond`` / ``gate`` descriptors, issue 27; runs only
where CUDA is available): the Triton kernel against the plain-torch reference in a batch of unsteered tokens,
rows without a condition, rows gated at slot A, at slot B and earlier (the gate buffer's value), soft
and hard; rows without a condition (or whose condition gates only SAE clamps) equal the plain kernel bit
for bit; inside a CUDA graph captured with no conditional row, a condition written afterwards takes effect
at replay. The SAE norm of a server with conditions (``cond`` beside ``sae_a`` / ``sae_b``): clamps and
vectors scaled by the gate as each row's site word says, serial and split clamp walks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from vllm_steer.kernels.steered_rms_norm.naive import SAE_GATED, VECTORS_UNGATED, steered_norm_naive  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton  # noqa: E402
from tests.sae_packs import clamp_pack, token_rows  # noqa: E402
from tests.gpu.norm_inputs import DTYPES, TOL, norm_inputs, same_rows  # noqa: E402

R, EPS = 6, 1e-5


def _case(n: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    index = torch.arange(n + 11, device="cuda", dtype=torch.int32) % R  # every row, row 0 unsteered
    # A=40, B=41, 7 earlier; row 5's condition computes its gate at A but scales only SAE clamps
    site = torch.tensor([-1, -1, 40, 41, 7, 40 | VECTORS_UNGATED | SAE_GATED], dtype=torch.int32, device="cuda")
    params = torch.tensor([[0.0, 1.0, 0, 1], [0.0, 1.0, 0, 0], [0.2, 3.0, 0, 0], [0.0, 1.0, 1, 0],
                           [0.0, 1.0, 0, 0], [-0.1, 1.0, 1, 0]], dtype=torch.float32, device="cuda")
    probe = torch.randn(R, d, generator=g, device="cuda") / d ** 0.5
    gate = torch.rand(n + 11, generator=g, device="cuda")
    ids = torch.tensor([40, 41], dtype=torch.int32, device="cuda")
    return x, r, w, ta, tb, index, site, params, probe, gate, ids


@pytest.mark.parametrize("n", [1, 7, 256])
@pytest.mark.parametrize("d", [64, 4096, 4099])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_triton_matches_reference(n, d, dtype_name):
    dtype = DTYPES[dtype_name]
    x, r, w, ta, tb, index, site, params, probe, gate, ids = _case(n, d, dtype, seed=n * 7 + d)
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    vec = {"vec_a": (ta, one), "vec_b": (tb, one)}
    cond = (site, params, probe, ids)
    g_t, g_r = gate.clone(), gate.clone()
    got = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, cond=cond, gate=g_t)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, cond=cond, gate=g_r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])
    torch.testing.assert_close(g_t, g_r, rtol=1e-4, atol=1e-4)
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec)
    word = site[index[:n].long()]  # unsteered tokens, rows without a condition or with ungated vectors: bit for bit
    keep = (word < 0) | ((word & VECTORS_UNGATED) != 0)
    same_rows(got[1][keep], plain[1][keep])
    same_rows(got[0][keep], plain[0][keep])
    params[0, 3] = 0  # no live row has a condition: the plain kernel for every token, the gate untouched
    g_0 = gate.clone()
    idle = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, cond=cond, gate=g_0)
    same_rows(idle[0], plain[0])
    same_rows(idle[1], plain[1])
    assert torch.equal(g_0, gate)


def test_a_condition_written_after_capture_takes_effect_at_replay():
    x, r, w, ta, tb, index, site, params, probe, gate, ids = _case(16, 4096, torch.bfloat16, seed=3)
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    vec = {"vec_a": (ta, one), "vec_b": (tb, one)}
    live = torch.full_like(site, -1)  # captured with no conditional row
    live_params = params.clone()
    live_params[0, 3] = 0  # and the any-live-condition flag down
    out = [None]

    def step():
        out[0] = steered_norm_triton(x, r, w, EPS, 0.0, index, **vec, cond=(live, live_params, probe, ids), gate=gate)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    live.copy_(site)
    live_params.copy_(params)
    gate_ref = gate.clone()
    graph.replay()
    torch.cuda.synchronize()
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **vec, cond=(site, params, probe, ids), gate=gate_ref)
    for a, b in zip(out[0], want):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])


@pytest.mark.parametrize("n", [1, 16, 256])  # split walks at 1 and 16 tokens, serial at 256
@pytest.mark.parametrize("d", [4096, 4099])
def test_conditional_sae_kernel_matches_reference(n, d):
    g = torch.Generator(device="cuda").manual_seed(n + d)
    x, r, w, ta, tb = norm_inputs(g, n, d, torch.bfloat16, R)
    index = token_rows(n, "cuda")
    pa, pb = clamp_pack(d, 64, seed=1, device="cuda"), clamp_pack(d, 37, seed=2, jumprelu=False, device="cuda")
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    early = 7  # every condition's probe: before this norm (no probe is ever at an SAE norm)
    site = torch.tensor([-1, early | SAE_GATED, -1, early | SAE_GATED | VECTORS_UNGATED, early,
                         early | SAE_GATED | VECTORS_UNGATED], dtype=torch.int32, device="cuda")
    params = torch.tensor([[0.0, 1.0, 0, 1]] + [[0.0, 1.0, 0, 0]] * 5, dtype=torch.float32, device="cuda")
    probe = torch.randn(R, d, generator=g, device="cuda")
    gate = torch.rand(n + 5, generator=g, device="cuda") * 0.8 + 0.1
    ids = torch.tensor([40, 41], dtype=torch.int32, device="cuda")
    feats = {"vec_a": (ta, one), "vec_b": (tb, one), "sae_a": pa, "sae_b": pb}
    g_t, g_r = gate.clone(), gate.clone()
    got = steered_norm_triton(x, r, w, EPS, 0.0, index, **feats, cond=(site, params, probe, ids), gate=g_t)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, **feats, cond=(site, params, probe, ids), gate=g_r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
    assert torch.equal(g_t, gate)  # only read
    plain = steered_norm_triton(x, r, w, EPS, 0.0, index, **feats)
    rows = index[:n].long()
    ungated = (rows == 0) | (rows == 2)
    assert torch.equal(got[1][ungated], plain[1][ungated]) and torch.equal(got[0][ungated], plain[0][ungated])
