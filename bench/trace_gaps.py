#!/usr/bin/env python3
"""The longest GPU idle gaps of one torch.profiler trace, one line each, with what the host was doing (issue 37's
prefill gap; the graph phase's prefill rows bring their traces back as ``trace_<label>.json.gz``).

Per gap: where it starts (µs from the first kernel), its length, the kernel before and after it, whether it lies
inside one step's GPU span, the launch lag of the kernel after it (its launch call's end to its start: < 20 µs means
the GPU waited for the host to launch it) and the launching thread's calls just before that launch (what the host
did instead: a sync, an H2D copy, or nothing for a while: Python or the GIL).

``--steps``: each step boundary instead, from the runner's thread: how long its wait for the step's output
(``cudaEventSynchronize`` over 0.5 ms) outlasted the step's last kernel (the output's D2H copy queued behind another
D2H: s38's capture copy), the time from that wait's end to the next step's ``execute_context`` (the host's work
between steps), and the large D2H copies (over 200 µs) running in the 20 ms before the wait ended.

``--d2h``: each large device-to-host copy (over 1 MB: a capture step's rows) instead, with the GPU's idle time from
its start to the next kernel (near 0 when the host had the next step queued behind it; the whole host time between
steps when it had not: s39's files arm, a closed loop's drain) and the kernels just before and after it.

    python3 bench/trace_gaps.py TRACE.json[.gz] [--top 20] [--calls 4] [--steps | --d2h]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.gpu_e2e.trace_kernels import _merge, _span, gap_records  # noqa: E402


def gaps(events: list, top: int, calls_before: int) -> list[dict]:
    """The ``top`` longest gaps of ``gap_records``, longest first."""
    ev = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    kern = [e for e in ev if e.get("cat") == "kernel"]
    if not kern:
        return []
    records = gap_records(ev, kern, _merge([_span(e) for e in kern]), calls_before)
    return sorted(records, key=lambda r: -r["gap_us"])[:top]


def step_bounds(events: list) -> list[dict]:
    """Per step boundary (see ``--steps``): ``waited_past_gpu_us``, ``host_between_us``, ``d2h_copies_us``, ``next``."""
    ev = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    kern_ends = sorted(e["ts"] + e["dur"] for e in ev if e.get("cat") == "kernel")
    steps = sorted((e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("execute_context")),
                   key=lambda e: e["ts"])
    if not steps or not kern_ends:
        return []
    runner = steps[0]["tid"]
    waits = sorted((e for e in ev if e.get("tid") == runner and e["name"] == "cudaEventSynchronize" and e["dur"] > 500),
                   key=lambda e: e["ts"])
    d2h = [e for e in ev if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"] and e["dur"] > 200]
    out = []
    for w in waits:
        end = w["ts"] + w["dur"]
        nxt = next((s for s in steps if s["ts"] > end), None)
        last = [t for t in kern_ends if t <= end]
        if nxt is None or not last:
            continue
        out.append({"waited_past_gpu_us": round(end - last[-1], 1), "host_between_us": round(nxt["ts"] - end, 1),
                    "d2h_copies_us": round(sum(c["dur"] for c in d2h if c["ts"] < end and c["ts"] + c["dur"] > end - 20000), 1),
                    "next": nxt["name"]})
    return out


def d2h_copies(events: list, min_bytes: int = 1 << 20) -> list[dict]:
    """Per large D2H copy (see ``--d2h``): ``mb``, ``copy_us``, ``idle_after_us`` (its start to the next kernel's;
    None: none), ``before`` / ``after`` (kernel names)."""
    ev = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    kern = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    out = []
    for c in sorted((e for e in ev if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]
                     and (e.get("args") or {}).get("bytes", 0) >= min_bytes), key=lambda e: e["ts"]):
        before = [k for k in kern if k["ts"] + k["dur"] <= c["ts"] + 5]
        after = next((k for k in kern if k["ts"] >= c["ts"]), None)
        out.append({"mb": round(c["args"]["bytes"] / 1e6, 1), "copy_us": round(c["dur"], 1),
                    "idle_after_us": round(after["ts"] - c["ts"], 1) if after else None,
                    "before": before[-1]["name"] if before else None, "after": after["name"] if after else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--calls", type=int, default=4, help="the launching thread's calls listed before each launch")
    ap.add_argument("--steps", action="store_true", help="each step boundary instead of the longest gaps")
    ap.add_argument("--d2h", action="store_true",
                    help="each large D2H copy instead: the GPU's idle after its start")
    args = ap.parse_args()
    opener = gzip.open if args.trace.suffix == ".gz" else open
    with opener(args.trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    if args.d2h:
        for r in d2h_copies(events):
            print(f"D2H {r['mb']:>8} MB {r['copy_us']:>8} µs  GPU idle after its start {r['idle_after_us']} µs  "
                  f"{str(r['before'])[:40]} -> {str(r['after'])[:40]}")
        return
    if args.steps:
        rows = step_bounds(events)
        for r in rows:
            print(f"waited past the GPU {r['waited_past_gpu_us']:>8} µs  host between steps {r['host_between_us']:>8} µs"
                  f"  D2H copies {r['d2h_copies_us']:>8} µs  next {r['next']}")
        if rows:
            med = sorted(r["waited_past_gpu_us"] for r in rows)[len(rows) // 2]
            hb = sorted(r["host_between_us"] for r in rows)[len(rows) // 2]
            print(f"median: waited past the GPU {med} µs, host between steps {hb} µs ({len(rows)} boundaries)")
        return
    for r in gaps(events, args.top, args.calls):
        host = ""
        if "launch_lag_us" in r:
            host = (f" lag {r['launch_lag_us']} µs{' LATE' if r['late'] else ''}, thread {r['thread']} before: "
                    + "; ".join(f"{n} ({ago} µs ago, {d} µs)" for n, ago, d in r["calls_before"]))
        print(f"{r['at_us']:>12} µs  gap {r['gap_us']:>8} µs  {'in step ' if r['in_step'] else 'between '} "
              f"{r['before']} -> {r['after']}{host}")


if __name__ == "__main__":
    main()
