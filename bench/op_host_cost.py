#!/usr/bin/env python3
"""Host time per launch of the steered norm, the way a non-graph (eager) step launches it.

Batches above vLLM's largest CUDA-graph size run the compiled pieces without a graph: every op is
launched from Python, and the engine core's loop waits for the launches. At N = 1 the GPU finishes
each norm in ~2 µs, so a long loop of calls measures host time per call. Compared:
  op            torch.ops.vllm_steer.steered_rms_norm.default (what Inductor's wrapper calls), launched
                through kernels.launch_cache (the cached compiled kernel)
  op_triton     the same op with the direct path off: every launch through Triton's JITFunction
  launch        the installed _launch with preallocated outputs (no op dispatch, no allocation)
  jit           the bare JITFunction call (Triton's binder + cache lookup + launch)
  impl          the op's Python body called directly (op - impl = the dispatcher's share)
  alloc2        the op's two output allocations (torch.empty_like twice)
  key           launch_cache's specialization key over the launch's arguments
  stream        the current-stream lookup of each direct launch
  run           the cached compiled kernel's launcher alone (CachedLauncher._run: empty hook chains as None)
  run_hooks     the same launcher called as Triton calls it (launch metadata + both hook chains)
  compiled_fn   a torch.compile'd function holding one steered op (dynamo guards + Inductor wrapper)
  inductor_fn   a torch.compile'd function holding vLLM's native fused add + RMSNorm (stock's kernel)
The *_fn rows share the guard cost, so their difference is what each kernel's launch costs.
(A torch.library.triton_op wrapping the kernel, so that Inductor would launch it itself, failed in
Inductor's kernel analysis on torch 2.11: CompilationError at the shared body's call.)

    python3 bench/op_host_cost.py --out $OUT/op_host_cost.json
"""


import argparse
import json
import sys
import time
from pathlib import Path

EPS, R = 1e-5, 272


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="op_host_cost.json")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ns", default="1,4096")
    args = ap.parse_args()

    import torch
    import triton

    from vllm.ir.ops.layernorm import fused_add_rms_norm
    from vllm_steer.kernels import launch_cache
    from vllm_steer.kernels.launch_cache import CachedLauncher
    from vllm_steer.kernels.steered_rms_norm import op as norm_op
    from vllm_steer.kernels.steered_rms_norm import triton as tri

    norm_op.register()
    drv = launch_cache.driver
    d, dev = args.d, "cuda"
    w = (torch.rand(d, device=dev) + 0.5).to(torch.bfloat16)
    ta = torch.zeros(R, d, device=dev, dtype=torch.bfloat16)
    tb = torch.zeros(R, d, device=dev, dtype=torch.bfloat16)
    fa = torch.zeros(16, device=dev, dtype=torch.uint8)[:1]
    fb = torch.zeros(16, device=dev, dtype=torch.uint8)[:1]
    index = torch.zeros(8192, device=dev, dtype=torch.int32)
    block_d = triton.next_power_of_2(d)
    assert CachedLauncher.direct, "the direct launch path is off in this Triton"

    native = fused_add_rms_norm.impls["native"].impl_fn
    rows = []

    def run_hooks(kernel, grid, all_args):
        knobs = launch_cache.knobs
        stream = drv.active.get_current_stream(drv.active.get_current_device())
        meta = kernel.launch_metadata(grid, stream, *all_args)
        kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, meta,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *all_args)

    for n in [int(v) for v in args.ns.split(",")]:
        x = torch.randn(n, d, device=dev).to(torch.bfloat16)
        r = torch.randn(n, d, device=dev).to(torch.bfloat16)
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        op = torch.ops.vllm_steer.steered_rms_norm.default
        flags = dict(D=d, HAS_RES=True, HAS_A=True, HAS_B=True, OFFSET_WEIGHT=False, BLOCK_D=block_d, num_warps=8)
        jargs = (x, r, w, out, res_out, index, ta, fa, tb, fb, x.stride(0), r.stride(0), out.stride(0),
                 res_out.stride(0), ta.stride(0), tb.stride(0), EPS, 0.0)

        def f_steer(x, r):
            return torch.ops.vllm_steer.steered_rms_norm(x, r, w, EPS, 0.0, index, ta, fa, tb, fb)

        def f_native(x, r):
            return native(x, r, w, EPS)

        def op_triton():
            CachedLauncher.direct = False
            try:
                return op(x, r, w, EPS, 0.0, index, ta, fa, tb, fb)
            finally:
                CachedLauncher.direct = True

        op(x, r, w, EPS, 0.0, index, ta, fa, tb, fb)  # fills the launch cache
        consts = (d, True, True, True, False, block_d)
        cached = next(iter(tri._PLAIN.cache.values()))

        cands = {
            "op": lambda: op(x, r, w, EPS, 0.0, index, ta, fa, tb, fb),
            "impl": lambda: norm_op._impl(x, r, w, EPS, 0.0, index, ta, fa, tb, fb),
            "alloc2": lambda: (torch.empty_like(x), torch.empty_like(x)),
            "key": lambda: (launch_cache._key(jargs), consts, 8),
            "stream": lambda: drv.active.get_current_stream(drv.active.get_current_device()),
            "run": lambda: CachedLauncher._run(cached, (n,), jargs + consts),
            "run_hooks": lambda: run_hooks(cached, (n,), jargs + consts),
            "op_triton": op_triton,
            "launch": lambda: tri._launch(x, r, w, EPS, 0.0, index, ta, fa, tb, fb, out, res_out),
            "jit": lambda: tri._steered_rms_norm_kernel[(n,)](*jargs, **flags),
        }
        for name, fn in (("compiled_fn", f_steer), ("inductor_fn", f_native)):
            c = torch.compile(fn, dynamic=False, fullgraph=True)
            cands[name] = (lambda c=c: c(x, r))
        ref = None
        for name, fn in cands.items():
            try:
                for _ in range(50):
                    res = fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a candidate that does not run is a result too
                rec = {"N": n, "impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                rows.append(rec)
                print(json.dumps(rec)[:400], flush=True)
                continue
            if name in ("op", "op_triton", "compiled_fn", "inductor_fn"):
                o = res[0] if isinstance(res, tuple) else res
                ref = o if ref is None else ref
                ok = bool(torch.allclose(o.float(), ref.float(), atol=2e-2, rtol=2e-2))
            else:
                ok = None
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            rec = {"N": n, "impl": name, "host_us_per_call": round((t1 - t0) * 1e6 / args.calls, 2),
                   "wall_us_per_call": round((t2 - t0) * 1e6 / args.calls, 2), "matches_op": ok}
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "d": d, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
