"""The ``host`` phase: host (Python) CPU per engine step of a server's processes under an arm's load, sampled
with py-spy (issue 37: "a profile of the worker and engine core per step").

For each arm of --host-arms: a warm-up load, then ``py-spy record --format raw --threads --nonblocking`` on the API
server (the server's pid) and on every descendant whose command line names vLLM's engine core or a worker (with
one GPU the model runner runs inside the engine core) while the timed load runs, stopped with SIGINT when it ends.
An arm with a ``load`` of its own (the prefill arms: prompt 512, max_tokens 1, c32) runs that load. ``--host-gil``
adds py-spy's ``--gil``: only the thread holding the GIL is sampled, so the per-thread numbers say who holds it per
step (the engine core's main thread against the capture lane's notifier / reader and vLLM's own threads); the main
thread's active ms without it minus with it is its time running without the GIL (C calls that release it).
Steps are the change of ``vllm:iteration_tokens_total_count`` (one observation per engine step) over the load.
py-spy's raw output is collapsed stacks (``frame;frame;... count``, idle samples dropped, a thread's frame first),
so samples / rate is active CPU: reported per step and per thread (the runner's main thread apart from capture
consumers' or vLLM's helper threads), with the share whose innermost vLLM-or-ours frame is vllm_steer's and the
top frames of ours. Failures are recorded, never raised.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sysconfig
import time
import urllib.request
from collections import Counter
from pathlib import Path

from .arms import ARMS, arm_fields, build_bodies, make_prompts, seed_of
from .runner import ensure_modules, run_load, summarize_trial
from .servers import log

STEPS = "vllm:iteration_tokens_total_count"
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>.*?)(?::(?P<line>\d+))?\)$")
_OURS, _VLLM = re.compile(r"(^|/)vllm_steer/"), re.compile(r"(^|/)vllm/")
ROLES = (("EngineCore", "engine_core"), ("Worker", "worker"),  # vLLM's process titles (setproctitle)
         ("vllm_steer.runtime.capture_host", "capture_host"))  # a capturing worker's consumer process


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside the interpreter, else <PYTHONPATH entry>/bin (the GPU kit's --target install)."""
    found = shutil.which("py-spy")
    cands = [Path(sysconfig.get_path("scripts")) / "py-spy"]
    cands += [Path(e) / "bin" / "py-spy" for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return found or next((str(c) for c in cands if c.is_file() and os.access(c, os.X_OK)), None)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc's parent ids)."""
    parent = {}
    for st in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(st.parent.name)] = int(st.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out += kids
        todo += kids
    return out


def processes(server_pid: int) -> dict[str, int]:
    """role -> pid: the API server and each descendant titled as an engine core or a worker."""
    out = {"api_server": server_pid}
    for pid in descendants(server_pid):
        line = cmdline(pid)
        for mark, role in ROLES:
            if mark in line:
                out[role if role not in out else f"{role}_{pid}"] = pid
    return out


def steps_of(base: str) -> float | None:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(STEPS)]
    return sum(total) if total else None


def summarize(raw: str, rate: float, steps: float | None) -> dict:
    """Active CPU ms per step, in all and per thread; the share and top frames that are vllm_steer's (a sample is
    ours when its innermost frame of vLLM or of ours is ours: our wrapper around vLLM's step is not ours)."""
    per_thread: Counter = Counter()
    top: Counter = Counter()
    ours = samples = 0
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames, n = stack.split(";"), int(n)
        samples += n
        per_thread[frames[0].split("): ", 1)[-1]] += n  # "thread (<tid>): <name>"
        for f in reversed(frames):
            m = _FRAME.match(f)
            path = m.group("path") if m else ""
            if _OURS.search(path):
                ours += n
                top[f"{m.group('func')} ({path[path.rfind('vllm_steer/'):]})"] += n
                break
            if _VLLM.search(path):
                break
    per_step = (lambda k: round(k / rate * 1000 / steps, 4)) if steps else (lambda k: None)
    return {"samples": samples, "active_ms_per_step": per_step(samples), "vllm_steer_ms_per_step": per_step(ours),
            "vllm_steer_share": round(ours / samples, 4) if samples else None,
            "threads_ms_per_step": {t: per_step(k) for t, k in per_thread.most_common(8)},
            "top_vllm_steer": top.most_common(12)}


def _profile(pool, arm_name: str, spy: str, args, ctx: dict, rawdir: Path) -> dict:
    arm = ARMS[arm_name]
    server = pool.get(arm["server"])
    load = arm.get("load") or {}
    n, conc = load.get("requests", args.requests), load.get("concurrency", args.concurrency)
    mt, prompt_len = load.get("max_tokens", args.max_tokens), load.get("prompt_len", ctx["prompt_len"])

    def bodies(k: int, tokens: int, tag: str) -> list[bytes]:
        return build_bodies(make_prompts(k, prompt_len, ctx["shape"]["vocab"], seed_of("host", arm_name, tag)),
                            arm_fields(arm, k, seed_of("host", arm_name, tag, "v"), ctx), tokens)

    ensure_modules(server, arm, ctx)  # the modules a site_named / named arm's requests name (as the ab phase does)
    run_load(server, bodies(min(n, conc), min(mt, 8), "warm"), conc)
    procs = processes(server.pid)
    spies = {}
    for role, pid in procs.items():
        out = rawdir / f"{arm_name}_{role}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [spy, "record", "--pid", str(pid), "--duration", str(args.host_duration), "--rate", str(args.host_rate),
               "--format", "raw", "--threads", "--nonblocking", "--output", str(out)]
        cmd += ["--gil"] if args.host_gil else []
        spies[role] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT), out)
    time.sleep(1.5)  # py-spy attaches
    steps0 = steps_of(server.base)
    res, wall = run_load(server, bodies(n, mt, "timed"), conc)
    time.sleep(1.0)  # the front end records the last steps
    steps1 = steps_of(server.base)
    steps = steps1 - steps0 if steps0 is not None and steps1 is not None else None
    rec = {"arm": arm_name, "server": arm["server"], "steps": steps, "gil_only": bool(args.host_gil), "processes": {},
           "trial": {k: v for k, v in summarize_trial(res, wall, False).items() if k != "per_request"}}
    for role, (proc, out) in spies.items():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        rec["processes"][role] = ({"pid": procs[role], **summarize(out.read_text(errors="replace"), args.host_rate,
                                                                     steps)}
                                  if out.exists() else {"pid": procs[role], "error": f"py-spy rc {proc.returncode}"})
    return rec


def host_phase(pool, args, ctx: dict, results: dict, save) -> None:
    res = results.setdefault("host", {})
    spy = find_py_spy()
    if spy is None:
        res["error"] = "py-spy not found (PATH, the interpreter's scripts, <PYTHONPATH>/bin)"
        log(f"[host] {res['error']}")
        return
    for arm_name in [a for a in args.host_arms.split(",") if a]:
        try:
            rec = res[arm_name] = _profile(pool, arm_name, spy, args, ctx, Path(args.workdir) / "host")
            for role, p in rec["processes"].items():
                log(f"[host] {arm_name} / {role}: {rec['steps']} steps, active {p.get('active_ms_per_step')} ms/step, "
                    f"vllm_steer {p.get('vllm_steer_ms_per_step')} ms/step, threads {p.get('threads_ms_per_step')}")
        except Exception as e:  # noqa: BLE001
            res[arm_name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            log(f"[host] {arm_name}: error {e}")
        save()
