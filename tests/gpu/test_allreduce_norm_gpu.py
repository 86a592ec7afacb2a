"""The one-shot all-reduce + add + RMSNorm kernel (``kernels/allreduce_norm``) on two GPUs as a TP group: against
NCCL's all-gather of the partials and the float32 reference, the same bits on both ranks, inside a CUDA graph
replayed with new inputs, and launched back to back (the two epochs' buffers reused with no host work between)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.tp_pair import run_pair

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
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
