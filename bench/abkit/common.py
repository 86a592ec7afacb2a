"""Shared bits of the kit: repository paths, the log clock, the results folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root
BENCH = ROOT / "bench"
T0 = time.time()  # the suite's clock: log lines and the --deadline-s budget count from here
_LOG = {"name": "ab", "clock": True}


def set_log(name: str, clock: bool = True) -> None:
    """Prefix of log lines: ``[name  12.3s]`` with the clock, ``[name]`` without."""
    _LOG["name"], _LOG["clock"] = name, clock


def log(*a) -> None:
    if _LOG["clock"]:
        print(f"[{_LOG['name']} {time.time() - T0:7.1f}s]", *a, flush=True)
    else:
        print(f"[{_LOG['name']}]", *a, flush=True)


def out_dir(default: str | Path = ".") -> Path:
    """$OUT if set, else ``default``; created."""
    d = Path(os.environ.get("OUT") or default)
    d.mkdir(parents=True, exist_ok=True)
    return d

