#!/usr/bin/env python3
"""Host cost of one launch of the steered norm outside CUDA graphs (eager steps: prefills and mixed batches larger
than vLLM's largest captured graph), idle, against vLLM's ``_C.fused_add_rms_norm`` and Inductor's native norm.

Kernel microbenchmarks time launches inside CUDA graphs, where no Python runs; a step outside a graph runs each
norm's Python (the custom op's dispatch of its arguments, its impl, the Triton launcher) once per norm and step:
65 times a step at the 8b shape. Per case: host µs per call (``--calls`` calls back to back, timed on the host
without a sync; the GPU is far from full at these sizes) and GPU µs per call (the same loop, synced). Cases: the ops
as the model calls them (``steered_norm``; ``steered_norm_plain``, a site with vectors and capture only), idle tables,
with and without capture plans, a no-op op of ``steered_norm``'s schema (``schema_floor``: the dispatcher's share),
the Triton wrapper called directly, and vLLM's two norms.

On CPU (no CUDA; ``--lane cpu`` forces it) the same host path runs with Triton's launcher stubbed at its last step:
the ops routed to ``triton_path`` / ``plain_triton`` (not the naive reference), the Triton wrapper,
``CachedLauncher`` with a compiled kernel whose launcher is Triton's ``CudaLauncher`` over a no-op ``launch`` (its C
call, not timed); the driver's device and stream getters are constants. Host only, best of ``--rounds``; compare two
trees interleaved (N 16: a CPU allocation of N 8192 rows costs more than the rest), e.g.
``for i in 1 2 3; do for t in A B; do PYTHONPATH=$t/src python3 bench/launch_cost.py --lane cpu --ns 16 --rounds 5;
done; done``.
    python3 bench/launch_cost.py [--ns 16,512,2048,8192 --d 4096 --calls 500 --rounds 1 --lane gpu|cpu --out F.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

EPS, R = 1e-5, 272


def _host_and_device(fn, calls: int, cuda: bool, rounds: int = 1) -> tuple[float, float]:
    """(host µs a call, synced µs a call); with ``rounds`` > 1 the host time is the best round's (the CPU lane on a
    shared box)."""
    for _ in range(20):
        fn()
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    t0 = time.perf_counter()
    for _ in range(rounds):
        t1 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t1)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return 1e6 * best / calls, 1e6 * total / (calls * rounds)


def _stub_launches() -> None:
    """CPU lane: the steered norm's launcher caches a compiled kernel whose ``run`` is Triton's ``CudaLauncher`` over
    a no-op ``launch``; the driver's device and stream are constants; the op's CPU calls take ``triton_path``."""
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import CudaLauncher

    from vllm_steer.kernels import launch_cache
    from vllm_steer.kernels.capture_rows import live
    from vllm_steer.kernels.steered_rms_norm import op as op_mod
    from vllm_steer.kernels.steered_rms_norm import triton as norm_triton

    run = CudaLauncher.__new__(CudaLauncher)
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch = lambda *args: None
    compiled = SimpleNamespace(run=run, function=1, packed_metadata=(), launch_metadata=lambda *a: None,
                               metadata=SimpleNamespace(global_scratch_size=0, profile_scratch_size=0))

    class Jit:  # the first call of each specialization: "compiles" (returns the stub)
        def __init__(self, fn):
            self.arg_names, self.params = fn.arg_names, fn.params

        def __getitem__(self, grid):
            return lambda *args, **kw: compiled

    launch_cache.driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0,
                                                                 get_current_stream=lambda idx: 0))
    norm_triton._KERNEL.fn = Jit(norm_triton._KERNEL.fn)
    op_mod.steered_norm_naive = op_mod.triton_path
    live.may_skip = lambda *a: False

    if hasattr(op_mod, "plain_triton"):  # steered_norm_plain registers it for CUDA: here for CPU
        op_mod._plain_reference = op_mod.plain_triton


def _schema_floor():
    """A no-op op of the steered norm's schema: what the dispatcher alone costs a call."""
    from torch.library import Library

    schema = str(torch.ops.vllm_steer.steered_norm.default._schema).split("(", 1)[1]
    lib = Library("vllm_steer_bench", "FRAGMENT")
    lib.define("steered_norm_noop(" + schema)
    lib.impl("steered_norm_noop", lambda x, *args: (x, x), "CPU")
    lib.impl("steered_norm_noop", lambda x, *args: (x, x), "CUDA")
    return lib, torch.ops.vllm_steer_bench.steered_norm_noop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="16,512,2048,8192")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=1, help="host time: the best of this many rounds of --calls")
    ap.add_argument("--lane", choices=("gpu", "cpu"), default=None, help="default: gpu where CUDA is")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() if args.lane is None else args.lane == "gpu"
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    from vllm_steer.kernels.steered_rms_norm.op import register

    if not cuda:
        _stub_launches()
    register()
    op = torch.ops.vllm_steer.steered_norm
    _lib, noop = _schema_floor()
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
            "schema_floor": lambda: noop(x, r, w, EPS, 0.0, index, [ta, off], [tb, off], [], [], 0, 0, [], None,
                                         None, None, None, [], [], []),
        }
        if hasattr(torch.ops.vllm_steer, "steered_norm_plain"):  # what a site with vectors and capture only calls
            plain = torch.ops.vllm_steer.steered_norm_plain
            cases["op_plain_idle"] = lambda: plain(x, r, w, EPS, 0.0, index, ta, off, tb, off, None, None, None)
            cases["op_plain_capture_plans"] = lambda: plain(x, r, w, EPS, 0.0, index, ta, off, tb, off, none, none,
                                                            pool)
        from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

        cases["triton_wrapper_idle"] = lambda: steered_norm_triton(x, r, w, EPS, 0.0, index, (ta, off), (tb, off))
        if cuda:
            importlib.import_module("vllm._custom_ops")
            from vllm.ir.ops.layernorm import fused_add_rms_norm

            native = torch.compile(fused_add_rms_norm.impls["native"].impl_fn, dynamic=False)
            xs, rs = x.clone(), r.clone()
            cases["vllm_c"] = lambda: torch.ops._C.fused_add_rms_norm(xs, rs, w, EPS)
            cases["inductor_native"] = lambda: native(x, r, w, EPS)
        for name, fn in cases.items():
            host, total = _host_and_device(fn, args.calls, cuda, args.rounds)
            rows.append({"N": n, "D": d, "case": name, "host_us": round(host, 2),
                         "total_us": round(total, 2) if cuda else None})
            print(f"N={n:5d} D={d} {name:24s} host {host:8.2f} us" + (f"  synced {total:8.2f} us" if cuda else ""),
                  flush=True)
    if not cuda:  # the stub was launched directly, from the launcher's cache, as a compiled kernel is on a GPU
        from vllm_steer.kernels.launch_cache import CachedLauncher
        from vllm_steer.kernels.steered_rms_norm.triton import _KERNEL

        assert CachedLauncher.direct and _KERNEL.cache, "the CPU lane did not reach the direct launch"
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu (launch stubbed)", "calls": args.calls,
           "rounds": args.rounds, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
