"""The PNG of the A/B deltas (one panel per metric; red bars: |Δ| > 2·SE)."""

from __future__ import annotations

from .common import log


def plot(deltas: list[tuple[str, dict]], png_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    panels = [("throughput", "Δ output throughput (%)"), ("tpot_median_ms", "Δ TPOT median (%)"),
              ("e2el_median_ms", "Δ E2EL median (%)"), ("ttft_median_ms", "Δ TTFT median (ms)")]
    labels = [l for l, _ in deltas]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.35 * len(labels) + 2), sharey=True)
    for ax, (m, title) in zip(axes, panels):
        ys = range(len(labels))
        if m == "ttft_median_ms":
            vals = [d[m]["delta"] for _, d in deltas]
            errs = [2 * d[m]["se"] for _, d in deltas]
        else:
            vals = [d[m]["pct"] for _, d in deltas]
            errs = [2 * d[m]["se_pct"] for _, d in deltas]
        colors = ["tab:red" if d[m]["significant"] else "tab:gray" for _, d in deltas]
        ax.barh(list(ys), vals, xerr=errs, color=colors, capsize=2)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)))
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("vllm-steer vs stock (bars: mean delta; whiskers: 2·SE; red: |Δ| > 2·SE)", fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    log(f"plot written: {png_path}")
