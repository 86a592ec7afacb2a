"""The ``kernel`` phase: runs ``bench/kernels_bench.py --out <json>`` (when that script exists) in a
subprocess and keeps its JSON as results["kernel"]; the report renders its ``rows`` generically."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import BENCH, log

KERNELS_BENCH = BENCH / "kernels_bench.py"


def kernel_phase(args, results: dict, save) -> None:
    if not KERNELS_BENCH.exists():
        results["kernel"] = {"skipped": f"{KERNELS_BENCH.relative_to(BENCH.parent)} not found"}
        log(f"[kernel] skipped: {KERNELS_BENCH} not found")
        save()
        return
    out = Path(tempfile.mkdtemp(prefix="kernels_bench_")) / "kernels.json"
    cmd = [sys.executable, str(KERNELS_BENCH), "--out", str(out)] + shlex.split(args.kernel_args or "")
    if args.quick_kernel:
        if "--quick" in KERNELS_BENCH.read_text(errors="replace"):
            cmd.append("--quick")
        else:
            log("[kernel] --quick-kernel ignored: kernels_bench.py has no --quick")
    log(f"[kernel] {' '.join(cmd)}")
    try:
        subprocess.run(cmd, check=True, timeout=args.kernel_timeout, cwd=str(BENCH.parent))
        results["kernel"] = json.loads(out.read_text())
        if not isinstance(results["kernel"], dict):
            results["kernel"] = {"rows": results["kernel"]} if isinstance(results["kernel"], list) else \
                {"value": results["kernel"]}
    except Exception as e:  # noqa: BLE001
        results["kernel"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        log("[kernel] error", e)
    save()
