#!/usr/bin/env python3
"""The worker's per-request capture cost for capture_gen_n16's requests at the 8b shape (issue 37), no engine: 16
requests each capturing post_mlp of 3 layers at generated positions with the real ``activations`` consumer (reduce
``last``, in its own process), 96 sites, pool 4096 rows. Times, per wave of 16 (host, on CPU tensors unless CUDA):
``add_request`` of the 16 (spec parse, plan compile, reduce slots), their prefill step (256 tokens each: nothing
planned), the first decode step (a new batch: the full plan path), a steady decode step (last step's cells again),
and the end: ``finish_requests`` of the 16 in the step thread (as a runner calls it), then the wait until every driver result is pushed
(notifier thread -> consumers' process -> reader thread -> ``_send``: what the response's last chunk waits for
once the runner hears of the end), first and last of the 16, with when the notifier sent each finish notice and
when the reader thread had each answer. ``--baseline DIR``: also an older runtime (a ``src/vllm_steer/runtime`` folder,
e.g. from ``git archive``; loaded as ``prefill_host_cost`` does), its waves interleaved with this tree's, each
timed in the step thread's CPU time as well as wall time (``--cpu``: CPU time only, for a box shared with others).
    PYTHONPATH=src:. python3 bench/capture_request_cost.py [--waves 20 --baseline DIR --cpu --out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

from vllm_steer.capture.activations import ActivationStats
from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod

LAYERS, HOOKS, WIDTH, MAX_ROWS, HIDDEN, N, PROMPT = 32, ("pre_attn", "post_attn", "post_mlp"), 8192, 4096, 4096, 16, 256


def _runtime(mod, cfg, sites, device, key: str):
    """A runtime of ``mod`` with its result sends and the notifier's / reader's times traced into ``key``'s maps."""
    rt = mod.CaptureRuntime(cfg, sites, LAYERS, WIDTH, HIDDEN, torch.bfloat16, device)
    tr = {"sent": {}, "notices": {}, "answers": {}, "done": threading.Event()}

    def on_send(k, reply, requests, results) -> None:
        tr["sent"][k] = time.perf_counter()
        if len(tr["sent"]) == N:
            tr["done"].set()

    rt._send = on_send
    cmd_send, finished_by = rt._host._cmd.send, rt._finished_by

    def traced_send(msg):
        cmd_send(msg)
        if msg[0] == "finish":
            tr["notices"][msg[2]] = time.perf_counter()

    def traced_finished_by(k, *a):
        tr["answers"][k] = time.perf_counter()
        finished_by(k, *a)

    rt._host._cmd.send, rt._finished_by = traced_send, traced_finished_by
    return rt, tr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=20)
    ap.add_argument("--baseline", help="an older src/vllm_steer/runtime folder, run interleaved with this tree's")
    ap.add_argument("--cpu", action="store_true", help="time the step thread's CPU time, not wall time")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    versions = {"new": capture_mod}
    if args.baseline:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from prefill_host_cost import _load_baseline

        versions = {"base": _load_baseline(args.baseline), **versions}
    for mod in versions.values():
        mod.consumer_class = lambda name: ActivationStats
    cfg = SteerConfig.model_validate({"capture": ["activations"], "capture_max_rows": MAX_ROWS})
    sites = [(h, l) for h in HOOKS for l in range(LAYERS)]
    rts = {v: _runtime(mod, cfg, sites, device, v) for v, mod in versions.items()}
    spec = {"activations": {"layers": [LAYERS // 4, LAYERS // 2, 3 * LAYERS // 4], "hooks": ["post_mlp"],
                            "positions": "all_generated", "reduce": "last"}}
    clock = time.thread_time if args.cpu else time.perf_counter
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in versions}

    for wave in range(args.waves + 2):
        for v, (rt, tr) in (rts.items() if wave % 2 else list(rts.items())[::-1]):  # alternate who goes first
            out = rows[v]

            def timed(name: str, fn) -> None:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = clock()
                fn()
                out.setdefault(name, []).append((clock() - t0) * 1e3)

            ids = [f"{v}w{wave}r{i}" for i in range(N)]
            for m in ("sent", "notices", "answers"):
                tr[m].clear()
            tr["done"].clear()
            timed("add_request x16", lambda: [rt.add_request(r, spec, PROMPT, {"external_id": r, "capture_reply": "x"})
                                               for r in ids])

            def step(n, first):
                rt.plan_step(ids, np.full(N, n, np.int32), np.full(N, first, np.int32))
                rt.after_forward()

            timed("prefill step (nothing planned)", lambda: step(PROMPT, 0))
            timed("first decode step (new batch)", lambda: step(1, PROMPT))
            for k in range(1, 4):
                timed("steady decode step", lambda k=k: step(1, PROMPT + k))
            t0 = time.perf_counter()
            end = getattr(rt, "finish_requests", None)  # the runners' call (one per step); older trees: one per request
            timed("finish x16 (step thread)", (lambda: end(ids)) if end else (lambda: [rt.finish_request(r) for r in ids]))
            assert tr["done"].wait(30), f"{len(tr['sent'])} of {N} results pushed"
            for what, times in (("finish notice sent", tr["notices"]), ("answer read back", tr["answers"])):
                out.setdefault(f"end -> first {what}", []).append((min(times[r] for r in ids) - t0) * 1e3)
                out.setdefault(f"end -> last {what}", []).append((max(times[r] for r in ids) - t0) * 1e3)
            out.setdefault("end -> first result pushed", []).append((min(tr["sent"].values()) - t0) * 1e3)
            out.setdefault("end -> last result pushed", []).append((max(tr["sent"].values()) - t0) * 1e3)
    for rt, _ in rts.values():
        rt.close()
    res = {v: {k: {"median_ms": round(statistics.median(x[2:]), 3), "p90_ms": round(float(np.percentile(x[2:], 90)), 3)}
               for k, x in r.items()} for v, r in rows.items()}  # the first two waves warm up
    print(f"ms ({'step thread CPU' if args.cpu else 'wall'} for the step-thread rows; {args.waves} waves, {device})")
    for k in res["new"]:
        print(f"  {k:36s}" + "".join(f"  {v} {res[v][k]['median_ms']:8.3f} (p90 {res[v][k]['p90_ms']:.3f})"
                                     for v in versions))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(device), "waves": args.waves, "cpu": args.cpu,
                       "rows": res if args.baseline else res["new"]}, fh, indent=1)


if __name__ == "__main__":
    main()
