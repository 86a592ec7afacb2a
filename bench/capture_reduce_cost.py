#!/usr/bin/env python3
"""The device cost of a prefill step's capture reduction (issue 37: prefill_capture_mem ran at 94.2% of stock).

``ReduceRegion.apply`` adds a step's captured rows into per-request float32 sums: a 8192-token prefill step
capturing 4 sites for 32 requests sends 32768 rows into 128 slots, ~256 rows onto each slot row. Since s30 it is one
segmented-sum launch (``kernels/capture_reduce``); timed here beside the path it replaced (``index_select`` +
``.float()`` + ``index_add_``: 1523 µs on an H200), the same sums as a contiguous ``view(...).sum(1)``, and the
bandwidth bound of reading the rows once, with CUDA events, at the prefill arm's shape.

    python3 bench/capture_reduce_cost.py [--rows 32768] [--slots 128] [--hidden 4096] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from vllm_steer.runtime.capture_reduce import ReduceRegion  # noqa: E402


def _time(fn, device: torch.device, reps: int) -> float:
    """Median µs of ``fn`` (CUDA events on a GPU, perf_counter on the CPU)."""
    import time

    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768, help="captured rows in the step (tokens x sites)")
    ap.add_argument("--slots", type=int, default=128, help="mean slots they go to (requests x sites)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, s, d = args.rows, args.slots, args.hidden
    pool = torch.randn(n + s, d, device=device).to(torch.bfloat16)
    region = ReduceRegion(s, n, pool, n)
    slots = region.alloc(s)
    src = np.arange(n, dtype=np.int64)
    dst = np.repeat(slots, n // s)[:n]
    empty = np.zeros(0, np.int64)

    def apply() -> None:
        region.apply(src, dst, empty, empty)

    def contiguous() -> None:  # the same sums when each slot's rows are one contiguous run
        region.acc[:s] += pool[:n].view(s, n // s, d).float().sum(1)

    src_d, dst_d = torch.as_tensor(src, device=device), torch.as_tensor(dst, device=device)

    def index_add() -> None:  # the path apply took until s30
        region.acc.index_add_(0, dst_d, pool.index_select(0, src_d).float())

    reps = args.reps if device.type == "cuda" else 2
    t_apply, t_seg, t_old = (_time(f, device, reps) for f in (apply, contiguous, index_add))
    ref = pool[:n].view(s, n // s, d).float().sum(1)
    region.acc.zero_()
    apply()
    err = (region.acc[torch.as_tensor(slots, device=device)] - ref).abs().max().item()
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": n, "slots": s,
           "hidden": d, "apply_us": t_apply, "index_add_us": t_old, "contiguous_sum_us": t_seg, "max_abs_diff": err,
           "bytes_read": n * d * 2}
    print(f"{res['device']}: {n} rows -> {s} mean slots, D {d}: ReduceRegion.apply {t_apply:.1f} µs (index_select + "
          f"index_add_ {t_old:.1f}), contiguous segmented sum {t_seg:.1f} µs (max |diff| {err:.2e}); reading the rows "
          f"once: {n * d * 2 / 1e9:.2f} GB; a prefill step of the arm is ~190 ms on an H200")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
