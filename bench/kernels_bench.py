#!/usr/bin/env python3
"""Microbenchmark (GPU, bf16, µs per launch in CUDA graphs of 20 launches, after a correctness check) of the steered
norm (idle; row 0; every token steered; the conditional kernel: cond_plain / cond_gated / cond_probe; projections:
proj_row0 / proj_all; capture plans: capture_idle / capture_all) against
vLLM's CUDA ``_C.fused_add_rms_norm``, its Inductor-compiled native norm, and a gather-add before the norm.
Then the decode step as the engine launches it (``step_rows``, N in --step-ns, D 4096): the 64 steered norms of a
32-layer model (post_attn L; post_mlp L with pre_attn L+1; the final norm), each slot its own vector table and, on a
``max_projections`` 1 server, its own site of a ``runtime.projection_tables.ProjectionTables`` (the engine's
layout: a row's 95 sites side by side), one token per row (rows 1..N, each its own direction), and a 256 MiB write
per step that evicts L2 as the weights do (its own time subtracted): µs per step for ``step_steered`` (vectors at
every slot, no projection tables: per_request_n16), ``step_proj_idle`` (projection tables, no live row:
project_idle), ``step_proj_live`` (each row ablating its direction at every post_mlp site, the other sites marked
idle: project_n16) and ``step_proj_unmarked`` (the same with no site marked idle, every slot reading its token's
direction: project_n16 before the idle marks).
The steered norm's default is EARLY (``kernels/steered_rms_norm/triton.py``: every slot's scalar and row loads
before the first branch); ``*_late`` rows time the late path (``early=False``, VLLM_STEER_NORM_EARLY=0) beside the
default's, and ``*_bf16`` rows ``runtime.projection_tables`` DIRS "model" (bf16 directions), each checked against the
reference first: per launch at D 4096, N 16 and 64 (steered_idle_late, steered_all_late, proj_row0_late,
proj_all_late, proj_all_bf16) and per step (step_idle / _late: vector tables allocated, nothing steered, no
projection tables, as enabled_idle; step_steered_late, step_proj_idle_late, step_proj_live_late / _bf16).
step_proj_live is project_n16's shape on the ``steer_proj`` server: 64 launches, 32 of them projecting
at slot A (post_mlp L = the input norm of L + 1, the final norm), K 1, float32 directions, vector flags off (a
projection-only config writes no vector row), 16 tokens each its own row; step_steered is per_request_n16's.
    python3 bench/kernels_bench.py --out $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

EPS = 1e-5
R = 272


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--ns", default="1,16,64,256,2048,8192", help="token counts N")
    ap.add_argument("--ds", default="4096,8192", help="hidden sizes D")
    ap.add_argument("--step-ns", default="16,64", help="token counts of the engine-step rows ('' for none)")
    args = ap.parse_args()

    # Inductor compiles the native norm in this process, not in a pool of workers: workers that outlived a killed
    # bench would keep its stdout open and the step's `| tail` waiting (a suspect for the twenty-seventh's 19 silent
    # minutes: the step printed nothing although under `timeout 240`)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch
    import triton.testing

    importlib.import_module("vllm._custom_ops")  # registers torch.ops._C
    from vllm.ir.ops.layernorm import fused_add_rms_norm
    from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    def copy_bandwidth() -> float:  # GB/s of a 512 MiB bf16 copy (its buffers freed on return)
        src = torch.randn(256 * 1024 * 1024, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
        return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9

    dev, copy_gbps = torch.cuda.get_device_name(), copy_bandwidth()
    native = torch.compile(fused_add_rms_norm.impls["native"].impl_fn, dynamic=False)
    rows, reps = [], 20  # reps: launches per graph replay

    def timed(fn) -> float:
        def many():
            for _ in range(reps):
                fn()

        return triton.testing.do_bench_cudagraph(many, rep=200, return_mode="median") * 1e3 / reps

    for d in [int(v) for v in args.ds.split(",")]:
        for n in [int(v) for v in args.ns.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(n + d)
            x = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
            r = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(d, device="cuda", generator=g).to(torch.bfloat16)
            ta = (torch.randn(R, d, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
            tb = ta.flip(0).contiguous()
            ta[0].zero_()
            tb[0].zero_()
            on, off = (torch.full((1,), v, dtype=torch.uint8, device="cuda") for v in (1, 0))
            steered = torch.randint(1, R, (max(n, 8192),), device="cuda", dtype=torch.int32, generator=g)
            zero = torch.zeros_like(steered)
            # correctness first: the steered kernel vs its reference, and unsteered vs vLLM's kernel
            got = steered_norm_triton(x, r, w, EPS, 0.0, steered, (ta, on), (tb, on))
            want = steered_norm_naive(x, r, w, EPS, 0.0, steered, (ta, on), (tb, on))
            err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
            cx, cr = x.clone(), r.clone()
            torch.ops._C.fused_add_rms_norm(cx, cr, w, EPS)
            plain = steered_norm_triton(x, r, w, EPS, 0.0, zero, (ta, off), (tb, off))
            err_vllm = max(float((p.float() - c.float()).abs().max()) for p, c in zip(plain, (cx, cr)))
            xs, rs = x.clone(), r.clone()
            idx_l = steered[:n].long()
            variant_err: dict[str, float] = {}
            cases = {
                "vllm_c": lambda: torch.ops._C.fused_add_rms_norm(xs, rs, w, EPS),
                "inductor_native": lambda: native(x, r, w, EPS),
                "steered_idle": lambda: steered_norm_triton(x, r, w, EPS, 0.0, zero, (ta, off), (tb, off)),
                "steered_row0": lambda: steered_norm_triton(x, r, w, EPS, 0.0, zero, (ta, on), (tb, on)),
                "steered_all": lambda: steered_norm_triton(x, r, w, EPS, 0.0, steered, (ta, on), (tb, on)),
                "gather_add_then_norm": lambda: (xs.add_(ta.index_select(0, idx_l)),
                                                 torch.ops._C.fused_add_rms_norm(xs, rs, w, EPS)),
            }
            site_ids = torch.tensor([5, 6], dtype=torch.int32, device="cuda")
            gate = torch.zeros(max(n, 8192), dtype=torch.float32, device="cuda")
            params = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * R, device="cuda")
            probe = torch.randn(R, d, device="cuda", generator=g) / d ** 0.5
            for label, site in (("cond_plain", -1), ("cond_gated", 3), ("cond_probe", 5)):
                csite = torch.full((R,), site, dtype=torch.int32, device="cuda")
                csite[0] = -1
                cases[label] = (lambda csite=csite: steered_norm_triton(
                    x, r, w, EPS, 0.0, steered, (ta, on), (tb, on), cond=(csite, params, probe, site_ids), gate=gate))
            # projections (one unit direction per row at slot A, ablated) and capture plans (every token -1: a
            # capturing server's idle launches; every token planned: each stored to the pool)
            count = torch.ones(R, dtype=torch.int32, device="cuda")
            count[0] = 0
            dirs = torch.randn(R, 1, d, device="cuda", generator=g)
            dirs /= dirs.norm(dim=-1, keepdim=True)
            bounds = torch.zeros(R, 1, 2, device="cuda")
            proj = (count, dirs, bounds)
            cases["proj_row0"] = lambda: steered_norm_triton(x, r, w, EPS, 0.0, zero, (ta, on), (tb, on), proj_a=proj)
            cases["proj_all"] = lambda: steered_norm_triton(x, r, w, EPS, 0.0, steered, (ta, on), (tb, on), proj_a=proj)
            # the late path (kernels/steered_rms_norm/triton.py, early=False) and bf16 directions
            # (runtime.projection_tables DIRS): each beside its default row above, its error against the reference
            # checked first; at the A/B's sizes only (D 4096, N 16 and 64: the step stays inside gpu_session.sh's
            # timeout)
            proj16 = (count, dirs.to(torch.bfloat16), bounds)
            variants = () if (d, n) not in ((4096, 16), (4096, 64)) else (
                ("steered_idle_late", dict(index=zero, flag=off, early=False)),
                ("steered_all_late", dict(index=steered, flag=on, early=False)),
                ("proj_row0_late", dict(index=zero, flag=on, proj_a=proj, early=False)),
                ("proj_all_late", dict(index=steered, flag=on, proj_a=proj, early=False)),
                ("proj_all_bf16", dict(index=steered, flag=on, proj_a=proj16)))
            for label, kw in variants:
                kw = dict(kw)
                idx, flag = kw.pop("index"), kw.pop("flag")
                cases[label] = (lambda idx=idx, flag=flag, kw=kw: steered_norm_triton(
                    x, r, w, EPS, 0.0, idx, (ta, flag), (tb, flag), **kw))
                ref = {k: v for k, v in kw.items() if k in ("proj_a", "proj_b")}
                variant_err[label] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(
                    cases[label](), steered_norm_naive(x, r, w, EPS, 0.0, idx, (ta, flag), (tb, flag), **ref)))
            none = torch.full((max(n, 8192),), -1, dtype=torch.int32, device="cuda")
            every = torch.arange(max(n, 8192), dtype=torch.int32, device="cuda")
            pool = torch.empty(2 * max(n, 8192), d, dtype=torch.bfloat16, device="cuda")
            cases["capture_idle"] = lambda: steered_norm_triton(x, r, w, EPS, 0.0, zero, (ta, off), (tb, off),
                                                                plan_a=none, plan_b=none, pool=pool)
            cases["capture_all"] = lambda: steered_norm_triton(x, r, w, EPS, 0.0, zero, (ta, off), (tb, off),
                                                               plan_a=every, plan_b=every + n, pool=pool)
            for impl, fn in cases.items():
                fn()
                torch.cuda.synchronize()
                us = timed(fn)
                rec = {"N": n, "D": d, "impl": impl, "us": round(us, 3),
                       "GBps": round(4 * n * d * 2 / (us * 1e-6) / 1e9, 1),
                       "max_abs_err_vs_ref": variant_err.get(impl, err), "max_abs_err_unsteered_vs_vllm_c": err_vllm}
                rows.append(rec)
                print(f"N={n:5d} D={d:5d} {impl:24s} {us:8.2f} us  {rec['GBps']:8.1f} GB/s", flush=True)
    for n in [int(v) for v in args.step_ns.split(",") if v]:
        rows += step_rows(n, 4096, 32)
    doc = {"gpu": dev, "copy_GBps": round(copy_gbps, 1), "bytes_model": "4*N*D*2 (read x, r; write out, residual)",
           "launches_per_replay": reps, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}))
    return 0


def step_rows(n: int, d: int, layers: int, device: str = "cuda") -> list[dict]:
    """One decode step's steered norms as the engine launches them (see the module docstring), per arm: µs per step
    (graph replay of one step, less the L2-evicting write's own time); one input norm (post_mlp projected, pre_attn
    idle) checked against the reference (``check_err``)."""
    import numpy as np
    import torch
    import triton.testing

    from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton
    from vllm_steer.runtime.projection_tables import ProjectionTables

    dev = torch.device(device)
    g = torch.Generator(device=device).manual_seed(n)
    sites = {(h, l) for h in ("pre_attn", "post_attn", "post_mlp") for l in range(layers)}
    # the norms of a step: post_attn L (slot A), input norm of L + 1 (A: post_mlp L, B: pre_attn L + 1), final
    norms = []
    for layer in range(layers):
        norms.append((("post_attn", layer), None))
        norms.append((("post_mlp", layer), ("pre_attn", layer + 1) if layer + 1 < layers else None))
    x = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
    r = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(d, device=dev, generator=g).to(torch.bfloat16)
    index = torch.arange(1, n + 1, dtype=torch.int32, device=dev)  # one row per token, as 16 distinct configs
    tables = {s: (torch.randn(R, d, device=dev, generator=g) * 0.05).to(torch.bfloat16) for s in sites}
    on, off = (torch.full((1,), v, dtype=torch.uint8, device=dev) for v in (1, 0))
    proj = ProjectionTables(sites, R, 1, d, dev)
    proj16 = ProjectionTables(sites, R, 1, d, dev, torch.bfloat16)  # DIRS=model's tables
    rng = np.random.default_rng(n)
    for row in range(1, n + 1):
        v = rng.standard_normal(d).astype(np.float32)
        v = (v / np.linalg.norm(v)).astype(np.float32)
        for t in (proj, proj16):
            t.write_row(row, [("post_mlp", l, v.tobytes(), np.zeros(2, np.float32).tobytes()) for l in range(layers)])
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device=dev)

    zero = torch.zeros_like(index)

    def step(flag, with_proj: bool, tabs=proj, rows=index, **variant):
        def run():
            flush.zero_()
            for a, b in norms:
                vec_b = (tables[b], flag) if b is not None else ()
                pa = tabs.descs[a] if with_proj else ()
                pb = tabs.descs[b] if with_proj and b is not None else ()
                steered_norm_triton(x, r, w, EPS, 0.0, rows, (tables[a], flag), vec_b, proj_a=pa, proj_b=pb, **variant)
        return run

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median") * 1e3

    flush_us = timed(lambda: flush.zero_())
    out, err = [], None

    def record(label: str, fn) -> None:
        us = timed(fn) - flush_us
        out.append({"N": n, "D": d, "impl": label, "us": round(us, 3), "launches": len(norms),
                    "us_per_launch": round(us / len(norms), 3), "flush_us": round(flush_us, 2), "check_err": err})
        print(f"N={n:5d} D={d:5d} {label:24s} {us:8.2f} us/step ({len(norms)} launches, {us / len(norms):.2f} us "
              f"each)", flush=True)

    # nothing steered, no projection tables (enabled_idle: every token's row 0, every table's flag off), both paths
    # in one process: the server graph's enabled_idle read 141.9 µs late, 162.1 early (s29, different GPUs)
    record("step_idle", step(off, False, rows=zero))
    record("step_idle_late", step(off, False, rows=zero, early=False))
    record("step_steered", step(on, False))
    record("step_steered_late", step(on, False, early=False))
    record("step_proj_idle", step(off, True))  # no row live: every site marked idle
    record("step_proj_idle_late", step(off, True, early=False))
    for row in range(1, n + 1):
        proj.set_live(row, True)
        proj16.set_live(row, True)
    torch.cuda.synchronize()
    a, b = norms[1]  # a check: post_mlp 0 (projected) + pre_attn 1 (idle) at one input norm, as the reference
    errs = {}
    live = (("step_proj_live", proj, {}), ("step_proj_live_late", proj, dict(early=False)),
            ("step_proj_live_bf16", proj16, {}))
    for label, tabs, variant in live:
        # the vectors on (tables a, b): the check covers the adds around the projection
        vec = ((tables[a], on), (tables[b], on))
        got = steered_norm_triton(x, r, w, EPS, 0.0, index, *vec, proj_a=tabs.descs[a], proj_b=tabs.descs[b],
                                  **variant)
        want = steered_norm_naive(x, r, w, EPS, 0.0, index, *vec, proj_a=tabs.descs[a], proj_b=tabs.descs[b])
        errs[label] = max(float((p.float() - q.float()).abs().max()) for p, q in zip(got, want))
    plain = steered_norm_naive(x, r, w, EPS, 0.0, index, (tables[a], on), (tables[b], on))
    moved = float((got[1].float() - plain[1].float()).abs().max())
    print(f"N={n:5d} step check (post_mlp projected, pre_attn's vectors): max abs err vs reference {errs}, "
          f"moved by the projection {moved:.3g}")
    for label, tabs, variant in live:
        err = errs[label]
        record(label, step(off, True, tabs, **variant))
    err = errs["step_proj_live"]
    proj._count[:, 0] = 0  # no site marked idle: every slot reads its token's direction (before the marks)
    record("step_proj_unmarked", step(off, True))
    return out


if __name__ == "__main__":
    sys.exit(main())
