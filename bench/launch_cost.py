#!/usr/bin/env python3
"""Host cost of one launch of the steered norm outside CUDA graphs (eager steps: prefills and mixed batches larger
than vLLM's largest captured graph), idle, against vLLM's ``_C.fused_add_rms_norm`` and Inductor's native norm.

Kernel microbenchmarks time launches inside CUDA graphs, where no Python runs; a step outside a graph runs each
norm's Python (the custom op's dispatch of ~20 arguments, ``_impl``, the Triton launcher) once per norm and step:
65 times a step at the 8b shape. Per case: host µs per call (``--calls`` calls back to back, timed on the host
without a sync; the GPU is far from full at these sizes) and GPU µs per call (the same loop, synced). Cases: the op
as the model calls it (``torch.ops.vllm_steer.steered_norm``, idle tables, with and without capture plans), the
Triton wrapper called directly, and vLLM's two norms. On CPU (no CUDA) only the op's naive path runs: host only.
    python3 bench/launch_cost.py [--ns 16,512,2048,8192 --d 4096 --calls 500 --out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

EPS, R = 1e-5, 272


def _host_and_device(fn, calls: int, cuda: bool) -> tuple[float, float]:
    for _ in range(20):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return 1e6 * host / calls, 1e6 * total / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="16,512,2048,8192")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    from vllm_steer.kernels.steered_rms_norm.op import register

    register()
    op = torch.ops.vllm_steer.steered_norm
    rows, d = [], args.d
    for n in map(int, args.ns.split(",")):
        x, r = torch.randn(n, d, device=dev, dtype=dtype), torch.randn(n, d, device=dev, dtype=dtype)
        w = torch.randn(d, device=dev, dtype=dtype)
        ta, tb = torch.zeros(R, d, device=dev, dtype=dtype), torch.zeros(R, d, device=dev, dtype=dtype)
        off = torch.zeros(1, dtype=torch.uint8, device=dev)
        index = torch.zeros(max(n, 8192), dtype=torch.int32, device=dev)
        none = torch.full((max(n, 8192),), -1, dtype=torch.int32, device=dev)
        pool = torch.empty(16, d, device=dev, dtype=dtype)
        cases = {
            "op_idle": lambda: op(x, r, w, EPS, 0.0, index, [ta, off], [tb, off], [], [], 0, 0, [], None,
                                  None, None, None, [], [], []),
            "op_idle_capture_plans": lambda: op(x, r, w, EPS, 0.0, index, [ta, off], [tb, off], [], [], 0, 0, [], None,
                                                none, none, pool, [], [], []),
        }
        if cuda:
            importlib.import_module("vllm._custom_ops")
            from vllm.ir.ops.layernorm import fused_add_rms_norm
            from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

            native = torch.compile(fused_add_rms_norm.impls["native"].impl_fn, dynamic=False)
            xs, rs = x.clone(), r.clone()
            cases["triton_wrapper_idle"] = lambda: steered_norm_triton(x, r, w, EPS, 0.0, index, (ta, off), (tb, off))
            cases["vllm_c"] = lambda: torch.ops._C.fused_add_rms_norm(xs, rs, w, EPS)
            cases["inductor_native"] = lambda: native(x, r, w, EPS)
        for name, fn in cases.items():
            host, total = _host_and_device(fn, args.calls, cuda)
            rows.append({"N": n, "D": d, "case": name, "host_us": round(host, 2),
                         "total_us": round(total, 2) if cuda else None})
            print(f"N={n:5d} D={d} {name:24s} host {host:8.2f} us" + (f"  synced {total:8.2f} us" if cuda else ""),
                  flush=True)
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "calls": args.calls, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
