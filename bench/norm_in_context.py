#!/usr/bin/env python3
"""The steered norm where it runs: in a decoder-shaped CUDA graph (per layer a bf16 GEMM, then the fused
add + RMSNorm, twice; 32 layers), per-kernel GPU time from torch.profiler. kernels_bench replays one
norm on hot inputs; here every norm reads a fresh GEMM output and the residual the previous norm wrote,
as in a server's decode step. Compared: Inductor's fused add + RMSNorm (what stock vLLM 0.26 runs),
vLLM's C op, the steered norm of this tree idle (tables present, flags 0, every token on row 0) at
several num_warps, and, with --baseline FILE, the steered kernel module of another release (e.g. the
installed wheel's kernels/steered_rms_norm/triton.py) idle.

    python3 bench/norm_in_context.py --baseline /tmp/site/vllm_steer/kernels/steered_rms_norm/triton.py --out $OUT/norm_in_context.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EPS, R, LAYERS = 1e-5, 272, 32


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="norm_in_context.json")
    ap.add_argument("--ns", default="1,16,64,256")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    tree = _module(str(Path(__file__).resolve().parent.parent / "kernels/steered_rms_norm/triton.py"), "tree_norm")
    base = _module(args.baseline, "base_norm") if args.baseline else None
    native = torch.compile(fused_add_rms_norm.impls["native"].impl_fn, dynamic=False)
    d, dev = args.d, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w_mm = [(torch.randn(d, d, device=dev, generator=g) / d ** 0.5).to(torch.bfloat16) for _ in range(2 * LAYERS)]
    w_n = (torch.rand(d, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    ta = torch.zeros(R, d, device=dev, dtype=torch.bfloat16)
    tb = torch.zeros(R, d, device=dev, dtype=torch.bfloat16)
    off = torch.zeros(1, device=dev, dtype=torch.uint8)
    zero = torch.zeros(8192, device=dev, dtype=torch.int32)

    def steered(mod, nw=None):
        def norm(x, r):
            out, res = torch.empty_like(x), torch.empty_like(x)
            mod._launch(x, r, w_n, EPS, 0.0, zero, ta, off, tb, off, out, res, num_warps=nw)
            return out, res
        return norm

    def vllm_c(x, r):
        torch.ops._C.fused_add_rms_norm(x, r, w_n, EPS)
        return x, r

    impls = {"inductor": lambda x, r: native(x, r, w_n, EPS), "vllm_c": vllm_c,
             "steered_tree": steered(tree), "steered_tree_w4": steered(tree, 4), "steered_tree_w16": steered(tree, 16)}
    if base is not None:
        impls["steered_baseline"] = steered(base)
    rows = []
    for n in [int(v) for v in args.ns.split(",")]:
        x0 = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
        r0 = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
        for name, norm in impls.items():
            def step():
                x, r = x0.clone(), r0.clone()
                for wm in w_mm:
                    x, r = norm(x @ wm, r)
                return x
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            step_us = start.elapsed_time(end) * 1e3 / args.replays
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.replays):
                    graph.replay()
                torch.cuda.synchronize()
            kern: dict[str, list[float]] = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    kern.setdefault(e.name, []).append(e.time_range.elapsed_us())
            norm_names = [k for k in kern if not any(g in k.lower() for g in ("nvjet", "gemm", "cutlass", "splitk", "memcpy"))]
            norm_us = sum(sum(kern[k]) for k in norm_names) / (args.replays * 2 * LAYERS)
            rec = {"N": n, "impl": name, "norm_us_per_launch": round(norm_us, 3), "graph_step_us": round(step_us, 1),
                   "norm_kernels": norm_names[:3]}
            rows.append(rec)
            print(f"N={n:4d} {name:18s} norm {norm_us:7.3f} us/launch   graph step {step_us:9.1f} us   {norm_names[:2]}",
                  flush=True)
            del graph
    doc = {"gpu": torch.cuda.get_device_name(), "d": d, "layers": LAYERS, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
