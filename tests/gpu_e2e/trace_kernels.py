"""Kernels per CUDA-graph launch in a torch.profiler Chrome trace (vLLM's ``start_profile``): the
parser behind the decode-graph check (tests/gpu_e2e/test_decode_graph_gpu.py) and the A/B suite's
graph phase (bench/abkit/runner.py).

Kernels are grouped by ``args.correlation``: a ``cudaGraphLaunch`` runtime event carries the same
correlation id as every kernel it launched, so each launch's kernel count is known. With decode as
one FULL CUDA graph, the launch with the most kernels is a forward pass (``forward_kernels``); the most
common count is ``kernels_per_step``. Kernels whose correlation id is no graph launch's ran eagerly.
tests/test_bench_kit.py checks the parser on a synthetic trace.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import Counter
from pathlib import Path

STEER_KERNEL_PATTERNS = ("steer", "apply_steering", "capture_rows")  # case-insensitive substrings
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")  # runtime / driver API (+ "_v10000" suffixes)


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
    steer_step_us = sorted(sum(float(k.get("dur", 0)) for k in ks if is_steer_kernel(k.get("name", "")))
                           for ks in modal)
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
        "forward_kernels": biggest,
        "step_kernel_us_median": round(step_us[len(step_us) // 2], 1) if step_us else None,
        "step_kernel_us_mean": round(sum(step_us) / len(step_us), 1) if step_us else None,
        "step_launches": len(step_us),
        # our kernels' GPU time in one forward (the same launches): the norms' own cost per decode step
        "step_steer_us_median": round(steer_step_us[len(steer_step_us) // 2], 1) if steer_step_us else None,
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


def newest_trace(folder: Path, before: set, timeout: float = 120) -> Path:
    """The largest trace file under ``folder`` that is not in ``before``, once written (waits)."""
    t_end = time.time() + timeout
    new: list[Path] = []
    while time.time() < t_end:
        new = [p for p in folder.rglob("*.json*") if p not in before]
        if new and all(p.stat().st_size > 0 for p in new):
            time.sleep(1.0)
            break
        time.sleep(1.0)
    if not new:
        raise RuntimeError(f"no trace file under {folder}")
    return max(new, key=lambda p: p.stat().st_size)
