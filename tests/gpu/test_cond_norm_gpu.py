"""GPU checks of the conditional steered norm (``steered_cond_rms_norm``, issue 27; runs only where CUDA
is available): the Triton kernel against the plain-torch reference in a batch of unsteered tokens,
rows without a condition, rows gated at slot A, at slot B and earlier (the gate buffer's value), soft
and hard; rows without a condition equal the plain kernel bit for bit; inside a CUDA graph captured
with no conditional row, a condition written afterwards takes effect at replay."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from vllm_steer.kernels.steered_rms_norm.naive import steered_cond_rms_norm_naive  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.triton import (  # noqa: E402
    steered_cond_rms_norm_triton,
    steered_rms_norm_triton,
)
from tests.gpu.norm_inputs import DTYPES, TOL, norm_inputs  # noqa: E402

R, EPS = 6, 1e-5


def _case(n: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, R)
    index = torch.arange(n + 11, device="cuda", dtype=torch.int32) % R  # every row, row 0 unsteered
    site = torch.tensor([-1, -1, 40, 41, 7, 40], dtype=torch.int32, device="cuda")  # A=40, B=41, 7 earlier
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
    g_t, g_r = gate.clone(), gate.clone()
    got = steered_cond_rms_norm_triton(x, r, w, EPS, 0.0, index, ta, one, tb, one, site, params, probe, g_t, ids)
    want = steered_cond_rms_norm_naive(x, r, w, EPS, 0.0, index, ta, one, tb, one, site, params, probe, g_r, ids)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])
    torch.testing.assert_close(g_t, g_r, rtol=1e-4, atol=1e-4)
    plain = steered_rms_norm_triton(x, r, w, EPS, 0.0, index, ta, one, tb, one)
    keep = site[index[:n].long()] < 0  # unsteered tokens and rows without a condition: bit for bit
    assert torch.equal(got[1][keep], plain[1][keep]) and torch.equal(got[0][keep], plain[0][keep])
    params[0, 3] = 0  # no live row has a condition: the plain kernel for every token, the gate untouched
    g_0 = gate.clone()
    idle = steered_cond_rms_norm_triton(x, r, w, EPS, 0.0, index, ta, one, tb, one, site, params, probe, g_0, ids)
    assert torch.equal(idle[0], plain[0]) and torch.equal(idle[1], plain[1]) and torch.equal(g_0, gate)


def test_a_condition_written_after_capture_takes_effect_at_replay():
    x, r, w, ta, tb, index, site, params, probe, gate, ids = _case(16, 4096, torch.bfloat16, seed=3)
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    live = torch.full_like(site, -1)  # captured with no conditional row
    live_params = params.clone()
    live_params[0, 3] = 0  # and the any-live-condition flag down
    out = [None]

    def step():
        out[0] = steered_cond_rms_norm_triton(x, r, w, EPS, 0.0, index, ta, one, tb, one, live, live_params, probe,
                                              gate, ids)

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
    want = steered_cond_rms_norm_naive(x, r, w, EPS, 0.0, index, ta, one, tb, one, site, params, probe, gate_ref, ids)
    for a, b in zip(out[0], want):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
