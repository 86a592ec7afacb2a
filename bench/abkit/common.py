"""Shared bits of the kit: repository paths, the log clock, the results folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root
BENCH = ROOT / "bench"
T0 = time.time()  # the suite's clock: log lines and the --deadline-s budget count from here


def log(*a) -> None:
    print(f"[ab {time.time() - T0:7.1f}s]", *a, flush=True)


def out_dir(default: str | Path = ".") -> Path:
    """$OUT if set, else ``default``; created."""
    d = Path(os.environ.get("OUT") or default)
    d.mkdir(parents=True, exist_ok=True)
    return d

