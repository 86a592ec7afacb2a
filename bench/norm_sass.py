#!/usr/bin/env python3
"""The steered norm's compiled code for an H100 (sm_90), on the CPU: each named configuration compiled by Triton's
ptxas with ``tests/interpreted/compile_sm90.py``'s stand-in driver (nothing launched), its PTX, SASS (Triton's
nvdisasm) and TTGIR written under --out, and its skeleton printed: the global loads, branches and barriers in
program order, so the dependent rounds of small loads a launch waits on can be counted (issue 38: the late
projection kernel waits on one round more than the kernel without projections, EARLY, the default, on one round;
README "EARLY loads"); ``ar``: the plain site with the TP all-reduce inside (group of two): its pushes, the loads in
flight and the spin loops in order; ``cond`` / ``cond_proj``: a conditions server's site (the gated path).
    PYTHONPATH=src:. .venv/bin/python bench/norm_sass.py --out /tmp/norm_sass steered proj proj_late
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

CASES = ("steered", "steered_late", "proj", "proj_late", "ar", "cond", "cond_proj")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"any of {', '.join(CASES)}")
    ap.add_argument("--out", default="norm_sass")
    ap.add_argument("--d", type=int, default=4096)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["VLLM_STEER_SM90_OUT"] = str(out)
    import tests.interpreted.compile_sm90  # noqa: F401 - the compile-only driver (sm_90)
    import torch

    from vllm_steer.kernels.steered_rms_norm import triton as kernel

    d, rows, n = args.d, 272, 16
    x = torch.randn(n, d).to(torch.bfloat16)
    w, table = torch.ones(d, dtype=torch.bfloat16), torch.zeros(rows, d, dtype=torch.bfloat16)
    on, index = torch.ones(1, dtype=torch.uint8), torch.zeros(n, dtype=torch.int32)
    proj = (torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, 1, d), torch.zeros(rows, 1, 2))
    both = dict(proj_a=proj, proj_b=proj)
    buf = torch.zeros(2, 2, 64, d, dtype=torch.bfloat16)  # a TP group of two's workspace, as the kernel sees it
    ar = type("Workspace", (), dict(world=2, rank=0, max_tokens=64, hidden=d, buf=buf,
                                    flags=torch.zeros(2, dtype=torch.int32),
                                    buf_ptrs=torch.tensor([buf.data_ptr()] * 2, dtype=torch.int64)))()
    # a conditions server's site (its gated path: the slots' edits after the gate weights)
    cond = (torch.full((rows,), -1, dtype=torch.int32), torch.zeros(rows, 4), torch.zeros(rows, d),
            torch.tensor([20, 21], dtype=torch.int32))
    gated = dict(cond=cond, gate=torch.zeros(n), early=True)
    configs = {"steered": dict(early=True), "steered_late": dict(early=False), "proj": dict(both, early=True),
               "proj_late": dict(both, early=False), "ar": dict(early=True, ar=ar), "cond": gated,
               "cond_proj": dict(gated, **both)}
    for name in args.cases:
        fn = kernel._steered_norm_kernel
        seen = {id(c) for cache in fn.device_caches.values() for c in cache[0].values()}
        kernel.steered_norm_triton(x, x, w, 1e-5, 0.0, index, (table, on), (table, on), **configs[name])
        compiled = [c for cache in fn.device_caches.values() for c in cache[0].values() if id(c) not in seen][-1]
        for kind in ("ptx", "ttgir", "sass"):
            (out / f"{name}.{kind}").write_text(compiled.asm[kind])
        sass = compiled.asm["sass"]
        skeleton = [m.group(1) for m in re.finditer(r"((?:@!?P\d+ )?(?:LDG\S*|BRA|BAR\S*|STG\S*|EXIT)\b[^;]*)", sass)]
        print(f"== {name}: {sass.count(chr(10))} SASS lines, {sum('LDG' in s for s in skeleton)} global loads, "
              f"{sum('BRA' in s for s in skeleton)} branches, {sum('BAR' in s for s in skeleton)} barriers")
        for line in skeleton[:40]:
            print("   ", line.strip()[:90])
    return 0


if __name__ == "__main__":
    sys.exit(main())
