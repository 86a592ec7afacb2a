#!/usr/bin/env python3
"""The worker's per-request capture cost for capture_gen_n16's requests at the 8b shape (issue 37), no engine: 16
requests each capturing post_mlp of 3 layers at generated positions with the real ``activations`` consumer (reduce
``last``, in its own process), 96 sites, pool 4096 rows. Times, per wave of 16 (host, on CPU tensors unless CUDA):
``add_request`` of the 16 (spec parse, plan compile, reduce slots), their prefill step (256 tokens each: nothing
planned), the first decode step (a new batch: the full plan path), a steady decode step (last step's cells again),
and the end: ``finish_requests`` of the 16 in the step thread (as a runner calls it), then the wait until every driver result is pushed
(notifier thread -> consumers' process -> reader thread -> ``_send``: what the response's last chunk waits for
once the runner hears of the end), first and last of the 16, with when the notifier sent each finish notice and
when the reader thread had each answer.
    PYTHONPATH=src:. python3 bench/capture_request_cost.py [--waves 20 --out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

from vllm_steer.capture.activations import ActivationStats
from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod

LAYERS, HOOKS, WIDTH, MAX_ROWS, HIDDEN, N, PROMPT = 32, ("pre_attn", "post_attn", "post_mlp"), 8192, 4096, 4096, 16, 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    capture_mod.consumer_class = lambda name: ActivationStats
    cfg = SteerConfig.model_validate({"capture": ["activations"], "capture_max_rows": MAX_ROWS})
    sites = [(h, l) for h in HOOKS for l in range(LAYERS)]
    rt = capture_mod.CaptureRuntime(cfg, sites, LAYERS, WIDTH, HIDDEN, torch.bfloat16, device)
    sent: dict[str, float] = {}
    done = threading.Event()

    def on_send(key, reply, requests, results) -> None:
        sent[key] = time.perf_counter()
        if len(sent) == N:
            done.set()

    rt._send = on_send
    notices: dict[str, float] = {}  # key -> when the notifier sent its finish notice to the consumers' process
    answers: dict[str, float] = {}  # key -> when the reader thread had the consumer's answer
    cmd_send, finished_by = rt._host._cmd.send, rt._finished_by

    def traced_send(msg):
        cmd_send(msg)
        if msg[0] == "finish":
            notices[msg[2]] = time.perf_counter()

    def traced_finished_by(key, *a):
        answers[key] = time.perf_counter()
        finished_by(key, *a)

    rt._host._cmd.send, rt._finished_by = traced_send, traced_finished_by
    spec = {"activations": {"layers": [LAYERS // 4, LAYERS // 2, 3 * LAYERS // 4], "hooks": ["post_mlp"],
                            "positions": "all_generated", "reduce": "last"}}
    rows: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        rows.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    for wave in range(args.waves + 2):
        ids = [f"w{wave}r{i}" for i in range(N)]
        sent.clear()
        done.clear()
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
        assert done.wait(30), f"{len(sent)} of {N} results pushed"
        for what, times in (("finish notice sent", notices), ("answer read back", answers)):
            rows.setdefault(f"end -> first {what}", []).append((min(times[r] for r in ids) - t0) * 1e3)
            rows.setdefault(f"end -> last {what}", []).append((max(times[r] for r in ids) - t0) * 1e3)
        rows.setdefault("end -> first result pushed", []).append((min(sent.values()) - t0) * 1e3)
        rows.setdefault("end -> last result pushed", []).append((max(sent.values()) - t0) * 1e3)
    rt.close()
    out = {k: {"median_ms": round(statistics.median(v[2:]), 3), "p90_ms": round(float(np.percentile(v[2:], 90)), 3)}
           for k, v in rows.items()}  # the first two waves warm up
    for k, v in out.items():
        print(f"  {k:36s} {v['median_ms']:8.3f} ms (p90 {v['p90_ms']:.3f})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(device), "waves": args.waves, "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
