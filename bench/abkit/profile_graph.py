"""The ``graph`` phase: torch.profiler (vLLM's /start_profile) around a few requests per server,
and the parser of the Chrome trace it writes.

Kernels are grouped by ``args.correlation``: a ``cudaGraphLaunch`` runtime event carries the same
correlation id as every kernel it launched, so each launch's kernel count is known. With decode as
one FULL CUDA graph the most common kernels-per-launch value is the per-decode-step kernel count.
Kernels whose correlation id is no graph launch's were launched eagerly.
``python3 -m abkit.profile_graph`` (from bench/) runs the parser's self-test on a synthetic trace.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections import Counter
from pathlib import Path

from .arms import arm_fields, build_bodies, make_prompts, seed_of
from .client import http_json, run_load
from .common import log
from .servers import server_unavailable

STEER_KERNEL_PATTERNS = ("steer", "apply_steering", "capture_rows")  # case-insensitive substrings
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")  # runtime / driver API (+ "_v10000" suffixes)
GRAPH_PLAN = [  # (label, server, kind of traffic)
    ("stock / unsteered", "stock", "plain"),
    ("disabled / unsteered", "disabled", "plain"),
    ("steer / unsteered (enabled_idle)", "steer", "plain"),
    ("steer / per_request_n4", "steer", "per_request"),
    ("sae / unsteered (sae_idle)", "sae", "plain"),
    ("sae_full / unsteered (sae_full_idle)", "sae_full", "plain"),
    ("steer_cond / unsteered (cond_idle)", "steer_cond", "plain"),
    ("steer_cond / cond_n4", "steer_cond", "cond"),
]


def is_steer_kernel(name: str) -> bool:
    n = name.lower()
    return any(p in n for p in STEER_KERNEL_PATTERNS)


def _corr(e: dict):
    return (e.get("args") or {}).get("correlation")


def _us(evs) -> float:
    return round(sum(float(e.get("dur", 0)) for e in evs), 1)


def analyze_events(events: list) -> dict:
    """Kernel totals, kernels per CUDA-graph launch, eager kernels and steering kernels of a trace."""
    ev = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    kern = [e for e in ev if e.get("cat") == "kernel"]
    launches = [e for e in ev if e.get("cat") != "kernel"
                and str(e.get("name", "")).startswith(GRAPH_LAUNCH_NAMES)]
    by_corr: dict = {}
    for e in kern:
        by_corr.setdefault(_corr(e), []).append(e)
    launch_corrs = {_corr(e) for e in launches if _corr(e) is not None}
    per_launch = [len(by_corr.get(_corr(e), [])) for e in launches]
    hist = Counter(per_launch)
    mode = max(hist.items(), key=lambda kv: (kv[1], kv[0]))[0] if hist else None
    in_graph = [e for e in kern if _corr(e) in launch_corrs]
    eager = [e for e in kern if _corr(e) not in launch_corrs]
    steer = [e for e in kern if is_steer_kernel(e.get("name", ""))]
    steer_in_graph = [e for e in steer if _corr(e) in launch_corrs]
    # steering kernels in one decode step: over the launches with the modal kernel count
    steer_per_modal = Counter(
        sum(1 for k in by_corr.get(_corr(e), []) if is_steer_kernel(k.get("name", "")))
        for e, n in zip(launches, per_launch) if n == mode)
    # GPU time of the forward graph (the launches with the most kernels), in all and per kernel name
    biggest = max(per_launch, default=None)
    modal = [by_corr.get(_corr(e), []) for e, n in zip(launches, per_launch) if n == biggest]
    step_us = sorted(sum(float(k.get("dur", 0)) for k in ks) for ks in modal)
    per_name: dict[str, float] = {}
    for ks in modal:
        for k in ks:
            per_name[k["name"][:80]] = per_name.get(k["name"][:80], 0.0) + float(k.get("dur", 0)) / len(modal)
    eager_names = Counter(e.get("name", "")[:80] for e in eager)
    top: dict[str, float] = {}
    for e in kern:
        top[e["name"][:80]] = top.get(e["name"][:80], 0.0) + float(e.get("dur", 0))
    host: dict[str, list] = {}
    for e in ev:
        if e.get("cat") in ("user_annotation", "python_function", "cpu_op"):
            h = host.setdefault(f"{e.get('cat')}:{e.get('name', '')[:70]}", [0, 0.0])
            h[0] += 1
            h[1] += float(e.get("dur", 0))
    span = 0.0
    if kern:
        span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kern) - min(float(e["ts"]) for e in kern)
    return {
        "kernels": len(kern),
        "kernel_us": _us(kern),
        "graph_launches": len(launches),
        "kernels_per_launch_hist": {str(k): v for k, v in sorted(hist.items())},
        "kernels_per_step": mode,
        "step_kernel_us_median": round(step_us[len(step_us) // 2], 1) if step_us else None,
        "step_kernel_us_mean": round(sum(step_us) / len(step_us), 1) if step_us else None,
        "step_launches": len(step_us),
        "step_top_kernels_us": sorted(((round(v, 2), k) for k, v in per_name.items()), reverse=True)[:20],
        "graph_kernels": len(in_graph),
        "graph_kernel_us": _us(in_graph),
        "eager_kernels": len(eager),
        "eager_kernel_us": _us(eager),
        "eager_top_kernels": [[n, k] for k, n in eager_names.most_common(8)],
        "steer_kernels": len(steer),
        "steer_kernel_us": _us(steer),
        "steer_kernels_in_graphs": len(steer_in_graph),
        "steer_kernels_eager": len(steer) - len(steer_in_graph),
        "steer_kernels_per_step": (max(steer_per_modal.items(), key=lambda kv: (kv[1], kv[0]))[0]
                                   if steer_per_modal else None),
        "steer_kernel_names": [[n, k] for k, n in Counter(e.get("name", "")[:80] for e in steer).most_common(5)],
        "steer_events_any_category": sum(1 for e in ev if is_steer_kernel(e.get("name", ""))),
        "top_kernels_us": sorted(((round(v, 1), k) for k, v in top.items()), reverse=True)[:12],
        "gpu_span_us": round(span, 1),
        "top_host_us": sorted(((round(v[1], 1), v[0], k) for k, v in host.items()), reverse=True)[:60],
    }


def parse_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        tr = json.load(f)
    return {"trace": path.name, **analyze_events(tr.get("traceEvents", []))}


def _new_trace(server, before: set, timeout: float = 120) -> Path:
    t_end = time.time() + timeout
    new: list[Path] = []
    while time.time() < t_end:
        new = [p for p in server.prof_dir.rglob("*.json*") if p not in before]
        if new and all(p.stat().st_size > 0 for p in new):
            time.sleep(1.0)
            break
        time.sleep(1.0)
    if not new:
        raise RuntimeError(f"no trace file under {server.prof_dir}")
    return max(new, key=lambda p: p.stat().st_size)


def graph_phase(pool, ctx: dict, results: dict, save) -> None:
    res = results.setdefault("graph", {})
    for label, sname, kind in [p for p in GRAPH_PLAN if p[1] in ctx["graph_servers"]]:
        why = server_unavailable(sname, ctx["args"])
        if why:
            log(f"[graph] skipping {label}: {why}")
            continue
        try:
            server = pool.get(sname)
            before = set(server.prof_dir.rglob("*.json*"))
            n, mt = int(os.environ.get("GRAPH_REQUESTS", "4")), 16
            prompts = make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of("graph", label))
            fields = arm_fields({"kind": kind, "n_configs": 4}, n, seed_of("graph", label, "v"), ctx)
            bodies = build_bodies(prompts, fields, mt)
            run_load(server, bodies, n)  # warm: rows resident, nothing new compiled in the window
            fields = arm_fields({"kind": kind, "n_configs": 4}, n, seed_of("graph", label, "v2"), ctx)
            bodies = build_bodies(make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"],
                                               seed_of("graph", label, 2)), fields, mt)
            st, _ = http_json("POST", server.base + "/start_profile", timeout=120)
            if st != 200:
                raise RuntimeError(f"/start_profile -> {st}")
            out, _wall = run_load(server, bodies, n)
            st, _ = http_json("POST", server.base + "/stop_profile", timeout=300)
            rec = parse_trace(_new_trace(server, before))
            rec["requests_steered"] = sum(1 for r in out if r.get("steering"))
            stcode, status = http_json("GET", server.base + "/v1/steering")
            rec["status_http"] = stcode
            if stcode == 200 and isinstance(status, dict):
                ws = status.get("workers") or [{}]
                rec["status_ops"] = ws[0].get("ops")
                rec["status_enabled"] = status.get("enabled")
            else:
                rec["status_ops"] = f"HTTP {stcode}"
            res[label] = rec
            log(f"[graph] {label}: kernels {rec['kernels']} ({rec['kernel_us']} µs), graph launches "
                f"{rec['graph_launches']}, kernels/launch {rec['kernels_per_launch_hist']} (per step "
                f"{rec['kernels_per_step']}; forward graph median {rec['step_kernel_us_median']} µs GPU over "
                f"{rec['step_launches']} launches), eager kernels {rec['eager_kernels']} ({rec['eager_kernel_us']} µs), "
                f"steer kernels {rec['steer_kernels']} ({rec['steer_kernel_us']} µs; in graphs "
                f"{rec['steer_kernels_in_graphs']}, per step {rec['steer_kernels_per_step']}), "
                f"/v1/steering ops {rec['status_ops']}")
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            log(f"[graph] {label}: error {e}")
        save()


def _selftest() -> None:
    """Parser check on a synthetic trace: 3 graph launches (5, 5 and 7 kernels), 2 eager kernels."""
    import tempfile

    ev: list[dict] = []
    ts = [0.0]

    def x(name, cat, corr, dur=2.0):
        ts[0] += 3.0
        ev.append({"ph": "X", "name": name, "cat": cat, "ts": ts[0], "dur": dur, "args": {"correlation": corr}})

    for corr, n, steer_names in ((10, 5, ["triton_red_fused_add_rms_norm_Steer_0"]), (20, 5, ["vs_capture_rows"]),
                                 (30, 7, [])):
        x("cudaGraphLaunch", "cuda_runtime", corr, 1.0)
        for i in range(n - len(steer_names)):
            x(f"gemm_{i}", "kernel", corr)
        for s in steer_names:
            x(s, "kernel", corr, 4.0)
    x("cudaLaunchKernel", "cuda_runtime", 40, 1.0)
    x("apply_steering_kernel", "kernel", 40, 10.0)
    x("cudaLaunchKernel", "cuda_runtime", 41, 1.0)
    x("elementwise_kernel", "kernel", 41)
    ev.append({"ph": "X", "name": "gpu_memcpy", "cat": "gpu_memcpy", "ts": 1.0, "dur": 1.0,
               "args": {"correlation": 10}})  # not a kernel: not counted
    ev.append({"ph": "i", "name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 1.0})  # not an X event
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "rank0.pt.trace.json.gz"
        with gzip.open(p, "wt") as f:
            json.dump({"traceEvents": ev}, f)
        r = parse_trace(p)
    want = {"kernels": 19, "graph_launches": 3, "kernels_per_launch_hist": {"5": 2, "7": 1},
            "kernels_per_step": 5, "graph_kernels": 17, "eager_kernels": 2, "eager_kernel_us": 12.0,
            "steer_kernels": 3, "steer_kernel_us": 18.0, "steer_kernels_in_graphs": 2, "steer_kernels_eager": 1,
            "steer_kernels_per_step": 1, "kernel_us": 50.0, "graph_kernel_us": 38.0}
    got = {k: r[k] for k in want}
    assert got == want, f"profile_graph self-test: got {got}, want {want}"
    # no graph launches at all (eager server): every kernel is eager, no per-step count
    r2 = analyze_events([e for e in ev if not e["name"].startswith("cudaGraph")])
    assert (r2["graph_launches"], r2["kernels_per_step"], r2["eager_kernels"]) == (0, None, 19), r2
    print("profile_graph self-test passed:", json.dumps(got))


if __name__ == "__main__":
    _selftest()
