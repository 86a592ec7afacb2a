"""The ``host`` phase: host (Python) time per engine step of the engine-core and API-server
processes under load, sampled with py-spy, steps counted from the server's Prometheus /metrics.

For each server of --host-servers and each traffic kind (unsteered; per_request_n16 on steer
servers): a short warm-up load, then ``py-spy record --format raw --nonblocking --rate 200`` on the
engine core (the server's descendant whose command line says ``EngineCore``) and on the API server
(the server's own pid) while the timed load runs, stopped with SIGINT when it ends. Steps = the
change of ``vllm:iteration_tokens_total_count`` (one histogram observation per engine step) over
the load. py-spy's raw output is collapsed stacks, ``frame;frame;... count``, idle samples dropped,
so samples / rate is active CPU time: reported per engine step, with the share of samples whose
stack holds a vllm_steer frame and the top vllm_steer frames. Failures are recorded, never raised.
``python3 -m abkit.host_profile`` (from bench/) runs the parsers' self-test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sysconfig
import time
from collections import Counter
from pathlib import Path

from .arms import ARMS, arm_fields, build_bodies, make_prompts, seed_of
from .client import http_text, run_load
from .common import log
from .servers import STEER_BLOCK, STEER_SERVERS, server_unavailable
from .stats import summarize_trial

STEP_METRICS = [  # (name of the _count series, note)
    ("vllm:iteration_tokens_total_count", "one observation per engine step"),
    ("vllm:time_per_output_token_seconds_count",
     "FALLBACK: vllm:iteration_tokens_total missing; counts output tokens after the first, not steps"),
    ("vllm:inter_token_latency_seconds_count",
     "FALLBACK: vllm:iteration_tokens_total missing; counts output tokens after the first, not steps"),
]
TRAFFIC = {"unsteered": {"kind": "plain"}, "per_request_n16": ARMS["per_request_n16"],
           "site_inline16": ARMS["site_inline16"]}  # --host-traffic picks among these
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>.*?)(?::(?P<line>\d+))?\)$")
_STEER_PATH = re.compile(r"(^|[/\\])vllm_steer[/\\]")
_IGNORED_STEER_FILES = ("vllm_steer/launcher.py",)  # the CPU launcher is the API server's main frame


# --------------------------------------------------------------------------- processes


def find_py_spy(explicit: str | None) -> tuple[str | None, list[str]]:
    """--py-spy, else py-spy on PATH, else the interpreter's scripts dir, else <PYTHONPATH entry>/bin."""
    tried: list[str] = []
    if explicit:
        p = shutil.which(explicit) or (explicit if os.access(explicit, os.X_OK) else None)
        return p, [explicit]
    p = shutil.which("py-spy")
    tried.append("PATH")
    if p:
        return p, tried
    cands = [Path(sysconfig.get_path("scripts")) / "py-spy"]
    cands += [Path(e) / "bin" / "py-spy" for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    for c in cands:
        tried.append(str(c))
        if c.is_file() and os.access(c, os.X_OK):
            return str(c), tried
    return None, tried


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children()]
    except ImportError:
        pass
    except Exception:  # noqa: BLE001  (gone)
        return []
    out: list[int] = []
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if tasks:
        for t in tasks:
            try:
                out += [int(x) for x in t.read_text().split()]
            except (OSError, ValueError):
                pass
        return sorted(set(out))
    for st in Path("/proc").glob("[0-9]*/stat"):  # no children files: scan every process's ppid
        try:
            fields = st.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(st.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            if c not in out:
                out.append(c)
                todo.append(c)
    return out


def engine_core_pid(server_pid: int) -> tuple[int | None, dict]:
    """The descendant of the server whose command line contains ``EngineCore`` (vLLM sets the title
    ``VLLM::EngineCore`` with setproctitle); without one, the only multiprocessing-spawned child
    that is not the resource tracker (noted in the info)."""
    desc = descendants(server_pid)
    lines = {p: cmdline(p) for p in desc}
    info = {"descendants": {str(p): lines[p][:160] for p in desc[:12]}}
    hits = [p for p in desc if "EngineCore" in lines[p]]
    if hits:
        return hits[0], info
    spawned = [p for p in desc if "spawn_main" in lines[p] and "resource_tracker" not in lines[p]]
    if len(spawned) == 1:
        info["note"] = "no EngineCore title: took the only multiprocessing child"
        return spawned[0], info
    return None, info


def api_server_check(pid: int) -> tuple[bool, str]:
    line = cmdline(pid)
    ok = any(s in line for s in ("api_server", "uvicorn", " serve ", "vllm serve"))
    return ok, line[:300]


# --------------------------------------------------------------------------- /metrics


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series name: sum over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if "{" in line:
                name = line[:line.index("{")]
                value = line[line.rindex("}") + 1:].split()[0]
            else:
                name, value = line.split()[:2]
            out[name] = out.get(name, 0.0) + float(value)
        except (ValueError, IndexError):
            continue
    return out


def step_count(metrics: dict[str, float]) -> tuple[float | None, str | None, str | None]:
    for name, note in STEP_METRICS:
        if name in metrics:
            return metrics[name], name, note
    return None, None, None


def read_steps(base: str) -> tuple[float | None, str | None, str | None]:
    return step_count(parse_metrics(http_text(base + "/metrics", timeout=30)))


# --------------------------------------------------------------------------- py-spy output


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    """py-spy raw (collapsed) output: ``frame;frame;... count`` per line, root first."""
    out = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, n = line.rpartition(" ")
        try:
            out.append((stack.split(";") if stack else [], int(n)))
        except ValueError:
            continue
    return out


def frame_key(frame: str) -> tuple[str, bool]:
    """``func (path:line)`` -> (``func (short path)`` without the line, is it a vllm_steer frame)."""
    m = _FRAME.match(frame)
    func, path = (m.group("func"), m.group("path")) if m else (frame, "")
    steer = bool(_STEER_PATH.search(path)) and not path.replace("\\", "/").endswith(_IGNORED_STEER_FILES)
    if steer:
        i = path.replace("\\", "/").rfind("vllm_steer/")
        path = path[i:]
    return f"{func} ({path})", steer


_VLLM_PATH = re.compile(r"(^|[/\\])vllm[/\\]")


def _ours(frames: list[str]) -> bool:
    """Whether a sample's time is vllm_steer's: its innermost frame of vLLM or vllm_steer is ours (a
    wrapper of ours around vLLM's ``execute_model`` does not make vLLM's step ours; torch or numpy
    frames below a frame of ours do count)."""
    for f in reversed(frames):
        if frame_key(f)[1]:
            return True
        m = _FRAME.match(f)
        if m and _VLLM_PATH.search(m.group("path")):
            return False
    return False


def summarize_stacks(stacks: list[tuple[list[str], int]], rate: float, steps: float | None, top: int = 15) -> dict:
    samples = sum(n for _, n in stacks)
    steer_samples = 0
    incl: Counter = Counter()
    self_: Counter = Counter()
    leaf_all: Counter = Counter()
    for frames, n in stacks:
        keys = [frame_key(f) for f in frames]
        if keys:
            leaf_all[keys[-1][0]] += n
            if keys[-1][1]:
                self_[keys[-1][0]] += n
        sk = {k for k, s in keys if s}
        if _ours(frames):
            steer_samples += n
            for k in sk:
                incl[k] += n
    return {
        "samples": samples,
        "active_cpu_ms": round(samples / rate * 1000, 1),
        "active_cpu_ms_per_step": round(samples / rate * 1000 / steps, 4) if steps else None,
        "vllm_steer_samples": steer_samples,
        "vllm_steer_share": round(steer_samples / samples, 4) if samples else None,  # see _ours
        "vllm_steer_ms_per_step": round(steer_samples / rate * 1000 / steps, 4) if steps else None,
        "top_vllm_steer": [[k, n, self_.get(k, 0)] for k, n in incl.most_common(top)],
        "top_self": [[k, n] for k, n in leaf_all.most_common(10)],
    }


class Spy:
    """One ``py-spy record`` process on one pid, stopped with SIGINT (it then writes its output)."""

    def __init__(self, exe: str, pid: int, out: Path, duration: int, rate: int):
        self.exe, self.pid, self.out, self.duration, self.rate = exe, pid, out, duration, rate
        self.log_path = out.with_suffix(".log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.unlink(missing_ok=True)
        cmd = [self.exe, "record", "--pid", str(self.pid), "--duration", str(self.duration), "--rate",
               str(self.rate), "--format", "raw", "--output", str(self.out), "--nonblocking"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

    def failed_early(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"py-spy exited with {self.proc.returncode}: {self.log_tail()}"
        return None

    def stop(self) -> str | None:
        """Stops it, waits for the output; returns an error text or None."""
        if self.proc is None:
            return "not started"
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                return f"py-spy did not stop on SIGINT: {self.log_tail()}"
        if self.proc.returncode != 0 or not self.out.exists():
            return f"py-spy rc {self.proc.returncode}, output {'present' if self.out.exists() else 'missing'}: " \
                   f"{self.log_tail()}"
        return None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-1500:].strip()
        except OSError:
            return ""


# --------------------------------------------------------------------------- the phase


def _profile_one(pool, sname: str, traffic: str, spy_exe: str, args, ctx: dict, rawdir: Path) -> dict:
    server = pool.get(sname)
    arm = TRAFFIC[traffic]
    n, conc, mt = args.requests, args.concurrency, args.max_tokens
    rec: dict = {"server": sname, "traffic": traffic, "load": {"requests": n, "concurrency": conc,
                                                                "max_tokens": mt}, "processes": {}}
    # warm-up (new configs, compile of any new shape) outside the window
    wn = min(n, conc, 32)
    warm = build_bodies(make_prompts(wn, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of("host", sname, traffic, "w")),
                        arm_fields(arm, wn, seed_of("host", sname, traffic, "wv"), ctx), min(mt, 8))
    wres, _ = run_load(server, warm, conc)
    werr = [r["error"] for r in wres if "error" in r]
    if werr:
        raise RuntimeError(f"warm-up: {len(werr)} request errors, e.g. {werr[0]}")
    bodies = build_bodies(make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of("host", sname, traffic)),
                          arm_fields(arm, n, seed_of("host", sname, traffic, "v"), ctx), mt)
    ec_pid, ec_info = engine_core_pid(server.pid)
    api_ok, api_line = api_server_check(server.pid)
    procs = {"engine_core": ec_pid, "api_server": server.pid}
    rec["processes"]["engine_core"] = {"pid": ec_pid, "cmdline": cmdline(ec_pid)[:200] if ec_pid else None}
    if ec_pid is None:
        rec["processes"]["engine_core"]["error"] = f"no descendant of pid {server.pid} with EngineCore in its " \
                                                   f"command line: {ec_info}"
    rec["processes"]["api_server"] = {"pid": server.pid, "cmdline": api_line[:200], "is_api_server": api_ok}
    if not api_ok:
        log(f"[host] {sname}: pid {server.pid} does not look like the API server: {api_line[:200]}")
    spies: dict[str, Spy] = {}
    for pname, pid in procs.items():
        if pid is None:
            continue
        s = Spy(spy_exe, pid, rawdir / f"{sname}_{traffic}_{pname}.txt", args.host_duration, args.host_rate)
        s.start()
        spies[pname] = s
    time.sleep(1.5)  # py-spy attaches
    for pname, s in list(spies.items()):
        err = s.failed_early()
        if err:
            rec["processes"][pname]["error"] = err
            log(f"[host] {sname} / {traffic} / {pname}: {err}")
            spies.pop(pname)
    steps0, metric, note = read_steps(server.base)
    t0 = time.time()
    res, wall = run_load(server, bodies, conc)
    time.sleep(1.0)  # the front end records the last steps' stats
    steps1, _, _ = read_steps(server.base)
    if time.time() - t0 > args.host_duration:
        rec["warning"] = f"the load ({time.time() - t0:.0f} s) outlasted py-spy's --duration {args.host_duration}"
    for pname, s in spies.items():
        err = s.stop()
        if err:
            rec["processes"][pname]["error"] = err
    steps = (steps1 - steps0) if steps0 is not None and steps1 is not None else None
    if steps is not None and float(steps).is_integer():
        steps = int(steps)
    rec.update({"steps": steps, "step_metric": metric, "step_note": note})
    if note and not note.startswith("one observation"):
        log(f"[host] {sname}: {note}")
    t = summarize_trial(res, wall, arm["kind"] != "plain")
    rec["trial"] = {k: v for k, v in t.items() if k != "per_request"}
    for pname, s in spies.items():
        p = rec["processes"][pname]
        p["raw"] = str(s.out)
        p["py_spy_log"] = s.log_tail()[-400:]
        if s.out.exists():
            p.update(summarize_stacks(parse_collapsed(s.out.read_text(errors="replace")), args.host_rate, steps))
    return rec


def host_phase(pool, args, ctx: dict, results: dict, save) -> None:
    res = results.setdefault("host", {})
    spy_exe, tried = find_py_spy(args.py_spy)
    if spy_exe is None:
        res["(setup)"] = {"error": f"py-spy not found (tried {', '.join(tried)}); pass --py-spy PATH"}
        log(f"[host] {res['(setup)']['error']}")
        save()
        return
    rawdir = Path(args.workdir) / "host"
    log(f"[host] py-spy {spy_exe}, rate {args.host_rate} Hz, raw outputs under {rawdir}")
    for sname in [s for s in args.host_servers.split(",") if s]:
        why = server_unavailable(sname, args)
        if why:
            log(f"[host] skipping server {sname}: {why}")
            continue
        for traffic in [t for t in getattr(args, "host_traffic", "unsteered,per_request_n16").split(",") if t]:
            label = f"{sname} / {traffic}"
            if traffic != "unsteered" and STEER_SERVERS.get(sname) != STEER_BLOCK:
                log(f"[host] skipping {label}: {sname} runs an ablation block, not the steer server's (steered traffic needs every site and its rows)")
                continue
            try:
                rec = _profile_one(pool, sname, traffic, spy_exe, args, ctx, rawdir)
                rec["py_spy"], rec["rate"] = spy_exe, args.host_rate
                res[label] = rec
                for pname, p in rec["processes"].items():
                    log(f"[host] {label} / {pname}: steps {rec['steps']} ({rec['step_metric']}), samples "
                        f"{p.get('samples')}, active CPU {p.get('active_cpu_ms_per_step')} ms/step, vllm_steer "
                        f"share {p.get('vllm_steer_share')}" + (f", error {p['error'][:300]}" if p.get("error") else ""))
            except Exception as e:  # noqa: BLE001
                res[label] = {"server": sname, "traffic": traffic, "error": f"{type(e).__name__}: {e}"[:2000]}
                log(f"[host] {label}: error {e}")
            save()


def _selftest() -> None:
    """Parsers on synthetic py-spy raw output and Prometheus text."""
    raw = "\n".join([
        "<module> (vllm_steer/launcher.py:44);main (vllm/entrypoints/cli/main.py:70);run (asyncio/runners.py:118) 7",
        "run_busy_loop (vllm/v1/engine/core.py:900);step (vllm/v1/engine/core.py:300);"
        "prepare (/opt/site/vllm_steer/runtime/manager.py:120);_pack (/opt/site/vllm_steer/core/payload.py:40) 3",
        "run_busy_loop (vllm/v1/engine/core.py:900);step (vllm/v1/engine/core.py:300);"
        "prepare (/opt/site/vllm_steer/runtime/manager.py:125) 2",
        "run_busy_loop (vllm/v1/engine/core.py:900);execute (/tmp/vllm_steer_ab/x/other.py:5) 8",
        # a wrapper of ours around vLLM's step: vLLM's time, not ours
        "run_busy_loop (vllm/v1/engine/core.py:900);wrapper (/opt/site/vllm_steer/runtime/manager.py:300);"
        "execute_model (/opt/site/vllm/v1/worker/gpu/model_runner.py:10) 4",
        "",
    ])
    s = summarize_stacks(parse_collapsed(raw), rate=200, steps=10)
    assert s["samples"] == 24 and s["vllm_steer_samples"] == 5, s
    assert s["active_cpu_ms_per_step"] == 12.0 and s["vllm_steer_share"] == round(5 / 24, 4), s
    assert s["top_vllm_steer"][0] == ["prepare (vllm_steer/runtime/manager.py)", 5, 2], s["top_vllm_steer"]
    assert ["_pack (vllm_steer/core/payload.py)", 3, 3] in s["top_vllm_steer"], s["top_vllm_steer"]
    prom = "\n".join([
        "# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.",
        "# TYPE vllm:iteration_tokens_total histogram",
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="bench"} 3.0',
        'vllm:iteration_tokens_total_count{engine="0",model_name="bench"} 41.0',
        'vllm:iteration_tokens_total_count{engine="1",model_name="bench"} 1.0',
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="a b"} 99.0',
    ])
    assert step_count(parse_metrics(prom))[:2] == (42.0, "vllm:iteration_tokens_total_count")
    fb = step_count(parse_metrics(prom.replace("iteration_tokens_total", "other")))
    assert fb[0] == 99.0 and fb[2].startswith("FALLBACK"), fb
    assert engine_core_pid(os.getpid())[0] is None
    print("host_profile self-test passed:", {k: s[k] for k in ("samples", "active_cpu_ms_per_step",
                                                                "vllm_steer_share")})


if __name__ == "__main__":
    _selftest()
