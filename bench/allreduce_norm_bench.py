#!/usr/bin/env python3
"""Issue 40's give-back C, its first measure: the one-shot all-reduce + add + RMSNorm kernel
(``kernels/allreduce_norm``), and the steered norm with that all-reduce in its launch as a server runs it (s41: the
served idle norm cost ~2.2 µs more than stock's where this kernel costs 0.5 µs more; ``steered_ar_*``), against
what a steered norm costs under TP today (vLLM's all-reduce, here NCCL's, then the norm:
``vllm._custom_ops.fused_add_rms_norm`` stands in for ours, the same bytes) and the all-reduce alone, on two GPUs
of one node, µs a call at decode and small prefill sizes. Each variant is a CUDA graph of ``--calls`` calls
(what a decode step replays), timed by events after a warm replay; the median of ``--rounds`` replays.

    python3 bench/allreduce_norm_bench.py [--ns 1,16,64,256,1024 --d 4096 --calls 64 --rounds 20 --out F.json]
With FlashInfer importable and every multicast switch off (``bench/arfuse_check.SAFE``; the ``arnorm`` step after
``fi-install``), also FlashInfer's fused all-reduce + add + RMSNorm on vLLM's workspace (trtllm backend): what stock
vLLM runs at TP >= 2, the number to match.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu.tp_pair import run_pair  # noqa: E402

EPS = 1e-6


def _graph_us(fn, calls: int, rounds: int) -> float:
    """µs a call. Not ``triton.testing.do_bench_cudagraph``: it sizes its replays from its own timing, which may
    differ between ranks, and a collective replayed a different number of times on each rank never returns."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _rank(rank: int, world: int, ns: list[int], d: int, calls: int, rounds: int) -> list[dict]:
    import torch.distributed as dist
    try:
        from vllm import _custom_ops as ops
    except ImportError:  # a machine without vLLM: the all-reduce alone stands beside the fused kernel
        ops = None

    from vllm_steer.kernels.allreduce_norm.triton import ArNormWorkspace, allreduce_add_rms_norm
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    dev = torch.device("cuda", rank)
    ws = ArNormWorkspace(max(ns), d, torch.bfloat16, dev, dist.group.WORLD)
    fi = _flashinfer(world, rank, max(ns), d)
    rows = []
    for n in ns:
        x = torch.randn(n, d, device=dev).to(torch.bfloat16)
        residual = torch.randn(n, d, device=dev).to(torch.bfloat16)
        weight = torch.ones(d, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(residual)
        y = x.clone()

        def fused():
            allreduce_add_rms_norm(ws, x, residual, weight, EPS, out)

        def nccl_then_norm():
            dist.all_reduce(y)
            ops.fused_add_rms_norm(y, residual, weight, EPS)

        def nccl_alone():
            dist.all_reduce(y)

        # what a server runs (steered_norm_plain_ar): the steered norm with the all-reduce in its launch, both slots'
        # tables installed, idle (flags off: enabled_idle) and steering every token (per_request_n16); and that norm
        # alone on an already reduced stream (the norm's own share)
        index = torch.arange(n, device=dev, dtype=torch.int32) % 16 + 1
        table = (torch.randn(17, d, device=dev) * 0.1).to(torch.bfloat16)
        table[0] = 0
        off, on = torch.zeros(1, dtype=torch.uint8, device=dev), torch.ones(1, dtype=torch.uint8, device=dev)

        def steered_ar_idle():
            steered_norm_triton(x, residual, weight, EPS, 0.0, index, vec_a=(table, off), vec_b=(table, off), ar=ws)

        def steered_ar_n16():
            steered_norm_triton(x, residual, weight, EPS, 0.0, index, vec_a=(table, on), vec_b=(table, on), ar=ws)

        def steered_alone_idle():
            steered_norm_triton(y, residual, weight, EPS, 0.0, index, vec_a=(table, off), vec_b=(table, off))

        # in context: each call after the GEMM that makes x (o_proj's shard: [N, D / world] @ [D / world, D]), as in
        # a decoder layer; FlashInfer launches with PDL (its prologue overlaps the GEMM's tail), ours do not: a
        # difference 64 back-to-back calls of one kernel cannot show
        a = torch.randn(n, d // world, device=dev).to(torch.bfloat16)
        w_o = (torch.randn(d // world, d, device=dev) * 0.02).to(torch.bfloat16)

        def gemm():
            torch.mm(a, w_o, out=x)

        def gemm_fused_one_shot():
            gemm()
            fused()

        def gemm_steered_ar_idle():
            gemm()
            steered_ar_idle()

        row = {"n": n, "d": d}
        variants = [("fused_one_shot", fused), ("steered_ar_idle", steered_ar_idle), ("steered_ar_n16", steered_ar_n16),
                    ("steered_alone_idle", steered_alone_idle), ("nccl_then_norm", nccl_then_norm),
                    ("nccl_alone", nccl_alone), ("gemm", gemm), ("gemm_fused_one_shot", gemm_fused_one_shot),
                    ("gemm_steered_ar_idle", gemm_steered_ar_idle)]
        if fi is not None:
            fi_out, fi_res = torch.empty_like(x), torch.empty_like(x)

            def flashinfer_fused():
                fc, fws = fi
                fc.allreduce_fusion(input=x, workspace=fws, pattern=fc.AllReduceFusionPattern.kARResidualRMSNorm,
                                    launch_with_pdl=True, trigger_completion_at_end=True, residual_out=fi_res,
                                    norm_out=fi_out, residual_in=residual, rms_gamma=weight, rms_eps=EPS,
                                    fp32_acc=True)

            def gemm_flashinfer():
                gemm()
                flashinfer_fused()

            variants += [("flashinfer_fused", flashinfer_fused), ("gemm_flashinfer", gemm_flashinfer)]
        for name, fn in (v for v in variants if ops is not None or v[0] != "nccl_then_norm"):
            dist.barrier()
            row[name] = round(_graph_us(fn, calls, rounds), 2)
        rows.append(row)
    if fi is not None:
        fi[1].destroy()
    return rows


def _flashinfer(world: int, rank: int, max_tokens: int, d: int):
    """(flashinfer.comm, vLLM's fused all-reduce workspace) when FlashInfer imports and every multicast switch is
    off (arfuse_check.SAFE), else None."""
    from bench.arfuse_check import unsafe

    if unsafe():
        return None
    try:
        import torch.distributed as dist
        import flashinfer.comm as fc
        from flashinfer.comm.mnnvl import TorchDistBackend
    except ImportError:
        return None
    group = dist.group.WORLD
    try:  # its trtllm_comm module prebuilt or built by JIT (nvcc): else the bench goes on without it
        ws = fc.create_allreduce_fusion_workspace(backend="trtllm", world_size=world, rank=rank,
                                                  max_token_num=max_tokens, hidden_dim=d, dtype=torch.bfloat16,
                                                  comm_backend=TorchDistBackend(group=group), group=group)
    except Exception as exc:  # noqa: BLE001 - an optional comparison
        print(f"rank {rank}: no FlashInfer workspace ({type(exc).__name__}: {exc})")
        return None
    return fc, ws


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1,16,64,256,1024")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    ranks = run_pair(_rank, [int(v) for v in args.ns.split(",")], args.d, args.calls, args.rounds)
    print("µs a call (CUDA graph of {} calls; rank 0 | rank 1)".format(args.calls))
    for r0, r1 in zip(*ranks):
        print(f"N={r0['n']:5d} D={r0['d']}  " + "  ".join(
            f"{k} {r0[k]:7.2f} | {r1[k]:7.2f}" for k in r0 if k not in ("n", "d")))  # each variant timed, in order
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "ranks": ranks}, fh, indent=1)


if __name__ == "__main__":
    main()
