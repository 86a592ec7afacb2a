"""Running arms: one load of an arm, the warm-up steering check, interleaved trials, progress lines.

Every trial record carries its index (``trial``), so the report can pair trial k of an arm with
trial k of its reference (they ran close in time: the order rotates per trial).
"""

from __future__ import annotations

import time

from . import common
from .arms import ARMS, arm_fields, build_bodies, ensure_modules, expects_steering_field, make_prompts, seed_of
from .client import run_load
from .common import log
from .stats import summarize_trial


def one_run(pool, arm_name: str, load: dict, trial: int, phase: str, ctx: dict, warmup: bool = False) -> dict:
    arm = ARMS[arm_name]
    server = pool.get(arm["server"])
    ensure_modules(server, arm, ctx)
    n, conc, mt = load["requests"], load["concurrency"], load["max_tokens"]
    if warmup:
        n, mt = min(n, load["concurrency"], 32) if not arm.get("wide") else n, min(mt, 8)
    tag = "warmup" if warmup else f"t{trial}"
    prompts = make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of(phase, arm_name, tag, mt))
    fields = arm_fields(arm, n, seed_of(phase, arm_name, tag, "vec"), ctx)
    bodies = build_bodies(prompts, fields, mt, arm.get("wire", "json"))
    res, wall = run_load(server, bodies, conc)
    t = summarize_trial(res, wall, expects_steering_field(arm))
    t["trial"] = None if warmup else trial
    t["body_bytes_mean"] = int(sum(map(len, bodies)) / len(bodies))
    return t


def check_steering(t: dict, arm_name: str) -> str | None:
    """Request errors; a steering field missing on a steered arm (not hotwire: it reports none) or
    present on an unsteered one."""
    steered = expects_steering_field(ARMS[arm_name])
    if t["n_errors"]:
        return f"{t['n_errors']} request errors, e.g. {t['errors'][:1]}"
    if steered and t["steering_applied"] != t["n"]:
        return f"steering field missing/null on {t['n'] - t['steering_applied']} of {t['n']} responses"
    if not steered and t["unexpected_steering"]:
        return f"{t['unexpected_steering']} unsteered responses carry a steering field"
    return None


def progress(phase: str, label: str, trial: int, trials: int, t: dict) -> None:
    log(f"[{phase}] trial {trial + 1}/{trials} {label:<28} tput {t['throughput']:9.1f} tok/s | "
        f"TTFT med {t['ttft_median_ms']:8.2f} p99 {t['ttft_p99_ms']:8.2f} ms | "
        f"TPOT med {t['tpot_median_ms']:7.3f} p99 {t['tpot_p99_ms']:7.3f} ms | "
        f"E2EL med {t['e2el_median_ms']:9.1f} ms | steering {t['steering_applied']}/{t['steering_expected']}"
        f" | err {t['n_errors']} | {t['wall_s']:.2f} s")


def run_matrix(pool, phase: str, runs: list[tuple[str, str, dict]], trials: int, ctx: dict,
               results: dict, save) -> None:
    """runs: (label, arm, load). Warm-up + steering check per run, then trials interleaved
    (the order rotates every trial)."""
    res = results.setdefault(phase, {})
    live = []
    for label, arm, load in runs:
        entry = res.setdefault(label, {"arm": arm, "load": load, "trials": []})
        try:
            if ARMS[arm]["server"] not in pool.servers:
                pool.ensure([ARMS[arm]["server"]])
            t = one_run(pool, arm, load, 0, phase, ctx, warmup=True)
            problem = check_steering(t, arm)
            entry["warmup"] = {k: v for k, v in t.items() if k != "per_request"}
            if problem:
                entry["failed"] = f"warm-up check: {problem}"
                log(f"[{phase}] {label}: FAILED warm-up check: {problem}")
                continue
            log(f"[{phase}] {label}: warm-up ok ({t['n']} requests, steering {t['steering_applied']}/"
                f"{t['steering_expected']}, body {t['body_bytes_mean']} B)")
            live.append((label, arm, load))
        except Exception as e:  # noqa: BLE001
            entry["failed"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"[{phase}] {label}: FAILED: {entry['failed']}")
        save()
    est: dict[str, float] = {}
    for trial in range(trials):
        k = trial % max(1, len(live))
        order = live[k:] + live[:k]
        for label, arm, load in order:
            need = est.get(label, 5.0) * 1.3 + ctx["reserve_s"]
            if time.time() - common.T0 + need > ctx["deadline_s"]:
                log(f"[{phase}] {label}: skipping trial {trial + 1} (deadline)")
                res[label].setdefault("skipped_trials", []).append(trial)
                continue
            t_start = time.time()
            try:
                t = one_run(pool, arm, load, trial, phase, ctx)
            except Exception as e:  # noqa: BLE001
                res[label].setdefault("run_errors", []).append(f"{type(e).__name__}: {e}"[:500])
                log(f"[{phase}] {label}: trial {trial + 1} error {e}")
                continue
            est[label] = time.time() - t_start
            problem = check_steering(t, arm)
            if problem:
                t["check"] = problem
            res[label]["trials"].append(t)
            progress(phase, label, trial, trials, t)
            save()
