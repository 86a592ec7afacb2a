#!/usr/bin/env python3
"""The engine core's main thread during capturing steps (issue 37's prefill gap and capture_gen_n16), no engine.

``--load prefill`` (default): the prefill arms' load as the GPU's runner sees it: each step 16 fresh requests of 512
prompt tokens (8192 tokens, one step each: ``max_tokens`` 1), capturing post_mlp of 4 layers at every prompt position,
through the real ``CaptureRuntime`` (the ``steer_capture_fs`` server's consumers: activations, filesystem with 4
writer threads, in the consumers' own process; ``capture_max_rows`` 131072). Arms: ``none`` (the same requests
without capture: the step's capture calls return at once), ``files`` (the filesystem consumer, no fsync) and ``mem``
(activations, reduce mean: reduced on the device, nothing copied per step).

``--load decode``: capture_gen_n16's load (the ``steer_capture`` server: activations, default pool and slots): 16
slots, each running one request at a time (prompt ``--prompt`` 256, ``max_tokens`` ``--gen`` 128, as the A/B's c16
client); a request's first step is its whole prompt, then one token a step; the step that samples its last token
ends it, and its slot's next request arrives in the next step (the engine's end reaches the runner then too).
``--arrivals wave`` (the A/B's closed loop: the 16 start together, end together, and their successors share one
prefill) or ``staggered`` (one request ends every ``gen / 16`` steps; its successor's prompt rides a decode step).
Arms: ``none`` (requests without capture: capture_idle) and ``gen`` (activations at post_mlp of L/4, L/2, 3L/4,
all generated positions, reduce ``last``: reduced on the device).

A step on the main thread, in the runner's order: the engine's ends of the last step (``finish_requests``), the
new requests' ``add_request`` (the runner's ``_update_states``), ``plan_step``, vLLM's own host work for the step (a
fixed pure-Python loop of ``--host-ms`` alone: what it costs under the arm shows the GIL taken from it),
``after_forward`` (hand-off and the ends of requests whose capture the step completed), then the GPU time
(``--gpu-ms`` of sleep, GIL released: the main thread waiting on the step's output). Per arm and phase: the main
thread's wall and thread CPU time (wall - CPU: waiting, for the GIL or a core), median per step (``--stat``; the
decode load's default is the mean: its costly steps are the rare ones where requests come and go); per step, the
CPU time of the worker's other threads (notifier, reader) and of the consumers' process, from ``/proc``. On the CPU
the ring copy would run on the main thread (on a GPU it is a D2H on the copy stream): ``--cpu-copy`` keeps it, the
default leaves it out so the numbers are the host work a GPU step has. ``--hidden`` sizes rows (the main thread's
work does not depend on it without the copy; the consumers' process writes the rows). The CPU runs the device ops
(the plan's upload, the reduce) inline: their time is in the phases (``OMP_NUM_THREADS=1`` on the shared box, where
two OMP threads made each op ~100x slower); ``--launch-us 6`` counts each torch op of the main thread as 6 us (a GPU
launch) instead, leaves the segmented add out (the host work a GPU step has) and adds each phase's count of those
ops (``ops``). ``--in-forward``: an eager step as the runner makes it since s37: ``add_later`` and ``defer_step``
before the forward, the plan made by the forward's first capturing op (phase "plan in the forward", after the GPU
time is enqueued); "before the forward" is the main thread's capture work before the forward's launch, the GPU idle
in the prefill arms' closed loop. ``--baseline DIR``: also an older ``runtime/capture.py`` + ``capture_lanes.py`` +
``capture_plan.py`` + ``capture_reduce.py`` (a ``src/vllm_steer/runtime`` folder, e.g. from ``git archive``), each
step of each arm run on both, interleaved, each version first in turn (the first of a step cost ~1.5x more for the same
code), in this process (the consumers' process is this tree's for both). ``--device cuda`` (a GPU host): the runtime
on the GPU, the ring copy on its copy stream as in the engine, the GPU time a ``torch.cuda._sleep`` the main thread
waits for. ``--profile FILE``: cProfile of the capture calls per column (their functions by own time, text);
``--op-times FILE``: each torch op they call timed on the host (wall) instead, per column (calls, ms a step).
``--inbox``: driver results go to an inbox in another process (the API process's in a server; without it the bench's
requests have no reply address and the reader pushes nothing). ``--no-gate``: the notifier sends a step's packets
(and the reader handles answers) at once, not after the next launch (on a GPU: "vllm host work wall" with and without
it shows what their Python takes from the step's host work).

    PYTHONPATH=src:. python bench/prefill_host_cost.py [--load decode --steps 40 --hidden 256 --baseline DIR
        --out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
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
from vllm_steer.kernels.capture_rows import live as capture_live
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
_OPS_N = [0]  # torch ops the main thread called (--launch-us)


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
            _OPS_N[0] += 1
            return out
        return op

    from vllm_steer.kernels import capture_reduce as kernel
    from vllm_steer.runtime import capture_reduce

    kernel.segment_add = capture_reduce.segment_add = wrap(lambda *a, **k: None)
    for name in ("index_fill_", "index_copy_", "index_select", "copy_", "to", "float", "__add__", "__ne__", "fill_",
                 "index_add_", "index_put_", "scatter_", "clone", "zero_"):
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
    for name in ("repeat_interleave", "add", "where", "cat", "stack"):
        setattr(torch, name, wrap(getattr(torch, name)))


_OP_COL: list = [None]  # the column whose capture calls run now (--op-times), None outside them
_OP_TIMES: dict = {}  # (column, op) -> [calls, seconds]


def _time_ops() -> None:
    """``--op-times``: each torch op the capture calls make on the main thread (the device ops, the stream and event
    calls) timed on the host (wall), per column: what a GPU step's launches cost the main thread, op by op."""
    main = threading.get_ident()

    def wrap(name, f):
        def op(*a, **k):
            col = _OP_COL[0]
            if col is None or threading.get_ident() != main:
                return f(*a, **k)
            t0 = time.perf_counter()
            out = f(*a, **k)
            acc = _OP_TIMES.setdefault((col, name), [0, 0.0])
            acc[0] += 1
            acc[1] += time.perf_counter() - t0
            return out
        return op

    for name in ("index_fill_", "index_copy_", "index_select", "copy_", "to", "float", "view", "numpy", "__add__",
                 "__ne__", "fill_", "index_add_", "index_put_", "scatter_", "clone", "zero_", "record_stream"):
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    for name in ("repeat_interleave", "add", "where", "cat", "stack", "zeros", "empty"):
        setattr(torch, name, wrap(name, getattr(torch, name)))
    if torch.cuda.is_available():
        for name in ("current_stream", "stream"):
            setattr(torch.cuda, name, wrap(f"cuda.{name}", getattr(torch.cuda, name)))
        for name in ("record", "query", "synchronize"):
            setattr(torch.cuda.Event, name, wrap(f"Event.{name}", getattr(torch.cuda.Event, name)))
        for name in ("wait_event", "wait_stream"):
            setattr(torch.cuda.Stream, name, wrap(f"Stream.{name}", getattr(torch.cuda.Stream, name)))


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
    """An older ``runtime/capture.py`` built on its own ``capture_lanes.py``, ``capture_plan.py`` and
    ``capture_reduce.py``: the capture module (its ``capture_lanes`` as ``_lanes``)."""
    names = ("capture_lanes", "capture_plan", "capture_reduce", "capture")
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
    mods["capture"]._lanes = mods["capture_lanes"]
    return mods["capture"]


def _inbox():
    """(an address, the process reading it): a PULL socket draining every result pushed to it, in a process of its own
    (a served request's inbox is in the API process)."""
    import subprocess

    address = f"ipc://{tempfile.mkdtemp(prefix='prefill_inbox_')}/inbox"
    code = ("import sys, zmq; s = zmq.Context().socket(zmq.PULL); s.bind(sys.argv[1]); print('ready', flush=True)\n"
            "while True: s.recv()")
    proc = subprocess.Popen([sys.executable, "-c", code, address], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return address, proc


def _prefill_schedule(args):
    """Each step: 16 fresh requests of ``PROMPT`` tokens, one step each (the last step's end with it)."""
    last: list[int] = []
    for k in range(10**9):
        ids = [k * N + i for i in range(N)]
        yield last, [(r, PROMPT, 1) for r in ids], ids, np.full(N, PROMPT, np.int32), np.zeros(N, np.int32)
        last = ids


def _decode_schedule(args):
    """16 slots running a request each: its prompt in its first step, then a token a step; the step sampling its
    ``gen``-th token is its last, its end and its slot's next request come with the next step. ``wave``: every slot
    starts at step 0; ``staggered``: slot i at step ``i * gen // 16``."""
    slots: list[list[int] | None] = [None] * N  # [request, tokens computed]
    start = [0 if args.arrivals == "wave" else i * args.gen // N for i in range(N)]
    ended: list[int] = []
    nxt = 0
    for k in range(10**9):
        new = []
        for i in range(N):
            if slots[i] is None and k >= start[i]:
                slots[i] = [nxt, 0]
                new.append((nxt, args.prompt, args.gen))
                nxt += 1
        live = [s for s in slots if s is not None]
        ids = [s[0] for s in live]
        computed = np.array([s[1] for s in live], np.int32)
        scheduled = np.where(computed == 0, args.prompt, 1).astype(np.int32)
        yield ended, new, ids, scheduled, computed
        ended = []
        for i, s in enumerate(slots):
            if s is None:
                continue
            s[1] += args.prompt if s[1] == 0 else 1
            if s[1] >= args.prompt + args.gen - 1:  # this step sampled its gen-th token
                ended.append(s[0])
                slots[i] = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--steps", type=int, help="steps per column, measured (default: prefill 40, decode 512)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--host-ms", type=float, help="default: prefill 30, decode 2")
    ap.add_argument("--gpu-ms", type=float, help="default: prefill 100, decode 12")
    ap.add_argument("--arms", help="default: prefill none,files,mem; decode none,gen")
    ap.add_argument("--prompt", type=int, default=256, help="decode: prompt tokens")
    ap.add_argument("--gen", type=int, default=128, help="decode: max_tokens")
    ap.add_argument("--arrivals", choices=("wave", "staggered"), default="wave")
    ap.add_argument("--stat", choices=("median", "mean"), help="default: prefill median, decode mean")
    ap.add_argument("--cpu-copy", action="store_true")
    ap.add_argument("--baseline")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--launch-us", type=float, help="CPU: a torch op of the main thread costs this, not its run")
    ap.add_argument("--in-forward", action="store_true", help="an eager step: requests queued (add_later) and the "
                    "plan made by the forward's first capturing op (defer_step), where the version has it")
    ap.add_argument("--inbox", action="store_true", help="driver results pushed to an inbox in a process of its own "
                    "(the API process's), as a served request's are: the reader's push work in the worker")
    ap.add_argument("--no-gate", action="store_true", help="the notifier and the reader at once instead of after the "
                    "next launch (VLLM_STEER_CAPTURE_GATE=0; the gate acts on a GPU only)")
    ap.add_argument("--out")
    ap.add_argument("--profile", metavar="FILE", help="cProfile of the capture calls (not vLLM's stand-in work, not "
                                                       "the GPU wait) per column, top functions by own time, as text")
    ap.add_argument("--op-times", metavar="FILE", help="each torch op of the capture calls timed on the host (wall), "
                                                        "per column: calls and ms a step, as text")
    args = ap.parse_args()
    decode = args.load == "decode"
    for name, pre, dec in (("steps", 40, 512), ("host_ms", 30.0, 2.0), ("gpu_ms", 100.0, 12.0),
                           ("arms", "none,files,mem", "none,gen"), ("stat", "median", "mean")):
        if getattr(args, name) is None:
            setattr(args, name, dec if decode else pre)
    device = torch.device(args.device)
    if args.launch_us is not None:
        _count_launches(args.launch_us)
    if args.op_times:
        _time_ops()
    root = tempfile.mkdtemp(prefix="prefill_host_")
    if decode:  # the steer_capture server
        cfg = SteerConfig.model_validate({"capture": ["activations"]})
        spec = {"layers": [LAYERS // 4, LAYERS // 2, 3 * LAYERS // 4], "hooks": ["post_mlp"],
                "positions": "all_generated"}
        specs = {"none": None, "gen": {"activations": {**spec, "reduce": "last"}},
                 "gen_mean": {"activations": {**spec, "reduce": "mean"}}}
        schedule, warm = _decode_schedule, args.gen + 3  # every slot running, one wave ended
    else:
        fs = {"name": "filesystem", "params": {"root": root, "threads": 4, "fsync": False}}
        cfg = SteerConfig.model_validate({"capture": ["activations", fs], "capture_max_rows": MAX_ROWS})
        base = {"layers": CAP_LAYERS, "hooks": ["post_mlp"], "positions": "all_prompt"}
        specs = {"none": None, "files": {"filesystem": base}, "mem": {"activations": {**base, "reduce": "mean"}}}
        schedule, warm = _prefill_schedule, 3
    sites = [(h, l) for h in HOOKS for l in range(LAYERS)]
    versions = {"new": capture_mod}
    if args.baseline:
        versions = {"base": _load_baseline(args.baseline), **versions}
    if args.no_gate:
        for m in versions.values():
            m.GATE = False
    if device.type == "cpu" and not args.cpu_copy:  # a GPU's copy is on the copy stream, not here
        for lanes in [capture_lanes] + [m._lanes for m in versions.values() if hasattr(m, "_lanes")]:
            lanes._copy_into = lambda dst, rows, stream, keep=False: None
    arms = args.arms.split(",")
    # prefill: an arm's requests end within their step, so arms share a runtime per version; decode: one per column
    # (another arm's requests running beside them would change every step's batch)
    rts = {v: m.CaptureRuntime(cfg, sites, LAYERS, WIDTH, args.hidden, torch.bfloat16, device)
           for v, m in versions.items()}
    rts = {f"{a}/{v}": (rts[v] if not decode else
                        versions[v].CaptureRuntime(cfg, sites, LAYERS, WIDTH, args.hidden, torch.bfloat16, device))
           for a in arms for v in versions}
    reply, drainer = _inbox() if args.inbox else (None, None)
    loop_n = _calibrate(args.host_ms)
    me, main_tid = os.getpid(), threading.get_native_id()
    cols = [f"{a}/{v}" for a in arms for v in versions]
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in cols}
    gpu_cycles = 0
    if device.type == "cuda":  # cycles of torch.cuda._sleep for --gpu-ms
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        torch.cuda._sleep(10**7)
        t1.record()
        t1.synchronize()
        gpu_cycles = int(10**7 * args.gpu_ms / t0.elapsed_time(t1))

    profs = {c: cProfile.Profile() for c in cols} if args.profile else {}
    steps = schedule(args)
    order = list(versions)
    for k in range(args.steps + warm):
        ended, new, live, scheduled, computed = next(steps)
        turn = order[k % len(order):] + order[: k % len(order)]  # each version first in turn: the first costs more
        for arm in arms:
            for v in turn:
                col = f"{arm}/{v}"
                rt = rts[col]
                host_pid = rt._host.proc.pid
                name_of = f"{v}{arm}r{{}}".format
                ids = list(map(name_of, live))
                others0 = {t: x for t, (_, x) in _thread_cpu(me).items() if t != main_tid}
                host0 = _cpu_of(host_pid)
                wall0, cpu0, ops0 = time.perf_counter(), _thread_time(), _OPS_N[0]
                marks = []

                # the capture calls profiled (a Profile enables itself as a context), the warm-up steps not
                capture = profs[col] if profs and k >= warm else contextlib.nullcontext()
                timed = col if k >= warm else None

                def mark(name: str) -> None:
                    marks.append((name, time.perf_counter(), _thread_time(), _OPS_N[0]))

                _OP_COL[0] = timed
                with capture:
                    rt.finish_requests(list(map(name_of, ended)))  # the engine's ends (already ended early: nothing)
                    mark("finish (engine)")
                    in_forward = args.in_forward and hasattr(rt, "defer_step")
                    if specs[arm] is not None or decode:
                        add = rt.add_later if in_forward else rt.add_request
                        for r, prompt, max_tokens in new:
                            rid = name_of(r)
                            add(rid, specs[arm], prompt, {"external_id": rid, "capture_reply": reply}, max_tokens)
                    mark(f"add x{len(new)}" if not decode else "add")
                    if rt.active:  # the runner's check (SteeringRuntime.plan_capture)
                        (rt.defer_step if in_forward else rt.plan_step)(ids, scheduled, computed)
                    mark("plan_step")
                if timed:
                    rows[col].setdefault("before the forward", []).append((marks[-1][1] - wall0) * 1e3)
                _OP_COL[0] = None
                _python_work(loop_n)
                mark("vllm host work")
                if gpu_cycles:  # the forward: the GPU busy, the step's rows written after it
                    torch.cuda._sleep(gpu_cycles)
                if hasattr(rt, "launched"):
                    rt.launched()  # the runner's wrapper, the forward launched: the notifier's earlier items go
                _OP_COL[0] = timed
                with capture:
                    capture_live.ready()  # the forward's first capturing op (--in-forward: the deferred plan, GPU busy)
                mark("plan in the forward")
                with capture:
                    rt.after_forward()
                _OP_COL[0] = None
                mark("after_forward")
                if gpu_cycles:
                    done = torch.cuda.Event()
                    done.record()
                    done.synchronize()  # the main thread waits on the step's output (vLLM's sampled tokens)
                else:
                    time.sleep(args.gpu_ms / 1e3)
                mark("gpu wait")
                if k < warm:
                    continue
                prev_w, prev_c, prev_n = wall0, cpu0, ops0
                for name, w, c, n in marks:
                    rows[col].setdefault(f"{name} wall", []).append((w - prev_w) * 1e3)
                    rows[col].setdefault(f"{name} cpu", []).append((c - prev_c) * 1e3)
                    if args.launch_us is not None and name not in ("vllm host work", "gpu wait"):
                        rows[col].setdefault(f"{name} ops", []).append(n - prev_n)
                    prev_w, prev_c, prev_n = w, c, n
                waited = next(w - p[1] for p, (n, w, *_) in zip([("", wall0)] + marks, marks) if n == "gpu wait")
                rows[col].setdefault("main thread wall (no gpu wait)", []).append(
                    (marks[-1][1] - wall0 - waited) * 1e3)
                rows[col].setdefault("main thread cpu", []).append((marks[-1][2] - cpu0) * 1e3)
                rows[col].setdefault("capture cpu (main thread)", []).append(
                    (marks[-1][2] - cpu0 - sum(m[2] - p[2] for p, m in zip([("", wall0, cpu0)] + marks, marks)
                                               if m[0] in ("vllm host work", "gpu wait"))) * 1e3)
                if args.launch_us is not None:
                    rows[col].setdefault("ops", []).append(marks[-1][3] - ops0)
                others1 = {t: x for t, (_, x) in _thread_cpu(me).items() if t != main_tid}
                rows[col].setdefault("other worker threads cpu", []).append(
                    sum(x - others0.get(t, 0.0) for t, x in others1.items()) * 1e3)
                rows[col].setdefault("consumers' process cpu", []).append((_cpu_of(host_pid) - host0) * 1e3)
    for rt in set(rts.values()):
        rt.close()
    if drainer is not None:
        drainer.kill()
    reduce = statistics.median if args.stat == "median" else statistics.fmean
    out = {c: {k: round(reduce(v), 4) for k, v in r.items()} for c, r in rows.items()}
    names = list(out[cols[0]].keys())
    shape = (f"{N} slots, prompt {args.prompt} + {args.gen} tokens, {args.arrivals}" if decode
             else f"{N} x {PROMPT} tokens, 4 sites")
    print(f"{args.stat} per step ({args.steps} steps per column, interleaved; {shape}, hidden {args.hidden}, {device}, "
          f"host work {args.host_ms} ms, gpu {args.gpu_ms} ms, copy {'on' if args.cpu_copy or device.type == 'cuda' else 'off'}"
          f"{f', a torch op {args.launch_us} us' if args.launch_us is not None else ''}; ms, ops: count)")
    print(f"  {'':32s}" + "".join(f"{c:>12s}" for c in cols))
    for name in names:
        print(f"  {name:32s}" + "".join(f"{out[c][name]:12.3f}" for c in cols))
    for col, rt in rts.items():
        print(f"stats {col}:", {k: x for k, x in rt.status().items() if x})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), args.stat + "_ms": out}, fh, indent=1)
    if args.op_times:
        with open(args.op_times, "w") as fh:
            fh.write(f"torch ops of the capture calls on the main thread (host wall; {args.steps} steps a column)\n")
            for col in cols:
                ops = sorted(((n, c, s) for (cc, n), (c, s) in _OP_TIMES.items() if cc == col), key=lambda x: -x[2])
                fh.write(f"##### {col}: {sum(s for *_, s in ops) * 1e3 / args.steps:.3f} ms a step in torch ops\n")
                for n, c, s in ops:
                    fh.write(f"  {n:24s} {c / args.steps:8.1f} calls a step {s * 1e6 / max(c, 1):9.1f} us a call"
                             f" {s * 1e3 / args.steps:8.3f} ms a step\n")
    if profs:
        with open(args.profile, "w") as fh:
            for col, prof in profs.items():
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
                fh.write(f"##### {col}: the capture calls of {args.steps} steps (ms = s x 1000 / steps)\n")
                fh.write(text.getvalue())


if __name__ == "__main__":
    main()
