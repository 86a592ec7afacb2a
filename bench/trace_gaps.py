#!/usr/bin/env python3
"""The longest GPU idle gaps of one torch.profiler trace, one line each, with what the host was doing (issue 37's
prefill gap; the graph phase's prefill rows bring their traces back as ``trace_<label>.json.gz``).

Per gap: where it starts (µs from the first kernel), its length, the kernel before and after it, whether it lies
inside one step's GPU span, the launch lag of the kernel after it (its launch call's end to its start: < 20 µs means
the GPU waited for the host to launch it) and the launching thread's calls just before that launch (what the host
did instead: a sync, an H2D copy, or nothing for a while: Python or the GIL).

    python3 bench/trace_gaps.py TRACE.json[.gz] [--top 20] [--calls 4]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.gpu_e2e.trace_kernels import GAP_US, LATE_US, STEP_RE, _corr, _merge, _span  # noqa: E402


def gaps(events: list, top: int, calls_before: int) -> list[dict]:
    """The ``top`` longest gaps > GAP_US between the union of kernel intervals, longest first."""
    ev = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    kern = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    if not kern:
        return []
    busy = _merge([_span(e) for e in kern])
    t0 = busy[0][0]
    starts = [float(e["ts"]) for e in kern]
    ends = sorted((_span(e)[1], i) for i, e in enumerate(kern))
    end_ts = [t for t, _ in ends]
    steps = [_span(e) for e in ev
             if e.get("cat") == "gpu_user_annotation" and STEP_RE.fullmatch(str(e.get("name", "")))]
    calls = sorted((e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: float(e["ts"]))
    launch = {_corr(e): e for e in calls if _corr(e) is not None}
    by_tid: dict = {}
    for e in calls:
        by_tid.setdefault(e.get("tid"), []).append(e)
    out = []
    for (_a0, a1), (b0, _b1) in zip(busy, busy[1:]):
        if b0 - a1 <= GAP_US:
            continue
        before = kern[ends[bisect.bisect_right(end_ts, a1) - 1][1]]
        after = kern[bisect.bisect_left(starts, b0)]
        rec = {"at_us": round(a1 - t0, 1), "gap_us": round(b0 - a1, 1), "before": str(before.get("name"))[:50],
               "after": str(after.get("name"))[:50], "in_step": any(s0 <= a1 and b0 <= s1 for s0, s1 in steps)}
        call = launch.get(_corr(after))
        if call is not None:
            rec["launch_lag_us"] = round(b0 - _span(call)[1], 1)
            rec["late"] = rec["launch_lag_us"] < LATE_US
            mine = by_tid.get(call.get("tid"), [])
            i = mine.index(call)
            rec["thread"] = call.get("tid")
            rec["calls_before"] = [(str(c.get("name"))[:28], round(float(call["ts"]) - _span(c)[1], 1),
                                    round(float(c.get("dur", 0)), 1)) for c in mine[max(0, i - calls_before):i]]
        out.append(rec)
    return sorted(out, key=lambda r: -r["gap_us"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--calls", type=int, default=4, help="the launching thread's calls listed before each launch")
    args = ap.parse_args()
    opener = gzip.open if args.trace.suffix == ".gz" else open
    with opener(args.trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    for r in gaps(events, args.top, args.calls):
        host = ""
        if "launch_lag_us" in r:
            host = (f" lag {r['launch_lag_us']} µs{' LATE' if r['late'] else ''}, thread {r['thread']} before: "
                    + "; ".join(f"{n} ({ago} µs ago, {d} µs)" for n, ago, d in r["calls_before"]))
        print(f"{r['at_us']:>12} µs  gap {r['gap_us']:>8} µs  {'in step ' if r['in_step'] else 'between '} "
              f"{r['before']} -> {r['after']}{host}")


if __name__ == "__main__":
    main()
