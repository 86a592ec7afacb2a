"""Kernels per CUDA-graph launch in a torch.profiler Chrome trace (vLLM's ``start_profile``): the
parser behind the decode-graph check (tests/gpu_e2e/test_decode_graph_gpu.py) and the A/B suite's
graph phase (bench/abkit/runner.py).

Kernels are grouped by ``args.correlation``: a ``cudaGraphLaunch`` runtime event carries the same
correlation id as every kernel it launched, so each launch's kernel count is known. With decode as
one FULL CUDA graph, the launch with the most kernels is a forward pass (``forward_kernels``); the most
common count is ``kernels_per_step``. Kernels whose correlation id is no graph launch's ran eagerly.

``timeline`` (issue 37: why prefill capture costs ~4%) says whether the GPU waits between steps or works more:
the window (first kernel start to last kernel end), the busy time (union of every kernel interval, all
streams: an 8192-token prefill step runs no CUDA graph, so every kernel of it is eager), the idle gaps, the
copies and sets (``gpu_memcpy`` / ``gpu_memset``: by direction, bytes, and how much of their time runs under a
kernel), the steps (vLLM's ``execute_context_N(T)_generation_M(G)`` annotation, on the host and its GPU
projection), and the host's CUDA runtime calls (a thread blocked in a sync shows there).
tests/test_bench_kit.py checks the parser on synthetic traces.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
import time
from collections import Counter
from pathlib import Path

STEER_KERNEL_PATTERNS = ("steer", "apply_steering", "capture_rows")  # case-insensitive substrings
# all-reduce kernels (TP): NCCL's, vLLM's custom (cross_device_reduce), PyTorch symmetric memory's, FlashInfer's fused
# all-reduce + residual add + RMSNorm (allreduce_fusion_kernel_*: issue 40's fused stock)
COMM_KERNEL_PATTERNS = ("allreduce", "all_reduce", "cross_device_reduce", "nccl")
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")  # runtime / driver API (+ "_v10000" suffixes)
GAP_US = 50.0  # an idle gap longer than this between kernels is counted
LATE_US = 20.0  # a kernel launched less than this before it ran: the GPU was waiting for its launch
# host calls whose time says a thread waited on the device or queued copies (runtime names, "_v..." suffix stripped)
SYNC_CALLS = ("cudaStreamWaitEvent", "cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaMemcpyAsync", "cudaMemcpy", "cudaEventRecord", "cudaEventQuery")
STEP_RE = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")


def is_steer_kernel(name: str) -> bool:
    n = name.lower()
    return any(p in n for p in STEER_KERNEL_PATTERNS)


def is_comm_kernel(name: str) -> bool:
    n = name.lower()
    return any(p in n for p in COMM_KERNEL_PATTERNS)


def _corr(e: dict):
    return (e.get("args") or {}).get("correlation")


def _us(evs) -> float:
    return round(sum(float(e.get("dur", 0)) for e in evs), 1)


def _tally(into: dict, key: str, e: dict) -> None:
    """Count event ``e`` and add its duration under ``key``: ``into[key] = [count, µs]``."""
    r = into.setdefault(key, [0, 0.0])
    r[0] += 1
    r[1] += float(e.get("dur", 0))


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, sorted and disjoint."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, merged: list[tuple[float, float]], starts: list[float]) -> float:
    """How much of ``[a, b]`` the disjoint sorted intervals ``merged`` (``starts``: their starts) cover."""
    i, out = max(0, bisect.bisect_right(starts, a) - 1), 0.0
    while i < len(merged) and merged[i][0] < b:
        out += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
        i += 1
    return out


def _span(e: dict) -> tuple[float, float]:
    t = float(e["ts"])
    return t, t + float(e.get("dur", 0))


def _direction(name: str, cat: str) -> str:
    if cat == "gpu_memset":
        return "memset"
    return next((d for d in ("DtoH", "HtoD", "DtoD", "PtoP", "HtoH") if d in name), "other")


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def _steps_and_calls(ev: list[dict]) -> dict:
    """vLLM's per-step annotation on the host thread and its projection on the GPU, and the CUDA runtime calls."""
    host_steps, gpu_parts = ([e for e in ev if e.get("cat") == cat and STEP_RE.fullmatch(str(e.get("name", "")))]
                             for cat in ("user_annotation", "gpu_user_annotation"))
    # a step's GPU projection comes once per stream its work ran on: one span per host annotation (External id)
    spans: dict = {}
    for e in gpu_parts:
        key = (e.get("args") or {}).get("External id")
        a, b = _span(e)
        if key is None or key not in spans:
            spans[key if key is not None else id(e)] = {"name": e["name"], "ts": a, "dur": b - a}
        else:
            s = spans[key]
            end = max(s["ts"] + s["dur"], b)
            s["ts"] = min(s["ts"], a)
            s["dur"] = end - s["ts"]
    gpu_steps = sorted(spans.values(), key=lambda e: e["ts"])
    prefill = [e for e in gpu_steps if int(STEP_RE.fullmatch(e["name"]).group(2)) > 0]
    host_prefill = [e for e in host_steps if int(STEP_RE.fullmatch(e["name"]).group(2)) > 0]
    between = [float(b["ts"]) - (float(a["ts"]) + float(a.get("dur", 0))) for a, b in zip(gpu_steps, gpu_steps[1:])]
    runtime: dict[str, list] = {}
    by_tid: dict[str, list] = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            _tally(runtime, re.sub(r"_v\d+$", "", str(e.get("name", ""))), e)
            _tally(by_tid, str(e.get("tid")), e)
    return {
        "steps": len(gpu_steps),
        "prefill_steps": len(prefill),
        "prefill_tokens": sum(int(STEP_RE.fullmatch(e["name"]).group(2)) for e in prefill),
        "step_gpu_us_median": _median([float(e.get("dur", 0)) for e in gpu_steps]),
        "prefill_step_gpu_us_median": _median([float(e.get("dur", 0)) for e in prefill]),
        # from one step's last kernel to the next step's first: the GPU waiting for the host between steps
        "between_steps_us_median": _median(between),
        "between_steps_us_total": round(sum(between), 1),
        "host_steps": len(host_steps),
        "host_prefill_steps": len(host_prefill),
        "host_step_us_median": _median([float(e.get("dur", 0)) for e in host_steps]),
        "host_prefill_step_us_median": _median([float(e.get("dur", 0)) for e in host_prefill]),
        "runtime_calls": {k: [runtime[k][0], round(runtime[k][1], 1)] for k in SYNC_CALLS if k in runtime},
        "top_runtime_us": sorted(((round(v[1], 1), v[0], k) for k, v in runtime.items()), reverse=True)[:10],
        "runtime_by_tid": sorted(([round(v[1], 1), v[0], k] for k, v in by_tid.items()), reverse=True)[:6],
    }


def gap_records(ev: list[dict], kern: list[dict], busy: list, calls_before: int = 1) -> list[dict]:
    """Each idle stretch > GAP_US between the kernels' busy intervals ``busy`` (``_merge`` of ``kern``'s spans), in
    time order: where it starts and how long it is (µs), the kernel before it and the one the GPU waited to start
    after it, whether it lies inside one step's GPU span (the host fell behind mid-step) or between steps, and, when
    the trace has that kernel's launch call: its launch lag (the call's end to the kernel's start; < LATE_US: the GPU
    waited for the host, not for a dependency), the launching thread and its ``calls_before`` calls before the launch
    ((name, µs before the launch, duration); the last one's gap: how long the thread made no CUDA call before it)."""
    first_at: dict[float, dict] = {}
    for e in sorted(kern, key=lambda e: float(e["ts"]), reverse=True):
        first_at[float(e["ts"])] = e
    last_to_end: dict[float, dict] = {}
    for e in sorted(kern, key=lambda e: _span(e)[1]):
        last_to_end[_span(e)[1]] = e
    step_spans = sorted(_span(e) for e in ev if e.get("cat") == "gpu_user_annotation"
                        and STEP_RE.fullmatch(str(e.get("name", ""))))
    calls = sorted((e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: float(e["ts"]))
    launch = {_corr(e): e for e in calls if _corr(e) is not None}
    by_tid: dict = {}
    at_in_thread: dict[int, int] = {}
    for e in calls:
        mine = by_tid.setdefault(e.get("tid"), [])
        at_in_thread[id(e)] = len(mine)
        mine.append(e)
    out = []
    for (_a0, a1), (b0, _b1) in zip(busy, busy[1:]):
        if b0 - a1 <= GAP_US:
            continue
        k = first_at.get(b0, {})
        rec = {"at_us": round(a1 - busy[0][0], 1), "gap_us": round(b0 - a1, 1),
               "before": str(last_to_end.get(a1, {}).get("name", "?"))[:60], "after": str(k.get("name", "?"))[:60],
               "in_step": any(s0 <= a1 and b0 <= s1 for s0, s1 in step_spans)}
        call = launch.get(_corr(k))
        if call is not None:
            i = at_in_thread[id(call)]
            rec.update(launch_lag_us=round(b0 - _span(call)[1], 1), thread=call.get("tid"), calls_before=[
                (str(c.get("name"))[:28], round(float(call["ts"]) - _span(c)[1], 1), round(float(c.get("dur", 0)), 1))
                for c in by_tid[call.get("tid")][max(0, i - calls_before):i]])
            rec["late"] = rec["launch_lag_us"] < LATE_US
        out.append(rec)
    return out


def _gap_causes(records: list[dict]) -> dict:
    """``gap_records`` summed: the kernels the GPU waited to start (``gaps_before``: [µs, n, name]), the gaps inside
    steps, the gaps whose next kernel was launched late and the launching threads' median silence before those."""
    after: dict[str, list] = {}
    for r in records:
        _tally(after, r["after"], {"dur": r["gap_us"]})
    inside = [r["gap_us"] for r in records if r["in_step"]]
    late = [r for r in records if r.get("late")]
    return {
        "gaps_inside_steps": [len(inside), round(sum(inside), 1)],  # long gaps within one step's GPU span: n, µs
        "gaps_before": sorted(([round(v[1], 1), v[0], k] for k, v in after.items()), reverse=True)[:8],
        "gaps_launched_late": [len(late), round(sum(r["gap_us"] for r in late), 1)],  # launched < LATE_US before
        "host_silence_before_late_us_median": _median([r["calls_before"][-1][1] for r in late if r["calls_before"]]),
    }


def timeline(ev: list[dict]) -> dict:
    """GPU busy vs idle over the kernels' window, copies and sets, steps, and the host's runtime calls
    (``ev``: the trace's complete events; a trace without kernels, a CPU server's, has the steps alone)."""
    out = _steps_and_calls(ev)
    kern = [e for e in ev if e.get("cat") == "kernel"]
    if not kern:
        return out
    busy = _merge([_span(e) for e in kern])
    starts = [a for a, _b in busy]
    t0, t1 = busy[0][0], busy[-1][1]
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    long_gaps = [g for g in gaps if g > GAP_US]
    causes = _gap_causes(gap_records(ev, kern, busy))
    busy_us = sum(b - a for a, b in busy)
    streams: dict[str, list] = {}
    for e in kern:
        _tally(streams, str((e.get("args") or {}).get("stream")), e)
    copies: dict[str, dict] = {}
    for e in ev:
        if e.get("cat") in ("gpu_memcpy", "gpu_memset"):
            c = copies.setdefault(_direction(str(e.get("name", "")), e["cat"]),
                                  {"n": 0, "us": 0.0, "bytes": 0, "under_kernels_us": 0.0, "streams": set()})
            a, b = _span(e)
            c["n"] += 1
            c["us"] += b - a
            c["bytes"] += int((e.get("args") or {}).get("bytes") or 0)
            c["under_kernels_us"] += _covered(a, b, busy, starts)
            c["streams"].add(str((e.get("args") or {}).get("stream")))
    for c in copies.values():
        c.update(us=round(c["us"], 1), under_kernels_us=round(c["under_kernels_us"], 1), streams=sorted(c["streams"]))
    n_pre = out["prefill_steps"]
    return {
        "window_us": round(t1 - t0, 1),
        "busy_us": round(busy_us, 1),
        "idle_us": round(t1 - t0 - busy_us, 1),
        "idle_pct": round(100 * (t1 - t0 - busy_us) / (t1 - t0), 2) if t1 > t0 else 0.0,
        "gaps_over_50us": len(long_gaps),
        "gaps_over_50us_us": round(sum(long_gaps), 1),
        "gap_max_us": round(max(gaps, default=0.0), 1),
        **causes,
        "busy_us_per_prefill_step": round(busy_us / n_pre, 1) if n_pre else None,
        "idle_us_per_prefill_step": round((t1 - t0 - busy_us) / n_pre, 1) if n_pre else None,
        "kernel_streams": {k: [v[0], round(v[1], 1)] for k, v in sorted(streams.items(), key=lambda kv: -kv[1][1])},
        "copies": copies,
        **out,
    }


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
    # all-reduce kernels in one forward, by name (per launch of the biggest count): which all-reduce ran, fused or not
    comm = Counter(k["name"][:80] for ks in modal for k in ks if is_comm_kernel(k.get("name", "")))
    eager_names = Counter(e.get("name", "")[:80] for e in eager)
    top: dict[str, float] = {}
    for e in kern:
        top[e["name"][:80]] = top.get(e["name"][:80], 0.0) + float(e.get("dur", 0))
    host: dict[str, list] = {}
    for e in ev:
        if e.get("cat") in ("user_annotation", "python_function", "cpu_op"):
            _tally(host, f"{e.get('cat')}:{e.get('name', '')[:70]}", e)
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
        "step_comm_kernels": {k: round(v / len(modal), 2) for k, v in comm.most_common(6)} if modal else {},
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
        "timeline": timeline(ev),
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
