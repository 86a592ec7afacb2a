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
