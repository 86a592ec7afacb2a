#!/usr/bin/env python3
"""The engine core's main thread during a capturing prefill step (issue 37's prefill gap), no engine.

The prefill arms' load as the GPU's runner sees it: each step 16 fresh requests of 512 prompt tokens (8192 tokens,
one step each: ``max_tokens`` 1), capturing post_mlp of 4 layers at every prompt position, through the real
``CaptureRuntime`` (the ``steer_capture_fs`` server's consumers: activations, filesystem with 4 writer threads, in
the consumers' own process; ``capture_max_rows`` 131072). Arms, interleaved step by step in one process:
``none`` (the same requests without capture: the step's capture calls return at once), ``files`` (the filesystem
consumer, no fsync) and ``mem`` (activations, reduce mean: reduced on the device, nothing copied per step).

A step on the main thread: ``add_request`` x16 (the runner's ``_update_states``), ``plan_step``, vLLM's own host
work for the step (a fixed pure-Python loop of ``--host-ms`` alone: what it costs under the arm shows the GIL
taken from it), ``after_forward`` (hand-off and, all_prompt ending with the prompt, the 16 ends), then the GPU time
(``--gpu-ms`` of sleep, GIL released: the main thread waiting on the step's output). Per arm and phase: the median
wall and thread CPU time of the main thread (wall - CPU: waiting, for the GIL or a core); per step, the CPU time of
the worker's other threads (notifier, reader) and of the consumers' process, from ``/proc``. On the CPU the ring
copy would run on the main thread (on a GPU it is a D2H on the copy stream): ``--cpu-copy`` keeps it, the default
leaves it out so the numbers are the host work a GPU step has. ``--hidden`` sizes rows (the main thread's work does
not depend on it without the copy; the consumers' process writes the rows). The CPU runs the device ops (the
plan's upload, the mean reduce) inline: their time is in the phases (``OMP_NUM_THREADS=1`` on the shared box, where
two OMP threads made each op ~100x slower); ``--launch-us 6`` counts each torch op of the main thread as 6 us
(a GPU launch) instead and leaves the segmented add out: the host work a GPU step has. ``--baseline DIR``: also an
older ``runtime/capture.py`` + ``capture_plan.py`` + ``capture_reduce.py`` (a ``src/vllm_steer/runtime`` folder,
e.g. from ``git archive``), each step of each arm run on both, interleaved, in this process. ``--device cuda`` (a
GPU host): the runtime on the GPU, the ring copy on its copy stream as in the engine, the GPU time a
``torch.cuda._sleep`` the main thread waits for.

    PYTHONPATH=src:. python bench/prefill_host_cost.py [--steps 40 --hidden 256 --baseline DIR --out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod
from vllm_steer.runtime import capture_lanes

LAYERS, HOOKS, WIDTH, N, PROMPT, MAX_ROWS = 32, ("pre_attn", "post_attn", "post_mlp"), 8192, 16, 512, 131072
CAP_LAYERS = [LAYERS * (k + 1) // 4 - 1 for k in range(4)]
TICK = os.sysconf("SC_CLK_TCK")


def _python_work(n: int) -> int:
    """vLLM's host work stand-in: pure Python (holds the GIL, as scheduling and input prep mostly do)."""
    acc = 0
    for i in range(n):
        acc = (acc + i * 7) % 1000003
    return acc


_OPS_S = [0.0]  # CPU seconds the main thread spent running torch ops, less their launch cost (--launch-us)


def _thread_time() -> float:
    return time.thread_time() - _OPS_S[0]


def _count_launches(launch_us: float) -> None:
    """On the CPU the device ops (the plan's upload, the reduce) run inline on the main thread: count each torch
    op the main thread calls as ``launch_us`` (a GPU launch's host cost) instead of its CPU time, and leave the
    segmented add out, so the main thread's numbers are the host work a GPU step has."""
    main = threading.get_ident()

    def wrap(f):
        def op(*a, **k):
            if threading.get_ident() != main:
                return f(*a, **k)
            t0 = time.thread_time()
            out = f(*a, **k)
            _OPS_S[0] += time.thread_time() - t0 - launch_us * 1e-6
            return out
        return op

    from vllm_steer.kernels import capture_reduce as kernel
    from vllm_steer.runtime import capture_reduce

    kernel.segment_add = capture_reduce.segment_add = wrap(lambda *a, **k: None)
    for name in ("index_fill_", "index_copy_", "index_select", "copy_", "to", "float", "__add__", "fill_",
                 "index_add_"):
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
    for name in ("repeat_interleave", "add", "where"):
        setattr(torch, name, wrap(getattr(torch, name)))


def _calibrate(ms: float) -> int:
    n = 100_000
    t0 = time.thread_time()
    _python_work(n)
    return max(1, int(n * ms / 1e3 / max(time.thread_time() - t0, 1e-6)))


def _thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                raw = fh.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(f[11]) + int(f[12])) / TICK)
    return out


def _cpu_of(pid: int) -> float:
    return sum(v for _, v in _thread_cpu(pid).values())


def _load_baseline(folder: str):
    """An older ``runtime/capture.py`` built on its own ``capture_plan.py`` and ``capture_reduce.py``: the
    CaptureRuntime class."""
    names = ("capture_plan", "capture_reduce", "capture")
    saved = {n: sys.modules.get(f"vllm_steer.runtime.{n}") for n in names}
    mods = {}
    try:
        for name in names:
            spec = importlib.util.spec_from_file_location(f"baseline_{name}", os.path.join(folder, f"{name}.py"))
            mod = mods[name] = importlib.util.module_from_spec(spec)
            sys.modules[f"baseline_{name}"] = mod
            sys.modules[f"vllm_steer.runtime.{name}"] = mod  # what the next ones import
            spec.loader.exec_module(mod)
    finally:
        for name, mod in saved.items():
            sys.modules[f"vllm_steer.runtime.{name}"] = mod
    step = mods["capture_plan"].StepPlan
    if "run_len" not in step.__dataclass_fields__:  # before s31 the wire sent cells, the consumers' process now runs
        cells = step.wire
        step.wire = lambda self: (*cells(self)[:4], np.ones(len(self.positions), np.int64), *cells(self)[4:])
    return mods["capture"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40, help="steps per arm (after 3 warm-up rounds)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--host-ms", type=float, default=30.0)
    ap.add_argument("--gpu-ms", type=float, default=100.0)
    ap.add_argument("--arms", default="none,files,mem")
    ap.add_argument("--cpu-copy", action="store_true")
    ap.add_argument("--baseline")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--launch-us", type=float, help="CPU: a torch op of the main thread costs this, not its run")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and not args.cpu_copy:
        # a GPU's copy is on the copy stream, not here
        capture_lanes._copy_into = lambda dst, rows, stream, keep=False: None
    if args.launch_us is not None:
        _count_launches(args.launch_us)
    root = tempfile.mkdtemp(prefix="prefill_host_")
    fs = {"name": "filesystem", "params": {"root": root, "threads": 4, "fsync": False}}
    cfg = SteerConfig.model_validate({"capture": ["activations", fs], "capture_max_rows": MAX_ROWS})
    sites = [(h, l) for h in HOOKS for l in range(LAYERS)]
    versions = {"new": capture_mod}
    if args.baseline:
        versions = {"base": _load_baseline(args.baseline), **versions}
    rts = {v: m.CaptureRuntime(cfg, sites, LAYERS, WIDTH, args.hidden, torch.bfloat16, device)
           for v, m in versions.items()}
    base = {"layers": CAP_LAYERS, "hooks": ["post_mlp"], "positions": "all_prompt"}
    specs = {"none": None, "files": {"filesystem": base}, "mem": {"activations": {**base, "reduce": "mean"}}}
    arms = args.arms.split(",")
    loop_n = _calibrate(args.host_ms)
    me, main_tid = os.getpid(), threading.get_native_id()
    cols = [f"{a}/{v}" for a in arms for v in versions]
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in cols}
    scheduled, computed = np.full(N, PROMPT, np.int32), np.zeros(N, np.int32)
    gpu_cycles = 0
    if device.type == "cuda":  # cycles of torch.cuda._sleep for --gpu-ms
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        torch.cuda._sleep(10**7)
        t1.record()
        t1.synchronize()
        gpu_cycles = int(10**7 * args.gpu_ms / t0.elapsed_time(t1))

    for k in range(args.steps + 3):
        for arm in arms:
            for v, rt in rts.items():
                col = f"{arm}/{v}"
                host_pid = rt._host.proc.pid
                ids = [f"{v}{arm}{k}r{i}" for i in range(N)]
                others0 = {t: x for t, (_, x) in _thread_cpu(me).items() if t != main_tid}
                host0 = _cpu_of(host_pid)
                wall0, cpu0 = time.perf_counter(), _thread_time()
                marks = []

                def mark(name: str) -> None:
                    marks.append((name, time.perf_counter(), _thread_time()))

                if specs[arm] is not None:
                    for r in ids:
                        rt.add_request(r, specs[arm], PROMPT, {"external_id": r, "capture_reply": None}, 1)
                mark("add x16")
                if rt.active:  # the runner's check (SteeringRuntime.plan_capture)
                    rt.plan_step(ids, scheduled, computed)
                mark("plan_step")
                _python_work(loop_n)
                mark("vllm host work")
                if gpu_cycles:  # the forward: the GPU busy, the step's rows written after it
                    torch.cuda._sleep(gpu_cycles)
                rt.after_forward()
                mark("after_forward")
                if gpu_cycles:
                    done = torch.cuda.Event()
                    done.record()
                    done.synchronize()  # the main thread waits on the step's output (vLLM's sampled tokens)
                else:
                    time.sleep(args.gpu_ms / 1e3)
                mark("gpu wait")
                rt.finish_requests(ids)  # the engine's ends, a step later (already ended early: nothing to do)
                mark("finish (engine)")
                if k < 3:
                    continue
                prev_w, prev_c = wall0, cpu0
                for name, w, c in marks:
                    rows[col].setdefault(f"{name} wall", []).append((w - prev_w) * 1e3)
                    rows[col].setdefault(f"{name} cpu", []).append((c - prev_c) * 1e3)
                    prev_w, prev_c = w, c
                waited = next(w - p[1] for p, (n, w, _) in zip([("", wall0, cpu0)] + marks, marks) if n == "gpu wait")
                rows[col].setdefault("main thread wall (no gpu wait)", []).append(
                    (marks[-1][1] - wall0 - waited) * 1e3)
                rows[col].setdefault("main thread cpu", []).append((marks[-1][2] - cpu0) * 1e3)
                others1 = {t: x for t, (_, x) in _thread_cpu(me).items() if t != main_tid}
                rows[col].setdefault("other worker threads cpu", []).append(
                    sum(x - others0.get(t, 0.0) for t, x in others1.items()) * 1e3)
                rows[col].setdefault("consumers' process cpu", []).append((_cpu_of(host_pid) - host0) * 1e3)
    for rt in rts.values():
        rt.close()
    out = {c: {k: round(statistics.median(v), 3) for k, v in r.items()} for c, r in rows.items()}
    names = list(out[cols[0]].keys())
    print(f"median ms per step ({args.steps} steps per column, interleaved; {N} x {PROMPT} tokens, 4 sites, hidden "
          f"{args.hidden}, {device}, host work {args.host_ms} ms, gpu {args.gpu_ms} ms, "
          f"copy {'on' if args.cpu_copy or device.type == 'cuda' else 'off'})")
    print(f"  {'':32s}" + "".join(f"{c:>12s}" for c in cols))
    for name in names:
        print(f"  {name:32s}" + "".join(f"{out[c][name]:12.3f}" for c in cols))
    for v, rt in rts.items():
        print(f"stats {v}:", {k: x for k, x in rt.status().items() if x})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "median_ms": out}, fh, indent=1)


if __name__ == "__main__":
    main()
