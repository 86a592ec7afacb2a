"""Does a server's TTFT gap follow the server or the CPUs it runs on? Pin and rotate, then measure.

Each kept server (``ab_suite.py --phases start --keep-servers``) gets its own CPU set: its engine
core (every thread) on one pair of CPUs, its API server on another, the load generator on a set of
its own. Then, in as many rotations as there are servers, the CPU sets move one server along and
``ttft_probe``'s batches run at concurrency 1 (rotating the server order). A gap that stays with a
server is the server's own; one that moves with a CPU set is the machine's.

    python3 bench/cpu_rotation.py --servers stock,steer,steer_one --rounds 6 --out $OUT/cpu_rotation.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from abkit.arms import build_bodies, make_prompts, seed_of  # noqa: E402
from abkit.host_profile import descendants, engine_core_pid  # noqa: E402
from abkit.servers import STATE_FILE  # noqa: E402
from abkit.stats import delta, mean_sem  # noqa: E402
from ttft_probe import batch  # noqa: E402


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), set(cpus))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="stock,steer,steer_one")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default="cpu_rotation.json")
    args = ap.parse_args()
    state = json.loads(STATE_FILE.read_text())
    names = args.servers.split(",")
    n = len(names)
    ncpu = os.cpu_count()
    # CPU sets: the load generator on the first two, then per slot an engine-core pair and an API pair
    os.sched_setaffinity(0, {0, 1})
    slots = [([2 + 4 * i, 3 + 4 * i], [4 + 4 * i, 5 + 4 * i]) for i in range(n)]
    if slots[-1][1][-1] >= ncpu:
        raise SystemExit(f"{n} servers need {2 + 4 * n} CPUs, this machine has {ncpu}")
    procs = {}
    for name in names:
        api = state[name]["pid"]
        ec, _ = engine_core_pid(api)
        procs[name] = (api, ec, [p for p in descendants(api) if p != ec])
    out: dict = {"slots": slots, "rotations": []}
    for rot in range(n):
        placement = {name: slots[(i + rot) % n] for i, name in enumerate(names)}
        for name, (ec_cpus, api_cpus) in placement.items():
            api, ec, others = procs[name]
            pin(ec, ec_cpus)
            pin(api, api_cpus)
            for p in others:
                pin(p, api_cpus)
        recs: dict = {name: [] for name in names}
        for r in range(args.rounds):
            order = names[r % n:] + names[:r % n]
            for name in order:
                base = f"http://127.0.0.1:{state[name]['port']}"
                prompts = make_prompts(args.requests, 256, 32000, seed_of("rot", name, rot, r))
                recs[name].append(batch(base, build_bodies(prompts, [None] * args.requests, 4), 1))
        summary = {name: {k: mean_sem([x[k] for x in v]) for k in v[0]} for name, v in recs.items()}
        if "stock" in summary:
            for name in names:
                if name != "stock":
                    summary[f"{name}-stock"] = {k: delta(summary[name][k], summary["stock"][k]) for k in summary["stock"]}
        out["rotations"].append({"placement": placement, "summary": summary})
        line = "  ".join(f"{name}@{placement[name][0]}: prefill {summary[name]['prefill'][0]:.2f}±{summary[name]['prefill'][1]:.2f}"
                         for name in names)
        print(f"rotation {rot}: {line}", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
