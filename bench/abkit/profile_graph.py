"""The ``graph`` phase: torch.profiler (vLLM's /start_profile) around a few requests per server, each
trace read by ``tests/gpu_e2e/trace_kernels.py`` (kernels per CUDA-graph launch, the forward graph's GPU
time, steering kernels). The same count is asserted by tests/gpu_e2e/test_decode_graph_gpu.py."""

from __future__ import annotations

import os

from tests.gpu_e2e.trace_kernels import newest_trace, parse_trace

from .arms import arm_fields, build_bodies, make_prompts, seed_of
from .client import http_json, run_load
from .common import log
from .servers import server_unavailable

GRAPH_PLAN = [  # (label, server, kind of traffic)
    ("stock / unsteered", "stock", "plain"),
    ("disabled / unsteered", "disabled", "plain"),
    ("steer / unsteered (enabled_idle)", "steer", "plain"),
    ("steer / per_request_n4", "steer", "per_request"),
    ("sae / unsteered (sae_idle)", "sae", "plain"),
    ("sae_full / unsteered (sae_full_idle)", "sae_full", "plain"),
    ("steer_cond / unsteered (cond_idle)", "steer_cond", "plain"),
    ("steer_cond / cond_n4", "steer_cond", "cond"),
]


def graph_phase(pool, ctx: dict, results: dict, save) -> None:
    res = results.setdefault("graph", {})
    for label, sname, kind in [p for p in GRAPH_PLAN if p[1] in ctx["graph_servers"]]:
        why = server_unavailable(sname, ctx["args"])
        if why:
            log(f"[graph] skipping {label}: {why}")
            continue
        try:
            server = pool.get(sname)
            before = set(server.prof_dir.rglob("*.json*"))
            n, mt = int(os.environ.get("GRAPH_REQUESTS", "4")), 16
            prompts = make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of("graph", label))
            fields = arm_fields({"kind": kind, "n_configs": 4}, n, seed_of("graph", label, "v"), ctx)
            bodies = build_bodies(prompts, fields, mt)
            run_load(server, bodies, n)  # warm: rows resident, nothing new compiled in the window
            fields = arm_fields({"kind": kind, "n_configs": 4}, n, seed_of("graph", label, "v2"), ctx)
            bodies = build_bodies(make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"],
                                               seed_of("graph", label, 2)), fields, mt)
            st, _ = http_json("POST", server.base + "/start_profile", timeout=120)
            if st != 200:
                raise RuntimeError(f"/start_profile -> {st}")
            out, _wall = run_load(server, bodies, n)
            st, _ = http_json("POST", server.base + "/stop_profile", timeout=300)
            rec = parse_trace(newest_trace(server.prof_dir, before))
            rec["requests_steered"] = sum(1 for r in out if r.get("steering"))
            stcode, status = http_json("GET", server.base + "/v1/steering")
            rec["status_http"] = stcode
            if stcode == 200 and isinstance(status, dict):
                ws = status.get("workers") or [{}]
                rec["status_ops"] = ws[0].get("ops")
                rec["status_enabled"] = status.get("enabled")
            else:
                rec["status_ops"] = f"HTTP {stcode}"
            res[label] = rec
            log(f"[graph] {label}: kernels {rec['kernels']} ({rec['kernel_us']} µs), graph launches "
                f"{rec['graph_launches']}, kernels/launch {rec['kernels_per_launch_hist']} (per step "
                f"{rec['kernels_per_step']}; forward graph median {rec['step_kernel_us_median']} µs GPU over "
                f"{rec['step_launches']} launches), eager kernels {rec['eager_kernels']} ({rec['eager_kernel_us']} µs), "
                f"steer kernels {rec['steer_kernels']} ({rec['steer_kernel_us']} µs; in graphs "
                f"{rec['steer_kernels_in_graphs']}, per step {rec['steer_kernels_per_step']}), "
                f"/v1/steering ops {rec['status_ops']}")
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            log(f"[graph] {label}: error {e}")
        save()
