"""GPU: the Triton capture_rows kernel equals the plain-torch reference (bit for bit), and so does the steered
norm with capture folded in (``steered_capture_rms_norm``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("n", [1, 7, 256, 2048])
@pytest.mark.parametrize("d", [64, 4096, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_capture_rows_triton_matches_naive(n, d, dtype):
    from vllm_steer.kernels.capture_rows.naive import capture_rows_naive
    from vllm_steer.kernels.capture_rows.triton import capture_rows_triton

    g = torch.Generator(device="cuda").manual_seed(n + d)
    a = torch.randn(n, d, device="cuda", dtype=dtype, generator=g)
    plan = torch.full((n + 5,), -1, dtype=torch.int32, device="cuda")
    take = torch.randperm(n, device="cuda", generator=g)[: max(1, n // 3)]
    plan[take] = torch.arange(take.numel(), dtype=torch.int32, device="cuda")
    want = torch.full((n + 2, d), float("nan"), device="cuda", dtype=dtype)
    got = want.clone()
    capture_rows_naive(want, a, plan)
    capture_rows_triton(got, a, plan)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("n", [1, 7, 64, 256])
@pytest.mark.parametrize("d", [64, 4096, 4099])
@pytest.mark.parametrize("variant", ["plain", "cond", "sae", "cond-sae"])
def test_capture_in_the_norm_matches_naive(n, d, variant):
    """The steered norm with capture folded in (``steered_capture_rms_norm_triton``) against the reference
    (bf16 model dtype): outputs, new residual and every captured pool row; slot B's rows are the stream
    after slot A's clamps and (gated) rows; the outputs equal the same norm without capture, bit for bit."""
    from tests.gpu.norm_inputs import TOL, norm_inputs
    from tests.sae_packs import clamp_pack, token_rows
    from tests import norm_calls as norm
    from tests.norm_calls import steered_capture_rms_norm_naive
    from vllm_steer.kernels.steered_rms_norm.naive import SAE_GATED

    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(n * 3 + d)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, 6, device="cuda")
    index = token_rows(n, device="cuda")
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    sae = "sae" in variant
    pa = clamp_pack(d, 37, seed=5, device="cuda") if sae else []
    pb = clamp_pack(d, 37, seed=6, jumprelu=False, device="cuda") if sae else []
    cond = None
    if variant.startswith("cond"):
        at_a = 7 if sae else 40  # no probe at an SAE norm
        site = torch.tensor([-1, at_a | SAE_GATED, -1, 7, at_a, 7], dtype=torch.int32, device="cuda")
        params = torch.tensor([[0.1, 2.0, float(i % 2), float(i == 0)] for i in range(6)], device="cuda")
        probe = torch.randn(6, d, generator=g, device="cuda") / d ** 0.5
        gate = torch.rand(n + 5, generator=g, device="cuda") * 0.8 + 0.1
        cond = (site, params, probe, gate, torch.tensor([40, 41], dtype=torch.int32, device="cuda"))
    plans = []
    for k in range(2):
        plan = torch.full((n + 5,), -1, dtype=torch.int32, device="cuda")
        take = torch.arange(k, n, 2, device="cuda")
        plan[take] = torch.arange(take.numel(), dtype=torch.int32, device="cuda") * 2 + k
        plans.append(plan)
    pools, outs, gates = [], [], []
    for fn in ("triton", "naive"):
        pool = torch.full((n + 2, d), float("nan"), device="cuda", dtype=dtype)
        c = None if cond is None else (*cond[:3], cond[3].clone(), cond[4])
        if fn == "triton":
            got = norm.steered_capture_rms_norm_triton(x, r, w, 1e-5, 0.0, index, ta, one, tb, one, pa, pb, c, pool,
                                                       *plans)
        else:
            got = steered_capture_rms_norm_naive(x, r, w, 1e-5, 0.0, index, ta, one, tb, one, pa, pb, 0, 0, c, pool,
                                                 *plans)
        pools.append(pool)
        outs.append(got)
        gates.append(None if c is None else c[3])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **TOL[dtype])
    torch.testing.assert_close(pools[0], pools[1], equal_nan=True, **TOL[dtype])
    assert not torch.isnan(pools[0][:n]).any()
    c = None if cond is None else (*cond[:3], cond[3].clone(), cond[4])
    if variant == "plain":
        alone = norm.steered_rms_norm_triton(x, r, w, 1e-5, 0.0, index, ta, one, tb, one)
    elif variant == "cond":
        alone = norm.steered_cond_rms_norm_triton(x, r, w, 1e-5, 0.0, index, ta, one, tb, one, *c)
    elif variant == "sae":
        alone = norm.steered_sae_rms_norm_triton(x, r, w, 1e-5, 0.0, index, ta, one, tb, one, pa, pb)
    else:
        alone = norm.steered_cond_sae_rms_norm_triton(x, r, w, 1e-5, 0.0, index, ta, one, tb, one, pa, pb, *c)
    assert torch.equal(alone[0], outs[0][0]) and torch.equal(alone[1], outs[0][1])
