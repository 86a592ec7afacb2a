"""The one-shot all-reduce + add + RMSNorm kernel (``kernels/allreduce_norm``) on two GPUs as a TP group: against
NCCL's all-gather of the partials and the float32 reference, the same bits on both ranks, inside a CUDA graph
replayed with new inputs, and launched back to back (the two epochs' buffers reused with no host work between). The
steered norm with the all-reduce inside (its ``AR`` feature) on every GPU there is (a group of one on one GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.tp_pair import run_pair

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
D, MAX_T, EPS = 4096, 256, 1e-6
ULP = dict(rtol=2 ** -7, atol=2 ** -7)  # one bf16 unit: the kernel's rsqrt and variance order vs torch's


def _inputs(t: int, rank: int, dev: torch.device, seed: int = 0):
    """Rank-own partials, the residual and weight every rank holds alike."""
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + t * 10 + rank)
    x = torch.randn(t, D, generator=g, device=dev).to(torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + t * 10 + 99)
    residual = torch.randn(t, D, generator=g, device=dev).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(D, generator=g, device=dev)).to(torch.bfloat16)
    return x, residual, weight


def _reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    import torch.distributed as dist

    from vllm_steer.kernels.allreduce_norm import naive

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return naive.add_rms_norm(naive.partials_sum(parts), residual, weight, EPS)


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from vllm_steer.kernels.allreduce_norm.triton import ArNormWorkspace, allreduce_add_rms_norm

    dev = torch.device("cuda", rank)
    ws = ArNormWorkspace(MAX_T, D, torch.bfloat16, dev, dist.group.WORLD)
    got = {"programs": ws.programs}
    for t in (1, 16, 100, MAX_T):
        x, residual, weight = _inputs(t, rank, dev)
        want_out, want_res = _reference(x, residual.clone(), weight)
        out = allreduce_add_rms_norm(ws, x, residual, weight, EPS)
        got[t] = (out.cpu(), residual.cpu(), want_out.cpu(), want_res.cpu())
    # a CUDA graph of one call, replayed with new partials and residuals copied into its inputs
    x, residual, weight = _inputs(16, rank, dev)
    static_res = residual.clone()
    allreduce_add_rms_norm(ws, x, static_res, weight, EPS)  # warm (compiled) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = allreduce_add_rms_norm(ws, x, static_res, weight, EPS)
    replays = []
    for seed in (1, 2, 3):
        nx, nres, _ = _inputs(16, rank, dev, seed)
        x.copy_(nx)
        static_res.copy_(nres)
        want_out, want_res = _reference(nx, nres.clone(), weight)
        graph.replay()
        replays.append((static_out.cpu(), static_res.cpu(), want_out.cpu(), want_res.cpu()))
    got["graph"] = replays
    # back to back: 200 launches, no sync between, alternating sizes; the last of each size checked
    xs = {t: _inputs(t, rank, dev, 7) for t in (16, 64)}
    for i in range(200):
        t = 16 if i % 2 else 64
        xt, rt, wt = xs[t]
        res = rt.clone()
        out = allreduce_add_rms_norm(ws, xt, res, wt, EPS)
    want_out, want_res = _reference(xt, rt.clone(), wt)
    got["burst"] = (out.cpu(), res.cpu(), want_out.cpu(), want_res.cpu())
    torch.cuda.synchronize()
    return got


def _check(case) -> None:
    out, res, want_out, want_res = case
    assert torch.equal(res, want_res)  # the float32 sum in rank order, rounded once: the reference's bits
    torch.testing.assert_close(out.float(), want_out.float(), **ULP)


@TWO_GPUS
def test_the_fused_allreduce_norm_matches_nccl_and_the_reference_on_both_ranks():
    ranks = run_pair(_rank)
    assert ranks[0]["programs"] >= 16
    for t in (1, 16, 100, MAX_T):
        for r in ranks:
            _check(r[t])
        assert torch.equal(ranks[0][t][0], ranks[1][t][0]) and torch.equal(ranks[0][t][1], ranks[1][t][1])
    for r in ranks:
        for case in r["graph"]:
            _check(case)
        _check(r["burst"])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ranks[0]["graph"], ranks[1]["graph"]))


def _steered_rank(rank: int, world: int) -> dict:
    """The steered norm with the all-reduce in its launch (vectors at both slots, slot A captured, a direction
    ablated at slot A) against the same norm given the float32 sum of NCCL's all-gathered partials as its stream, for
    two epochs and in a CUDA graph: the residual and output as that norm's, rounded to bf16."""
    import torch.distributed as dist

    from vllm_steer.kernels.allreduce_norm import naive
    from vllm_steer.kernels.allreduce_norm.triton import ArNormWorkspace
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    dev = torch.device("cuda", rank)
    ws = ArNormWorkspace(MAX_T, D, torch.bfloat16, dev, dist.group.WORLD)
    g = torch.Generator(device=dev).manual_seed(5)  # the same tables on every rank
    rows = 8
    tables = [(torch.randn(rows, D, generator=g, device=dev) * 2).to(torch.bfloat16) for _ in range(2)]
    for table in tables:
        table[0] = 0
    on = torch.ones(1, dtype=torch.uint8, device=dev)
    dirs = torch.nn.functional.normalize(torch.randn(rows, 1, D, generator=g, device=dev), dim=-1)
    proj = (torch.ones(rows, dtype=torch.int32, device=dev), dirs, torch.zeros(rows, 1, 2, device=dev))
    got = []
    for t in (16, 100, 16):
        x, residual, weight = _inputs(t, rank, dev, seed=t)
        index = torch.randint(0, rows, (t,), generator=g, device=dev, dtype=torch.int32)
        plan = torch.arange(t, dtype=torch.int32, device=dev)
        kw = dict(vec_a=(tables[0], on), vec_b=(tables[1], on), proj_a=proj, plan_a=plan)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        total = naive.partials_sum(parts)  # float32: the stream the reference norm is given
        want_pool = torch.zeros(MAX_T, D, dtype=torch.float32, device=dev)
        want_out, want_res = steered_norm_triton(total, residual, weight, EPS, 0.0, index, pool=want_pool, **kw)
        pool = torch.zeros(MAX_T, D, dtype=torch.bfloat16, device=dev)
        out, res = steered_norm_triton(x, residual, weight, EPS, 0.0, index, pool=pool, ar=ws, **kw)
        got.append((out.cpu(), res.cpu(), pool.cpu(), want_out.bfloat16().cpu(), want_res.bfloat16().cpu(),
                    want_pool.bfloat16().cpu()))
    x, residual, weight = _inputs(16, rank, dev, seed=3)
    index = torch.randint(0, rows, (16,), generator=g, device=dev, dtype=torch.int32)
    steered_norm_triton(x, residual, weight, EPS, 0.0, index, vec_a=(tables[0], on), ar=ws)  # compiled first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_res = steered_norm_triton(x, residual, weight, EPS, 0.0, index, vec_a=(tables[0], on), ar=ws)
    for seed in (4, 5):
        nx, nres, _ = _inputs(16, rank, dev, seed)
        x.copy_(nx)
        residual.copy_(nres)
        parts = [torch.empty_like(nx) for _ in range(world)]
        dist.all_gather(parts, nx)
        want_out, want_res = steered_norm_triton(naive.partials_sum(parts), nres, weight, EPS, 0.0, index,
                                                 vec_a=(tables[0], on))
        graph.replay()
        got.append((g_out.cpu(), g_res.cpu(), None, want_out.bfloat16().cpu(), want_res.bfloat16().cpu(), None))
    torch.cuda.synchronize()
    return {"cases": got, "sentinel": bool(((ws.buf == 0) & torch.signbit(ws.buf)).all())}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_steered_norm_with_the_all_reduce_inside_matches_it_on_the_summed_stream():
    ranks = run_pair(_steered_rank, world=min(2, torch.cuda.device_count()))
    for r in ranks:
        assert r["sentinel"]  # every row read was reset
        for out, res, pool, want_out, want_res, want_pool in r["cases"]:
            assert torch.equal(res, want_res)  # the float32 sum rounded once: the same bits
            torch.testing.assert_close(out.float(), want_out.float(), **ULP)
            if pool is not None:
                assert torch.equal(pool, want_pool)  # the captured stream: the summed one, before steering
    if len(ranks) == 2:
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(ranks[0]["cases"], ranks[1]["cases"]))
