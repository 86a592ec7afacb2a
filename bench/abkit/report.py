"""The markdown report of one or more result JSONs of the A/B suite.

Tables: per ab phase the arms' mean ± SEM over trials, the deltas against the reference arm
(``stock``; ``stock_c256`` for the wide load; ``stock@mtN`` for ``…@mtN`` labels), and the paired
per-trial deltas against the same reference (trial k of the arm against trial k of the reference:
interleaved, so close in time); the graph phase's kernel counts.
"""

from __future__ import annotations

import json
from pathlib import Path

from .arms import ARMS
from .servers import MULTI_SUFFIX
from .stats import METRICS, arm_stats, delta, paired_pct

AB_PHASES = ("ab",)


def _wide(arm: str) -> bool:
    return ARMS.get(arm, {}).get("wide", "c256" in arm or arm.startswith("k256"))


def reference_label(phase: str, label: str, entry: dict) -> str | None:
    phase = phase.split("#")[0]
    if phase == "ab":
        multi = MULTI_SUFFIX if entry["arm"].endswith(MULTI_SUFFIX) else ""
        if "@" in label:
            return f"stock{multi}@" + label.split("@", 1)[1]
        return ("stock_c256" if _wide(entry["arm"]) else "stock") + multi
    return None


def references(ph: str, label: str, e: dict, stats: dict) -> list[str]:
    """The label ``label`` is compared with (its reference arm), if that has counted trials."""
    ref = reference_label(ph, label, e)
    return [ref] if ref is not None and ref != label and ref in stats and stats[ref]["n_trials"] else []


def fmt(m: float, s: float, nd: int = 2) -> str:
    if m != m:
        return "—"
    return f"{m:.{nd}f} ± {s:.{nd}f}" if s == s else f"{m:.{nd}f}"


def fmt_delta(d: dict, unit: str) -> str:
    if d["delta"] != d["delta"]:
        return "—"
    mark = " **\\***" if d["significant"] else ""
    nd = 1 if unit == "tok/s" else 2
    return f"{d['delta']:+.{nd}f} ({d['pct']:+.2f}% ± {d['se_pct']:.2f}){mark}"


def fmt_cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "—"
        a = abs(v)
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return "0" if v == 0 else f"{v:.3g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=str)[:80].replace("|", "/")
    return str(v).replace("|", "/").replace("\n", " ")


def merge(paths: list[str]) -> dict:
    merged: dict = {"phases": {}, "meta": []}
    for p in paths:
        d = json.loads(Path(p).read_text())
        merged["meta"].append(d.get("meta", {}))
        for ph, v in d.get("phases", {}).items():
            if not isinstance(v, dict):
                merged["phases"][ph] = v
                continue
            name, k = ph, 2
            while name in merged["phases"] and set(v) & set(merged["phases"][name]):
                name, k = f"{ph}#{k}", k + 1  # same arms again (another run): keep it apart
            merged["phases"].setdefault(name, {}).update(v)
    return merged


def _phases(merged: dict, base: str) -> list[str]:
    return sorted(ph for ph in merged["phases"] if ph.split("#")[0] == base)


def ab_tables(merged: dict, lines: list[str]) -> None:
    order = [ph for ph in merged["phases"] if ph.split("#")[0] in AB_PHASES]
    for ph in sorted(order, key=lambda x: (AB_PHASES.index(x.split("#")[0]), x)):
        arms = merged["phases"].get(ph)
        if not arms:
            continue
        lines.append(f"\n#### Phase `{ph}`\n")
        lines.append("| arm | trials | output tok/s | TTFT med ms | TTFT p99 ms | TPOT med ms | TPOT p99 ms "
                     "| E2EL med ms | E2EL p99 ms |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        stats = {label: arm_stats(e) for label, e in arms.items()}
        for label, e in arms.items():
            s = stats[label]
            if e.get("failed"):
                lines.append(f"| {label} | FAILED: {e['failed'][:120]} | | | | | | | |")
                continue
            cells = [fmt(*s["throughput"], 1)] + [fmt(*s[m]) for m, _ in METRICS[1:]]
            lines.append(f"| {label} | {s['n_trials']} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("Deltas against the reference arm (mean of per-trial values; ± is the combined SEM; "
                     "**\\*** marks |Δ| > 2·SE):\n")
        lines.append("| arm | vs | Δ output tok/s | Δ TTFT med ms | Δ TPOT med ms | Δ TPOT p99 ms | Δ E2EL med ms "
                     "| Δ E2EL p99 ms |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for label, e in arms.items():
            if e.get("failed") or not stats[label]["n_trials"]:
                continue
            for ref in references(ph, label, e, stats):
                s, r = stats[label], stats[ref]
                ds = {m: delta(s[m], r[m]) for m, _ in METRICS}
                lines.append(f"| {label} | {ref} | " + " | ".join(
                    fmt_delta(ds[m], u) for m, u in METRICS if m not in ("ttft_p99_ms",)) + " |")
        paired_table(ph, arms, stats, lines)
        if ph.startswith("ab") and "k256" in stats and "disabled_c256" in stats:
            k, dd = stats["k256"]["throughput"], stats["disabled_c256"]["throughput"]
            if k[0] == k[0] and dd[0]:
                lines.append(f"\nk256 / disabled_c256 output throughput: {k[0] / dd[0] * 100:.1f}%")


PAIRED_METRICS = ("tpot_median_ms", "throughput")  # the columns of the paired table


def fmt_paired(p: dict) -> tuple[str, str]:
    """(per-trial values, mean ± SEM with the mark) of a paired_pct result."""
    if not p["pct"]:
        return "—", "—"
    mark = " **\\***" if p["significant"] else ""
    per = ", ".join(f"{v:+.1f}" for v in p["pct"])
    return per, f"{p['mean']:+.2f}% ± {p['sem']:.2f}{mark}" if p["sem"] == p["sem"] else f"{p['mean']:+.2f}%"


def paired_table(ph: str, arms: dict, stats: dict, lines: list[str]) -> None:
    """Paired per-trial Δ% of every arm against its references (trial k vs trial k)."""
    rows = []
    for label, e in arms.items():
        if e.get("failed") or not stats[label]["n_trials"]:
            continue
        for ref in references(ph, label, e, stats):
            ps = [paired_pct(e, arms[ref], m) for m in PAIRED_METRICS]
            cells = [c for p in ps for c in fmt_paired(p)]
            rows.append(f"| {label} | {ref} | {len(ps[0]['trials'])} | " + " | ".join(cells) + " |")
    if not rows:
        return
    lines.append("\nPaired TPOT median Δ% per trial (trial k of the arm / trial k of the reference − 1, in %; "
                 "trials interleave, so each pair ran close in time; mean ± SEM over the pairs; "
                 "**\\*** marks |mean| > 2·SEM), and the same for output throughput:\n")
    lines.append("| arm | vs | pairs | TPOT med Δ% per trial | TPOT med Δ% mean ± SEM | output tok/s Δ% per trial "
                 "| output tok/s Δ% mean ± SEM |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    lines += rows


def _hist(h) -> str:
    if not h:
        return "—"
    items = sorted(h.items(), key=lambda kv: -kv[1])[:6]
    more = "" if len(h) <= 6 else f", +{len(h) - 6} more"
    return ", ".join(f"{k}×{v}" for k, v in items) + more


def graph_table(merged: dict, lines: list[str]) -> None:
    for ph in _phases(merged, "graph"):
        g = merged["phases"][ph]
        lines.append(f"\n#### Phase `{ph}` (torch.profiler via /start_profile, kernels in the window; steer kernels: "
                     "name contains steer / apply_steering / capture_rows)\n")
        lines.append("| server / requests | kernels | all kernels GPU µs | cudaGraphLaunch calls | kernels per launch "
                     "(value×launches) | kernels per step (mode) | eager kernels | eager GPU µs | steer kernels "
                     "| steer kernels in graphs | steer kernels per step | steer GPU µs | /v1/steering ops |")
        lines.append("| --- " * 13 + "|")
        for label, e in g.items():
            if "error" in e:
                lines.append(f"| {label} | error: {fmt_cell(e['error'][:100])} |" + " |" * 11)
                continue
            cells = [e.get("kernels"), e.get("kernel_us"), e.get("graph_launches"),
                     _hist(e.get("kernels_per_launch_hist")), e.get("kernels_per_step"), e.get("eager_kernels"),
                     e.get("eager_kernel_us"), e.get("steer_kernels"), e.get("steer_kernels_in_graphs"),
                     e.get("steer_kernels_per_step"), e.get("steer_kernel_us"), e.get("status_ops")]
            lines.append(f"| {label} | " + " | ".join(c if isinstance(c, str) and "×" in c else fmt_cell(c)
                                                     for c in cells) + " |")


def error_lines(merged: dict, lines: list[str]) -> None:
    for name, err in (merged["phases"].get("server_errors") or {}).items():
        lines.append(f"\nServer `{name}` did not start: {fmt_cell(str(err)[-300:])}")
    err = merged["phases"].get("error")
    if isinstance(err, str):
        lines.append("\nThe suite stopped on an error:\n\n```\n" + err[-1500:] + "\n```")


def report(paths: list[str], md_path: str | None) -> str:
    merged = merge(paths)
    lines: list[str] = []
    error_lines(merged, lines)
    ab_tables(merged, lines)
    graph_table(merged, lines)
    text = "\n".join(lines) + "\n"
    if md_path:
        Path(md_path).write_text(text)
    return text
