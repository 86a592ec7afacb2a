"""Statistics over trials (mean / SEM, deltas, paired per-trial deltas) and the markdown report of result JSONs:
per ab phase the arms and their deltas against the reference arm (reference_label); the graph phase's kernels, and
its prefill rows' GPU timeline (busy / idle, copies, steps, host syncs: issue 37)."""

from __future__ import annotations

import collections
import json
import math
import statistics
from pathlib import Path

from .arms import ARMS
from .servers import MULTI_SUFFIX

METRICS = [("throughput", "tok/s"), ("ttft_median_ms", "ms"), ("ttft_p99_ms", "ms"), ("tpot_median_ms", "ms"),
           ("tpot_p99_ms", "ms"), ("e2el_median_ms", "ms"), ("e2el_p99_ms", "ms")]
GRAPH_COLUMNS = ("kernels", "kernel_us", "graph_launches", "kernels_per_launch_hist", "kernels_per_step",
                 "eager_kernels", "eager_kernel_us", "steer_kernels", "steer_kernels_in_graphs",
                 "steer_kernels_per_step", "steer_kernel_us", "step_kernel_us_median", "step_steer_us_median",
                 "status_ops")
STAR = " **\\***"


def mean_sem(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    s = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return statistics.fmean(xs), s


def arm_stats(entry: dict) -> dict:
    trials = [t for t in entry.get("trials", []) if not t.get("check")]
    return {m: mean_sem([t[m] for t in trials]) for m, _ in METRICS} | {"n_trials": len(trials)}


def delta(a: tuple, b: tuple) -> dict:
    (ma, sa), (mb, sb) = a, b
    d = ma - mb
    se = math.sqrt((sa if sa == sa else 0) ** 2 + (sb if sb == sb else 0) ** 2)
    return {"delta": d, "pct": 100 * d / mb if mb else float("nan"), "se": se,
            "se_pct": 100 * se / mb if mb else float("nan"), "significant": abs(d) > 2 * se if se > 0 else False}


def paired_pct(entry: dict, ref: dict, metric: str) -> dict:
    """Per-trial ``arm_k / ref_k - 1`` in % over the trials both ran (no failed check); mean, SEM, |mean| > 2 SEM."""
    a, r = ({t["trial"] if t.get("trial") is not None else k: t for k, t in enumerate(e.get("trials", []))
             if not t.get("check")} for e in (entry, ref))
    ks = [k for k in sorted(set(a) & set(r)) if r[k][metric] and r[k][metric] == r[k][metric]]
    vals = [100 * (a[k][metric] / r[k][metric] - 1) for k in ks]
    m, s = mean_sem(vals)
    return {"trials": ks, "pct": vals, "mean": m, "sem": s, "significant": s == s and s > 0 and abs(m) > 2 * s}


def fmt_pct(p: dict) -> str:
    if p["mean"] != p["mean"]:
        return "—"
    mark = STAR if p["significant"] else ""
    return f"{p['mean']:+.2f}% ± {p['sem']:.2f}{mark}" if p["sem"] == p["sem"] else f"{p['mean']:+.2f}%"


def reference_label(phase: str, label: str, entry: dict) -> str | None:
    if phase.split("#")[0] != "ab":
        return None
    if ref := ARMS.get(entry["arm"], {}).get("ref"):
        return None if ref == entry["arm"] else ref
    multi = MULTI_SUFFIX if entry["arm"].endswith(MULTI_SUFFIX) else ""
    if "@" in label:
        return f"stock{multi}@" + label.split("@", 1)[1]
    wide = ARMS.get(entry["arm"], {}).get("wide", "c256" in entry["arm"] or entry["arm"].startswith("k256"))
    return ("stock_c256" if wide else "stock") + multi


def fmt(m: float, s: float, nd: int = 2) -> str:
    if m != m:
        return "—"
    return f"{m:.{nd}f} ± {s:.{nd}f}" if s == s else f"{m:.{nd}f}"


def fmt_delta(d: dict, unit: str) -> str:
    if d["delta"] != d["delta"]:
        return "—"
    nd = 1 if unit == "tok/s" else 2
    return f"{d['delta']:+.{nd}f} ({d['pct']:+.2f}% ± {d['se_pct']:.2f})" + (STAR if d["significant"] else "")


def fmt_cell(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "—"
    if isinstance(v, (bool, int)):
        return str(v)
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else "0" if v == 0 else f"{v:.3g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=str)[:80].replace("|", "/")
    return str(v).replace("|", "/").replace("\n", " ")


def merge(paths: list[str]) -> dict:
    """The phases of the result JSONs; a phase that has the same arms again (another run) becomes ``<phase>#k``."""
    phases: dict = {}
    for p in paths:
        for ph, v in json.loads(Path(p).read_text()).get("phases", {}).items():
            if not isinstance(v, dict):
                phases[ph] = v
                continue
            name, k = ph, 2
            while name in phases and set(v) & set(phases[name]):
                name, k = f"{ph}#{k}", k + 1
            phases.setdefault(name, {}).update(v)
    return phases


def table(lines: list[str], header: str) -> None:
    lines += ["| " + header + " |", "| --- " * (header.count(" | ") + 1) + "|"]


def head_to_head(arms: dict, pairs: list[tuple[str, dict, str]], lines: list[str]) -> None:
    """Each arm against a peer's arm of the same reference (vLLM's extract_hidden_states for the prefill capture arms),
    trial by trial: ``arm_k / peer_k - 1`` of output throughput; the mean, and the median (one stalled trial of either
    moves the mean by its whole size)."""
    for peer, e_peer, ref in pairs:
        if ARMS.get(e_peer["arm"], {}).get("kind") != "extract_hs":
            continue
        rivals = [(label, e) for label, e, r in pairs if r == ref and label != peer]
        if not rivals:
            continue
        lines.append(f"\nHead to head against `{peer}` (output tok/s, trial k of the arm / trial k of `{peer}` − 1, in "
                     "%; mean ± SEM and median over the pairs):\n")
        table(lines, "arm | vs | pairs | per trial | mean ± SEM | median")
        for label, e in rivals:
            p = paired_pct(e, e_peer, "throughput")
            if p["pct"]:
                lines.append(f"| {label} | {peer} | {len(p['pct'])} | {', '.join(f'{v:+.1f}' for v in p['pct'])} "
                             f"| {fmt_pct(p)} | {statistics.median(p['pct']):+.2f}% |")


def ab_tables(phases: dict, lines: list[str]) -> None:
    for ph in sorted(ph for ph in phases if ph.split("#")[0] == "ab" and phases[ph]):
        arms = phases[ph]
        lines.append(f"\n#### Phase `{ph}`\n")
        table(lines, "arm | trials | output tok/s | TTFT med ms | TTFT p99 ms | TPOT med ms | TPOT p99 ms "
                     "| E2EL med ms | E2EL p99 ms")
        stats = {label: arm_stats(e) for label, e in arms.items()}
        for label, e in arms.items():
            s = stats[label]
            if e.get("failed"):
                lines.append(f"| {label} | FAILED: {e['failed'][:120]} | | | | | | | |")
                continue
            cells = [fmt(*s["throughput"], 1)] + [fmt(*s[m]) for m, _ in METRICS[1:]]
            lines.append(f"| {label} | {s['n_trials']} | " + " | ".join(cells) + " |")
        lines.append("\nDeltas against the reference arm (mean of per-trial values; ± is the combined SEM; "
                     "**\\*** marks |Δ| > 2·SE):\n")
        table(lines, "arm | vs | Δ output tok/s | Δ TTFT med ms | Δ TPOT med ms | Δ TPOT p99 ms | Δ E2EL med ms "
                     "| Δ E2EL p99 ms")
        refs = {label: reference_label(ph, label, e) for label, e in arms.items()}  # compared if it has trials
        pairs = [(label, e, refs[label]) for label, e in arms.items()
                 if not e.get("failed") and stats[label]["n_trials"] and refs[label] != label
                 and refs[label] in stats and stats[refs[label]]["n_trials"]]
        for label, _e, ref in pairs:
            ds = {m: delta(stats[label][m], stats[ref][m]) for m, _ in METRICS}
            lines.append(f"| {label} | {ref} | " + " | ".join(
                fmt_delta(ds[m], u) for m, u in METRICS if m != "ttft_p99_ms") + " |")
        if pairs:
            lines.append("\nPaired TPOT median Δ% per trial (trial k of the arm / trial k of the reference − 1, "
                         "in %; trials interleave, so each pair ran close in time; mean ± SEM over the pairs; "
                         "**\\*** marks |mean| > 2·SEM), and the same for output throughput:\n")
            table(lines, "arm | vs | pairs | TPOT med Δ% per trial | TPOT med Δ% mean ± SEM "
                         "| output tok/s Δ% per trial | output tok/s Δ% mean ± SEM")
        for label, e, ref in pairs:
            ps = [paired_pct(e, arms[ref], m) for m in ("tpot_median_ms", "throughput")]
            cells = [c for p in ps for c in ((", ".join(f"{v:+.1f}" for v in p["pct"]), fmt_pct(p))
                                            if p["pct"] else ("—", "—"))]
            lines.append(f"| {label} | {ref} | {len(ps[0]['trials'])} | " + " | ".join(cells) + " |")
        head_to_head(arms, pairs, lines)
        written = {label: [t for t in e.get("trials", []) if "bytes_written" in t] for label, e in arms.items()}
        if any(written.values()):
            lines.append("\nCaptured files (mean over trials; GB/s = bytes written / the load's wall time; lag: "
                         "after the load's last event until every request's files were complete):\n")
            table(lines, "arm | trials | prompt tok/s | GB written | write GB/s | lag s | complete | statuses | "
                  "rows dropped (records) | capture counters (sum over trials)")
            for label, ts in written.items():
                if ts:
                    m = {k: statistics.fmean(t[k] for t in ts) for k in
                         ("prompt_throughput", "bytes_written", "write_gbps", "publish_lag_s")}
                    done = f"{sum(t['files_complete'] for t in ts)}/{sum(t['files_expected'] for t in ts)}"
                    statuses, counters = collections.Counter(), collections.Counter()
                    for t in ts:
                        statuses.update(t.get("statuses", {}))
                        counters.update(t.get("capture_counters", {}))
                    dropped = sum(t.get("dropped_rows", 0) for t in ts)
                    lines.append(f"| {label} | {len(ts)} | {m['prompt_throughput']:.0f} | {m['bytes_written'] / 1e9:.2f} "
                                 f"| {m['write_gbps']:.2f} | {m['publish_lag_s']:.1f} | {done} | {_hist(statuses)} "
                                 f"| {dropped} | {_hist({k: int(v) for k, v in counters.items()})} |")
        if "k256" in stats and "disabled_c256" in stats:
            k, dd = stats["k256"]["throughput"], stats["disabled_c256"]["throughput"]
            if k[0] == k[0] and dd[0]:
                lines.append(f"\nk256 / disabled_c256 output throughput: {k[0] / dd[0] * 100:.1f}%")


def _hist(h) -> str:
    if not h:
        return "—"
    more = "" if len(h) <= 6 else f", +{len(h) - 6} more"
    return ", ".join(f"{k}×{v}" for k, v in sorted(h.items(), key=lambda kv: -kv[1])[:6]) + more


def graph_table(phases: dict, lines: list[str]) -> None:
    for ph in sorted(ph for ph in phases if ph.split("#")[0] == "graph"):
        lines.append(f"\n#### Phase `{ph}` (torch.profiler via /start_profile, kernels in the window; steer kernels: "
                     "name contains steer / apply_steering / capture_rows)\n")
        table(lines, "server / requests | kernels | all kernels GPU µs | cudaGraphLaunch calls | kernels per launch "
                     "(value×launches) | kernels per step (mode) | eager kernels | eager GPU µs | steer kernels "
                     "| steer kernels in graphs | steer kernels per step | steer GPU µs | forward GPU µs per step (median) "
                     "| steer GPU µs per step (median) | /v1/steering ops")
        for label, e in phases[ph].items():
            if "error" in e:
                lines.append(f"| {label} | error: {fmt_cell(e['error'][:100])} |" + " |" * (len(GRAPH_COLUMNS) - 1))
                continue
            cells = [_hist(e.get(k)) if k.endswith("_hist") else fmt_cell(e.get(k)) for k in GRAPH_COLUMNS]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")


def _copies(tl: dict, direction: str) -> str:
    c = (tl.get("copies") or {}).get(direction)
    if not c:
        return "—"
    under = 100 * c["under_kernels_us"] / c["us"] if c["us"] else 0.0
    return f"{c['n']} / {c['us']:.0f} µs / {c['bytes'] / 1e6:.0f} MB / {under:.0f}% under kernels"


def _calls(tl: dict, name: str) -> str:
    n, us = (tl.get("runtime_calls") or {}).get(name, (0, 0.0))
    return f"{n} / {us:.0f}" if n else "—"


def prefill_table(phases: dict, lines: list[str]) -> None:
    """One row per graph-phase prefill row: is the GPU idle between our prefill steps, or busier within them?"""
    for ph in sorted(ph for ph in phases if ph.split("#")[0] == "graph"):
        rows = {label: e for label, e in phases[ph].items() if e.get("load") == "prefill" or
                ("error" in e and "prefill" in label)}
        if not rows:
            continue
        lines.append(f"\n#### Phase `{ph}`, prefill rows (the prefill arms' load under torch.profiler; window: first "
                     "kernel start to last kernel end; busy: union of kernel intervals, every stream; gaps: idle "
                     "stretches > 50 µs; between steps: one step's last kernel to the next's first, from vLLM's "
                     "execute_context annotation; copies: n / GPU µs / MB / share of their time under a kernel; "
                     "host calls: n / µs)\n")
        table(lines, "server / load | requests (errors) | captured / files complete | prompt tok/s | prefill steps (all) | window µs | busy µs "
                     "| idle µs (%) | gaps > 50 µs (n / µs) | of them inside a step (n / µs) "
                     "| kernels the GPU waited for after them (µs, n) | of them launched late (n / µs; host "
                     "thread silent before, median µs) | busy µs per prefill step | idle µs per prefill step "
                     "| prefill step GPU µs (median) | between steps µs (median / total) "
                     "| host prefill step µs (median) | DtoH | HtoD | DtoD | memset | our kernels (n / µs) "
                     "| cudaStreamWaitEvent | cudaEventSynchronize | cudaStreamSynchronize | cudaMemcpyAsync "
                     "| kernel streams (n, µs) | top 8 kernels (µs) | trace MB")
        for label, e in rows.items():
            if "error" in e:
                lines.append(f"| {label} | error: {fmt_cell(e['error'][:100])} |" + " |" * 27)
                continue
            tl = e.get("timeline") or {}
            top = ", ".join(f"{k[:40]} {v:.0f}" for v, k in (e.get("top_kernels_us") or [])[:8])
            done = (f"files {e['files_complete']}/{e['files_expected']}" if "files_complete" in e
                    else f"{e.get('captured')} captured" if e.get("captured") else "—")
            cells = [f"{e.get('requests')} ({e.get('request_errors')})", done, fmt_cell(e.get("prompt_throughput")),
                     f"{fmt_cell(tl.get('prefill_steps'))} ({fmt_cell(tl.get('steps'))})", fmt_cell(tl.get("window_us")),
                     fmt_cell(tl.get("busy_us")), f"{fmt_cell(tl.get('idle_us'))} ({fmt_cell(tl.get('idle_pct'))}%)",
                     f"{fmt_cell(tl.get('gaps_over_50us'))} / {fmt_cell(tl.get('gaps_over_50us_us'))}",
                     " / ".join(fmt_cell(v) for v in tl.get("gaps_inside_steps") or ()) or "—",
                     ", ".join(f"{k[:40]} {us:.0f} ({n})" for us, n, k in (tl.get("gaps_before") or [])[:4]) or "—",
                     (" / ".join(fmt_cell(v) for v in tl["gaps_launched_late"])
                      + f" ({fmt_cell(tl.get('host_silence_before_late_us_median'))})") if "gaps_launched_late" in tl
                     else "—",
                     fmt_cell(tl.get("busy_us_per_prefill_step")), fmt_cell(tl.get("idle_us_per_prefill_step")),
                     fmt_cell(tl.get("prefill_step_gpu_us_median")),
                     f"{fmt_cell(tl.get('between_steps_us_median'))} / {fmt_cell(tl.get('between_steps_us_total'))}",
                     fmt_cell(tl.get("host_prefill_step_us_median")),
                     *(_copies(tl, d) for d in ("DtoH", "HtoD", "DtoD", "memset")),
                     f"{e.get('steer_kernels')} / {fmt_cell(e.get('steer_kernel_us'))}",
                     *(_calls(tl, c) for c in ("cudaStreamWaitEvent", "cudaEventSynchronize", "cudaStreamSynchronize",
                                               "cudaMemcpyAsync")),
                     fmt_cell(tl.get("kernel_streams")), fmt_cell(top) if top else "—",
                     f"{e['trace_bytes'] / 1e6:.1f}" if e.get("trace_bytes") else "—"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")


def host_table(phases: dict, lines: list[str]) -> None:
    for ph in sorted(ph for ph in phases if ph.split("#")[0] == "host"):
        lines.append(f"\n#### Phase `{ph}` (py-spy: host CPU ms per engine step under the arm's load)\n")
        table(lines, "arm | process | steps | active ms/step | vllm_steer ms/step | threads ms/step | top vllm_steer frames")
        for arm, rec in phases[ph].items():
            if not isinstance(rec, dict) or "error" in rec:
                lines.append(f"| {arm} | error: {fmt_cell(str(rec.get('error') if isinstance(rec, dict) else rec)[:100])} "
                             "| | | | | |")
                continue
            for role, p in rec["processes"].items():
                threads = ", ".join(f"{t} {v}" for t, v in (p.get("threads_ms_per_step") or {}).items())
                top = ", ".join(f"{f} {n}" for f, n in (p.get("top_vllm_steer") or [])[:4])
                lines.append(f"| {arm} | {role} | {rec['steps']} | {fmt_cell(p.get('active_ms_per_step'))} | "
                             f"{fmt_cell(p.get('vllm_steer_ms_per_step'))} | {fmt_cell(threads)} | {fmt_cell(top)} |")


def report(paths: list[str], md_path: str | None) -> str:
    phases = merge(paths)
    lines = [f"\nServer `{name}` did not start: {fmt_cell(str(err)[-300:])}"
             for name, err in (phases.get("server_errors") or {}).items()]
    if isinstance(phases.get("error"), str):
        lines.append("\nThe suite stopped on an error:\n\n```\n" + phases["error"][-1500:] + "\n```")
    ab_tables(phases, lines)
    graph_table(phases, lines)
    prefill_table(phases, lines)
    host_table(phases, lines)
    text = "\n".join(lines) + "\n"
    if md_path:
        Path(md_path).write_text(text)
    return text
