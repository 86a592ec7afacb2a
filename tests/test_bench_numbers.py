"""bench/NUMBERS.md is what bench/numbers.json and the result JSONs it names give: regenerated here and
compared byte for byte, and one row's figures recomputed from the raw trials without the kit."""

from __future__ import annotations

import json
import sys

import numpy as np

from tests.engine_job import ROOT

if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

from abkit import numbers  # noqa: E402


def test_the_committed_page_is_the_generated_one():
    manifest = json.loads(numbers.MANIFEST.read_text())
    assert numbers.render(manifest) == numbers.PAGE.read_text(), (
        "bench/NUMBERS.md is out of date: run python3 bench/ab_suite.py --numbers")


def test_a_row_equals_its_trials_recomputed():
    """The 8b split-walk SAE row: paired TPOT Δ% from the per-trial medians, by hand."""
    row = {"scenario": "x", "file": "results/2026-11-24-s12/sae/ab_sae.json", "arm": "sae_delta_n16"}
    cells = numbers.arm_row(row, [])
    arms = json.loads((numbers.BENCH / row["file"]).read_text())["phases"]["ab"]

    def by_trial(label):
        return {t["trial"]: t["tpot_median_ms"] for t in arms[label]["trials"] if not t.get("check")}

    arm, ref = by_trial("sae_delta_n16"), by_trial("stock")
    pct = np.array([100 * (arm[k] / ref[k] - 1) for k in sorted(set(arm) & set(ref))])
    mean, sem = pct.mean(), pct.std(ddof=1) / np.sqrt(len(pct))
    assert cells[1] == "`sae_delta_n16` vs `stock`" and cells[2] == str(len(pct))
    assert cells[3].startswith(f"{mean:+.2f}% ± {sem:.2f}")
    assert cells[6] == "H100" and cells[7] == "2026-11-25"
