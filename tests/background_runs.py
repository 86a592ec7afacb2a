"""Pytest runs in a subprocess that a test waits on (the kernels under Triton's interpreter, their sm_90 compile):
started when the session's collection ends, at the lowest CPU priority, so they use the time the other tests leave
idle (on CI's 2 cores the engines are pinned to core 0 and most tests wait on HTTP), and awaited by the test that
owns them. Run alone, a test starts its run when it asks for the result (the same as before)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.engine_job import ROOT, die_with_parent

INTERPRETED = str(ROOT / "tests" / "interpreted")
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def _interpreted(out: Path) -> tuple[list[str], dict[str, str]]:
    # TRITON_INTERPRET must be set before Triton is first imported: a process of its own
    return [*PYTEST, INTERPRETED], {**os.environ, "TRITON_INTERPRET": "1"}


def _compile_sm90(out: Path) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"VLLM_STEER_SM90_OUT": str(out)}
    return [*PYTEST, "-p", "tests.interpreted.compile_sm90", INTERPRETED], env


RUNS = {"interpreted": _interpreted, "compile_sm90": _compile_sm90}
# the test that awaits each run: a session that collects it starts the run at once
OWNERS = {"tests/test_steered_norm.py::test_triton_kernels_match_reference_under_the_interpreter": "interpreted",
          "tests/test_kernels_compile.py::test_every_kernel_the_interpreted_tests_launch_compiles_for_an_h100":
              "compile_sm90"}


@dataclass
class Run:
    proc: subprocess.Popen
    out: Path  # the run's own folder (files it writes; its output in log.txt)
    log: IO[str]


_runs: dict[str, Run] = {}


def start(name: str) -> Run:
    """Start run ``name`` (once), niced to 19: it takes only CPU time nothing else wants."""
    if name not in _runs:
        out = Path(tempfile.mkdtemp(prefix=f"vllm-steer-{name}-"))
        argv, env = RUNS[name](out)
        log = open(out / "log.txt", "w+")

        def _child() -> None:
            os.nice(19)
            die_with_parent()

        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child)
        _runs[name] = Run(proc, out, log)
    return _runs[name]


def start_owned(nodeids: list[str]) -> None:
    """At the end of collection: start the runs whose owning tests are in the session."""
    for nodeid in nodeids:
        if nodeid in OWNERS:
            start(OWNERS[nodeid])


def result(name: str, timeout_s: float = 900) -> tuple[int, str, Path]:
    """Wait for run ``name`` (starting it if no one did): its exit status, its output and its folder."""
    run = start(name)
    try:
        run.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
    run.log.seek(0)
    return run.proc.returncode, run.log.read(), run.out


def stop_all() -> None:
    """At the session's end: no run outlives it (a session stopped early, a failed owner), nor its folder."""
    for run in _runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        run.log.close()
        shutil.rmtree(run.out, ignore_errors=True)
    _runs.clear()
