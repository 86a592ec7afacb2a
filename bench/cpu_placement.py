"""Which CPU each server's busy threads run on, and who shares the core with them, under load.

Why: the torch profiler showed every host event of the enabled server's prefill steps (C calls such as
``cudaStreamIsCapturing`` included) 20-40% slower than in stock's process, and another server with
one steered norm faster than stock: a per-process CPU speed, not our code. This samples, while a load
runs on one kept server at a time (``ab_suite.py --phases start --keep-servers``), every thread of
the machine from /proc (CPU ticks, last CPU), and reports per server: its engine core's and API
server's affinity, their busy threads with CPU share and CPUs used, the other busy threads of the
machine, and how often a busy thread of another process sat on the engine-core thread's SMT sibling
or on its very CPU.

    python3 bench/cpu_placement.py --servers stock,steer --out $OUT/cpu_placement.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from abkit.arms import build_bodies, make_prompts, seed_of  # noqa: E402
from abkit.client import run_load  # noqa: E402
from abkit.host_profile import engine_core_pid  # noqa: E402
from abkit.servers import STATE_FILE  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def siblings() -> dict[int, set[int]]:
    out = {}
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"):
        f = d / "topology" / "thread_siblings_list"
        if f.exists():
            cpus = set()
            for part in f.read_text().strip().split(","):
                a, _, b = part.partition("-")
                cpus.update(range(int(a), int(b or a) + 1))
            out[int(d.name[3:])] = cpus
    return out


def threads() -> dict[tuple[int, int], tuple[str, int, int]]:
    """{(pid, tid): (comm, cpu ticks, last cpu)} of every thread on the machine."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                raw = open(f"/proc/{p}/task/{t}/stat").read()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            f = raw[raw.rindex(")") + 2 :].split()
            out[(int(p), int(t))] = (comm, int(f[11]) + int(f[12]), int(f[36]))
    return out


def mhz() -> dict[int, float]:
    """Current clock of each CPU from /proc/cpuinfo (empty where the VM does not report it)."""
    out, cpu = {}, None
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("processor"):
            cpu = int(line.split(":")[1])
        elif line.startswith("cpu MHz") and cpu is not None:
            out[cpu] = float(line.split(":")[1])
    return out


def sample(stop: threading.Event, every: float, out: list, clocks: list) -> None:
    while not stop.is_set():
        out.append((time.monotonic(), threads()))
        if len(out) % 10 == 5:
            clocks.append(mhz())
        time.sleep(every)


def analyse(samples: list, ec_pid: int, api_pid: int, sib: dict[int, set[int]], clocks: list) -> dict:
    if len(samples) < 3:
        return {"error": "too few samples"}
    t0, first = samples[0]
    t1, last = samples[-1]
    wall = t1 - t0
    busy = {}
    for key, (comm, ticks, _cpu) in last.items():
        if key in first:
            share = (ticks - first[key][1]) / TICK / wall
            if share > 0.05:
                busy[key] = (comm, share)
    cpus: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for _, snap in samples:
        for key in busy:
            if key in snap:
                cpus[key][snap[key][2]] += 1
    main = (ec_pid, ec_pid)
    shared_core = same_cpu = 0
    for (_, a), (_, b) in zip(samples, samples[1:]):  # a busy thread that ran in this interval
        if main not in b:
            continue
        cpu = b[main][2]
        for key, (comm, ticks, c) in b.items():
            if key[0] == ec_pid or key not in a or ticks == a[key][1]:
                continue
            if c == cpu:
                same_cpu += 1
            elif c in sib.get(cpu, ()):
                shared_core += 1
    rows = [{"pid": k[0], "tid": k[1], "comm": v[0], "cpu_share": round(v[1], 3),
             "process": "engine_core" if k[0] == ec_pid else "api_server" if k[0] == api_pid else "other",
             "cpus": dict(cpus[k].most_common(4))} for k, v in sorted(busy.items(), key=lambda kv: -kv[1][1])]
    main_cpu = cpus[main].most_common(1)[0][0] if cpus.get(main) else None
    mhz_main = [c[main_cpu] for c in clocks if main_cpu in c]
    return {"wall_s": round(wall, 2), "samples": len(samples), "busy_threads": rows[:25],
            "engine_core_cpu": main_cpu, "engine_core_cpu_mhz": round(sum(mhz_main) / len(mhz_main)) if mhz_main else None,
            "other_busy_thread_on_engine_core_sibling": shared_core, "other_busy_thread_on_engine_core_cpu": same_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="stock,steer")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--every", type=float, default=0.02)
    ap.add_argument("--out", default="cpu_placement.json")
    args = ap.parse_args()
    state = json.loads(STATE_FILE.read_text())
    sib = siblings()
    res = {"cpus": os.cpu_count(), "siblings": {str(k): sorted(v) for k, v in sorted(sib.items())}, "servers": {}}
    for name in args.servers.split(","):
        pid = state[name]["pid"]
        ec, _ = engine_core_pid(pid)
        rec = {"api_pid": pid, "engine_core_pid": ec,
               "affinity": {"api": sorted(os.sched_getaffinity(pid)), "engine_core": sorted(os.sched_getaffinity(ec))}}
        base = f"http://127.0.0.1:{state[name]['port']}"
        for conc in [int(c) for c in args.concurrency.split(",")]:
            bodies = build_bodies(make_prompts(args.requests, 256, 32000, seed_of("cpu", name, conc)),
                                  [None] * args.requests, 4)
            samples: list = []
            clocks: list = []
            stop = threading.Event()
            th = threading.Thread(target=sample, args=(stop, args.every, samples, clocks), daemon=True)
            th.start()
            run_load(base, bodies, conc)
            stop.set()
            th.join()
            rec[f"c{conc}"] = analyse(samples, ec, pid, sib, clocks)
            top = rec[f"c{conc}"].get("busy_threads", [])[:6]
            print(name, f"c{conc}", {k: rec[f"c{conc}"][k] for k in rec[f"c{conc}"] if k.startswith(("other", "engine_core"))},
                  [(r["process"], r["comm"], r["cpu_share"], r["cpus"]) for r in top], flush=True)
        res["servers"][name] = rec
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
