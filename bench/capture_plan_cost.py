#!/usr/bin/env python3
"""Host cost of capture's per-step plan (``CaptureRuntime.plan_step``) at the 8b shape, no engine:
32 layers x 3 hooks = 96 sites, plan width 8192 tokens, pool 4096 rows; on CUDA if there is one.
Cases: 16 decode requests each capturing post_mlp of 3 layers at all generated positions (a stable
batch, whose plan is the same every step; and each request its own 3 layers with the batch order
rotated every step, so the plan changes every step); 16 decode requests capturing post_mlp of all 32
layers; a prefill step of 4 x 512 prompt tokens capturing 4 layers all_prompt (fresh requests each
step, their layers alternating so the plan changes; adding them is timed apart). Reports the median / p90
host time per step, the H2D plan bytes per step, (CUDA) the time with the device work synced, and the
device ops one step issues (CUDA kernels and copies from the profiler; on CPU the copy ops).
Hand-off cases (``plan_step`` + ``after_forward``, the whole per-step host cost, with the real
``activations`` consumer in its own process): capture_gen_n16's shape (16 decode requests x post_mlp of
3 layers, ``reduce`` last / mean) reduced on the device (``runtime.capture_reduce``) against the same
with ``capture_reduce_rows`` 0 (every row copied to the consumers' process each step).
``--baseline FILE`` also runs an older ``runtime/capture.py`` (e.g. ``git show HEAD~1:src/...``) in the
same process, for a before/after on one machine.
    python3 bench/capture_plan_cost.py [--steps 300 --baseline /tmp/capture_head.py --out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import numpy as np
import torch

from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod

LAYERS, HOOKS, WIDTH, MAX_ROWS, HIDDEN = 32, ("pre_attn", "post_attn", "post_mlp"), 8192, 4096, 4096


class Sink:
    location = "worker"

    def __init__(self, instance: str, **params) -> None:
        pass

    def on_rows(self, *a) -> None:
        pass

    def on_request_finished(self, *a):
        return None


if __name__ == "__main__":  # the consumers' process imports Sink by module path: this file, from its folder
    Sink.__module__ = "capture_plan_cost"


def _load(path: str):
    spec = importlib.util.spec_from_file_location("capture_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["capture_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def _runtime(mod, device):
    mod.consumer_class = lambda name: Sink
    cfg = SteerConfig.model_validate({"capture": ["activations"], "capture_max_rows": MAX_ROWS})
    sites = [(h, l) for h in HOOKS for l in range(LAYERS)]
    return mod.CaptureRuntime(cfg, sites, LAYERS, WIDTH, HIDDEN, torch.bfloat16, device)


def _case(mod, device, name: str, steps: int, sync: bool) -> dict:
    rt = _runtime(mod, device)
    dense = rt.buffers.plan.numel() * 4
    times, adds, h2d = [], [], 0
    old_dirty = False
    if name.startswith("decode"):
        ids = [f"r{i}" for i in range(16)]
        for i, rid in enumerate(ids):
            layers = [8, 16, 24] if "3 layers" in name else list(range(LAYERS))
            if "rotated" in name:  # each request its own 3 layers: the plan changes as the order does
                layers = [i, i + 8, i + 16]
            spec = {"layers": layers, "hooks": ["post_mlp"], "positions": "all_generated"}
            rt.add_request(rid, {"activations": spec}, prompt_len=256)
    for step in range(steps + 20):
        if name.startswith("decode"):
            order = ids[step % 16:] + ids[: step % 16] if "rotated" in name else ids
            args = (order, np.ones(16, dtype=np.int32), np.full(16, 256 + step, dtype=np.int32))
        else:
            t0 = time.perf_counter()
            ids = [f"p{step}.{i}" for i in range(4)]
            for rid in ids:
                layers = [4, 12, 20, 28] if step % 2 else [5, 13, 21, 29]  # the plan changes every step
                rt.add_request(rid, {"activations": {"layers": layers, "hooks": ["post_mlp"],
                                                     "positions": "all_prompt"}}, prompt_len=512)
            adds.append(time.perf_counter() - t0)
            args = (ids, np.full(4, 512, dtype=np.int32), np.zeros(4, dtype=np.int32))
        before = getattr(getattr(rt, "_planner", None), "upload_bytes", 0)
        if sync and device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.plan_step(*args)
        if sync and device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        cells = bool(rt._pending)
        if hasattr(rt, "_planner"):
            sent = rt._planner.upload_bytes - before
        else:
            sent = dense if (cells or old_dirty) else 0
            old_dirty = cells
        rt._pending = []
        if not name.startswith("decode"):
            for rid in ids:
                rt._requests.pop(rid)  # not finish_request: no lanes, no results to time
        if step >= 20:
            times.append(dt)
            h2d += sent
    ms = sorted(t * 1e3 for t in times)
    out = {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * len(ms))],
           "h2d_bytes_per_step": h2d / steps, "rows_per_step": rt._rows_used}
    if adds:
        out["add_4_requests_ms"] = statistics.median(adds) * 1e3
    return out


def _handoff_case(device, steps: int, reduce_rows: int, mode: str) -> dict:
    """Per-step host time of plan_step + after_forward at capture_gen_n16's shape (the forward is not run:
    the pool holds whatever it holds), and the D2H bytes per step."""
    from vllm_steer.capture.activations import ActivationStats

    capture_mod.consumer_class = lambda name: ActivationStats
    cfg = SteerConfig.model_validate({"capture": ["activations"], "capture_max_rows": MAX_ROWS,
                                      "capture_reduce_rows": reduce_rows})
    sites = [(h, l) for h in HOOKS for l in range(LAYERS)]
    rt = capture_mod.CaptureRuntime(cfg, sites, LAYERS, WIDTH, HIDDEN, torch.bfloat16, device)
    try:
        ids = [f"r{i}" for i in range(16)]
        spec = {"layers": [8, 16, 24], "hooks": ["post_mlp"], "positions": "all_generated", "reduce": mode}
        for rid in ids:
            rt.add_request(rid, {"activations": spec}, prompt_len=256)
        times = []
        for step in range(steps + 20):
            if device.type == "cuda":
                rt.before_forward(0, rt.buffers.max_rows)  # the last copy done outside the timing
            t0 = time.perf_counter()
            rt.plan_step(ids, np.ones(16, dtype=np.int32), np.full(16, 256 + step, dtype=np.int32))
            rt.after_forward()
            if step >= 20:
                times.append(time.perf_counter() - t0)
            if step % 8 == 7:  # the consumers' process keeps up (its queue never fills here)
                time.sleep(0.01)
        rows = rt.stats["rows"]
        for rid in ids:
            rt.finish_request(rid)
        ms = sorted(t * 1e3 for t in times)
        return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * len(ms))],
                "d2h_bytes_per_step": rows * HIDDEN * 2 / (steps + 20), "reduced_requests": rt.stats["reduced_requests"]}
    finally:
        rt.close()


def _device_ops(mod, device) -> dict:
    """Kernels and copies one plan_step puts on the GPU (torch.profiler): a step whose plan changed,
    a step whose plan is the same as the last one's, and an idle step (nothing captured)."""
    from torch.profiler import ProfilerActivity, profile

    rt = _runtime(mod, device)
    spec = {"layers": [8, 16, 24], "hooks": ["post_mlp"], "positions": "all_generated"}
    for i in range(16):
        rt.add_request(f"r{i}", {"activations": spec}, prompt_len=256)
    ids = [f"r{i}" for i in range(16)]

    cuda = device.type == "cuda"

    def ops(req_ids, step) -> list[str]:
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            rt.plan_step(req_ids, np.ones(len(req_ids), dtype=np.int32), np.full(len(req_ids), step, dtype=np.int32))
            if cuda:
                torch.cuda.synchronize()
        rt._pending = []
        if cuda:
            return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        # CPU: the ops that move data (views, slices and empties launch nothing on a GPU)
        return [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::index_copy_", "aten::fill_")]

    out = {"changed": ops(ids, 256), "same": ops(ids, 257), "changed (8 requests)": ops(ids[:8], 258)}
    for rid in ids:
        rt._requests.pop(rid)
    out["clearing"] = ops([], 0)
    out["idle (plan_step is not called once inactive)"] = "inactive" if not rt.active else ops([], 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--baseline", help="an older runtime/capture.py to time beside this one")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mods = {"this tree": capture_mod}
    if args.baseline:
        mods = {"baseline": _load(args.baseline), **mods}
    cases = ["decode 16 x post_mlp 3 layers", "decode 16 x post_mlp 3 layers each, batch rotated",
             "decode 16 x post_mlp 32 layers", "prefill 4 x 512 all_prompt 4 layers"]
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "cases": {}}
    for case in cases:
        for label, mod in mods.items():
            for sync in ([False, True] if device.type == "cuda" else [False]):
                r = _case(mod, device, case, args.steps, sync)
                key = f"{case} | {label}" + (" | synced" if sync else "")
                results["cases"][key] = r
                print(f"{key:70s} median {r['median_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms  "
                      f"H2D {r['h2d_bytes_per_step']:.0f} B/step  rows {r['rows_per_step']}"
                      + (f"  add {r['add_4_requests_ms']:.3f} ms" if "add_4_requests_ms" in r else ""), flush=True)
    for mode in ("last", "mean"):
        for label, rows in (("rows to the consumers' process each step", 0), ("reduced on the device", 2048)):
            r = _handoff_case(device, args.steps, rows, mode)
            key = f"hand-off: decode 16 x post_mlp 3 layers, activations reduce {mode} | {label}"
            results["cases"][key] = r
            print(f"{key:100s} median {r['median_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms  "
                  f"D2H {r['d2h_bytes_per_step']:.0f} B/step", flush=True)
    results["device_ops_per_step"] = {label: _device_ops(mod, device) for label, mod in mods.items()}
    for label, per in results["device_ops_per_step"].items():
        print(f"device ops per plan_step ({label}):", json.dumps(per))
    if device.type == "cuda":  # what the old path paid per changed step for pinning the dense table alone
        host = np.full((len(HOOKS) * LAYERS, WIDTH), -1, dtype=np.int32)
        pins = []
        for _ in range(50):
            t0 = time.perf_counter()
            torch.from_numpy(host).pin_memory()
            pins.append(time.perf_counter() - t0)
        results["pin_dense_table_ms"] = statistics.median(pins) * 1e3
        print(f"pin_memory() of the dense {host.nbytes} B table: median {results['pin_dense_table_ms']:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
