"""Statistics of the A/B suite: per-trial summaries, mean / SEM over trials, deltas between arms
(of the means, and paired: trial k of an arm against trial k of its reference)."""

from __future__ import annotations

import math
import statistics

METRICS = [("throughput", "tok/s"), ("ttft_median_ms", "ms"), ("ttft_p99_ms", "ms"), ("tpot_median_ms", "ms"),
           ("tpot_p99_ms", "ms"), ("e2el_median_ms", "ms"), ("e2el_p99_ms", "ms")]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize_trial(res: list[dict], wall: float, steered: bool) -> dict:
    ok = [r for r in res if "error" not in r]
    errs = [r["error"] for r in res if "error" in r]
    t = {
        "n": len(res), "ok": len(ok), "errors": errs[:3], "n_errors": len(errs),
        "wall_s": round(wall, 4),
        "output_tokens": sum(r["out"] for r in ok),
        "throughput": sum(r["out"] for r in ok) / wall if wall > 0 else float("nan"),
    }
    for m in ("ttft", "tpot", "e2el"):
        xs = [r[m] * 1e3 for r in ok]  # ms
        t[f"{m}_median_ms"] = statistics.median(xs) if xs else float("nan")
        t[f"{m}_p99_ms"] = pct(xs, 0.99)
    good = [r for r in ok if r.get("steering") and r["steering"].get("prefill") and r["steering"].get("decode")]
    t["steering_applied"] = len(good)
    t["steering_expected"] = len(res) if steered else 0
    t["unexpected_steering"] = 0 if steered else sum(1 for r in ok if r.get("steering"))
    t["per_request"] = {m: [round(r[m] * 1e3, 3) for r in ok] for m in ("ttft", "tpot", "e2el")}
    return t


def mean_sem(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    s = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return m, s


def arm_stats(entry: dict) -> dict:
    trials = [t for t in entry.get("trials", []) if not t.get("check")]
    return {m: mean_sem([t[m] for t in trials]) for m, _ in METRICS} | {"n_trials": len(trials)}


def delta(a: tuple, b: tuple) -> dict:
    (ma, sa), (mb, sb) = a, b
    d = ma - mb
    se = math.sqrt((sa if sa == sa else 0) ** 2 + (sb if sb == sb else 0) ** 2)
    return {"delta": d, "pct": 100 * d / mb if mb else float("nan"), "se": se,
            "se_pct": 100 * se / mb if mb else float("nan"), "significant": abs(d) > 2 * se if se > 0 else False}


def _counted_trials(entry: dict) -> dict[int, dict]:
    """Trials that count (no failed check) by trial index (position for records without one)."""
    trials = entry.get("trials", [])
    return {t["trial"] if t.get("trial") is not None else k: t for k, t in enumerate(trials) if not t.get("check")}


def paired_pct(entry: dict, ref: dict, metric: str) -> dict:
    """Per-trial ``arm_k / ref_k - 1`` in % over the trial indices both ran; mean, SEM and whether
    |mean| > 2 SEM."""
    a, r = _counted_trials(entry), _counted_trials(ref)
    ks = [k for k in sorted(set(a) & set(r)) if r[k][metric] and r[k][metric] == r[k][metric]]
    vals = [100 * (a[k][metric] / r[k][metric] - 1) for k in ks]
    m, s = mean_sem(vals)
    return {"trials": ks, "pct": vals, "mean": m, "sem": s, "significant": s == s and s > 0 and abs(m) > 2 * s}
