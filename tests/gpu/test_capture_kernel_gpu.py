"""GPU: the Triton capture_rows kernel equals the plain-torch reference (bit for bit), and so does the steered
norm with capture folded in (its ``plan_a`` / ``plan_b`` / ``pool`` descriptors)."""

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
    """The steered norm with capture folded in (``steered_norm_triton`` with plans and a pool) against the reference
    (bf16 model dtype): outputs, new residual and every captured pool row; slot B's rows are the stream
    after slot A's clamps and (gated) rows; the outputs equal the same norm without capture, bit for bit."""
    from tests.gpu.norm_inputs import TOL, norm_inputs
    from tests.sae_packs import clamp_pack, token_rows
    from vllm_steer.kernels.steered_rms_norm.naive import SAE_GATED, steered_norm_naive
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(n * 3 + d)
    x, r, w, ta, tb = norm_inputs(g, n, d, dtype, 6, device="cuda")
    index = token_rows(n, device="cuda")
    one = torch.ones(1, dtype=torch.uint8, device="cuda")
    sae = "sae" in variant
    pa = clamp_pack(d, 37, seed=5, device="cuda") if sae else []
    pb = clamp_pack(d, 37, seed=6, jumprelu=False, device="cuda") if sae else []
    vec = {"vec_a": (ta, one), "vec_b": (tb, one)}
    cond = gate = None
    if variant.startswith("cond"):
        at_a = 7 if sae else 40  # no probe at an SAE norm
        site = torch.tensor([-1, at_a | SAE_GATED, -1, 7, at_a, 7], dtype=torch.int32, device="cuda")
        params = torch.tensor([[0.1, 2.0, float(i % 2), float(i == 0)] for i in range(6)], device="cuda")
        probe = torch.randn(6, d, generator=g, device="cuda") / d ** 0.5
        gate = torch.rand(n + 5, generator=g, device="cuda") * 0.8 + 0.1
        cond = (site, params, probe, torch.tensor([40, 41], dtype=torch.int32, device="cuda"))
    plans = []
    for k in range(2):
        plan = torch.full((n + 5,), -1, dtype=torch.int32, device="cuda")
        take = torch.arange(k, n, 2, device="cuda")
        plan[take] = torch.arange(take.numel(), dtype=torch.int32, device="cuda") * 2 + k
        plans.append(plan)

    def gated() -> dict:  # the condition with a fresh copy of the gate buffer (each call writes it)
        return {} if cond is None else {"cond": cond, "gate": gate.clone()}

    pools, outs = [], []
    for fn in (steered_norm_triton, steered_norm_naive):
        pool = torch.full((n + 2, d), float("nan"), device="cuda", dtype=dtype)
        got = fn(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb, **gated(), pool=pool, plan_a=plans[0],
                 plan_b=plans[1])
        pools.append(pool)
        outs.append(got)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **TOL[dtype])
    torch.testing.assert_close(pools[0], pools[1], equal_nan=True, **TOL[dtype])
    assert not torch.isnan(pools[0][:n]).any()
    alone = steered_norm_triton(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb, **gated())  # no capture
    assert torch.equal(alone[0], outs[0][0]) and torch.equal(alone[1], outs[0][1])


@pytest.mark.parametrize("rows,slots,runs", [(64, 64, False), (32768, 128, False), (32768, 128, True)],
                         ids=["decode", "prefill", "prefill-runs"])
def test_capture_reduce_segment_add_matches_per_slot_sums(rows, slots, runs):
    """The mean consumers' per-step add (``ReduceRegion.apply`` -> the Triton segmented sum) at a decode step's shape
    (one row a slot) and a prefill step's (256 rows a slot: sources shuffled one by one, or as a ranged plan gives
    them, runs of consecutive rows expanded on the device), against float64 per-slot sums."""
    import numpy as np

    from vllm_steer.runtime.capture_reduce import ReduceRegion

    d = 4096
    g = torch.Generator(device="cuda").manual_seed(rows)
    pool = torch.randn(rows + slots, d, device="cuda", generator=g).to(torch.bfloat16)
    region = ReduceRegion(slots, rows, pool, rows)
    slot_ids = region.alloc(slots)
    per = rows // slots
    src = np.random.default_rng(rows).permutation(rows).astype(np.int64)
    dst = np.repeat(slot_ids, per)
    empty = np.zeros(0, np.int64)
    if runs:  # slot i's rows: a run of ``per`` rows starting at a shuffled multiple of ``per``
        first = np.random.default_rng(1).permutation(slots).astype(np.int64) * per
        src = (first[:, None] + np.arange(per)).ravel()
        args = (first, np.full(slots, per, np.int64), slot_ids, empty, empty)
    else:
        args = (src, np.ones(rows, np.int64), dst, empty, empty)
    region.apply(*args)
    region.apply(*args)  # the same pairs: nothing staged again, added twice
    assert region.index_uploads == 1
    want = torch.zeros(slots + 1, d, dtype=torch.float64, device="cuda")
    want.index_add_(0, torch.as_tensor(dst, device="cuda"), 2 * pool[torch.as_tensor(src, device="cuda")].double())
    torch.testing.assert_close(region.acc.double(), want, rtol=1e-5, atol=1e-3)
