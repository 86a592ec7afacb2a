"""Subprocess test suites that run beside the main pytest session: the Triton interpreter's run of ``tests/interpreted``
(``test_steered_norm``) and its sm_90 compile-only run (``test_kernels_compile``), each minutes of one core.

vLLM's CPU engines run on core 0 by default (NOTES, Traps), so on CI's two cores the second one is mostly idle while
the engine tests run. ``start_for`` (conftest's ``pytest_collection_finish``) starts the suites whose tests the session
collected, one after another in one thread, each process at nice 19 so the engine tests keep their cores; a test
calls ``result`` and waits for its suite (starting it then if nothing did: a test run alone costs what it did)."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NICE = 19


@dataclass
class Suite:
    argv: list[str]
    env: dict[str, str]
    timeout_s: float
    out: Path | None = None  # a folder the suite writes into (compile_sm90's VLLM_STEER_SM90_OUT)
    done: threading.Event = field(default_factory=threading.Event)
    proc: subprocess.CompletedProcess | None = None
    error: str = ""


def _suites() -> dict[str, Suite]:
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    out = Path(tempfile.mkdtemp(prefix="vllm-steer-sm90-"))
    no_interpret = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {
        # the kernels against their references on CPU: TRITON_INTERPRET=1 before Triton is first imported
        "interpreted": Suite(pytest_argv + [str(ROOT / "tests" / "interpreted")],
                             {**os.environ, "TRITON_INTERPRET": "1"}, 900),
        # every launch of the same tests compiled for sm_90, nothing run (tests/interpreted/compile_sm90.py)
        "sm90": Suite(pytest_argv + ["-p", "tests.interpreted.compile_sm90", str(ROOT / "tests" / "interpreted")],
                      no_interpret | {"VLLM_STEER_SM90_OUT": str(out)}, 1200, out),
    }


# the test (node id's end) that reads each suite
READERS = {"test_steered_norm.py::test_triton_kernels_match_reference_under_the_interpreter": "interpreted",
           "test_kernels_compile.py::test_every_kernel_the_interpreted_tests_launch_compiles_for_an_h100": "sm90"}
_SUITES: dict[str, Suite] = {}
_RUNNING: list[subprocess.Popen] = []
_lock = threading.Lock()


def _run(names: list[str]) -> None:
    for name in names:
        s = _SUITES[name]
        try:
            # coreutils' nice, not a preexec_fn (unsafe in a process with threads)
            p = subprocess.Popen(["nice", "-n", str(NICE), *s.argv], cwd=ROOT, env=s.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            _RUNNING.append(p)
            try:
                stdout, _ = p.communicate(timeout=s.timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, _ = p.communicate()
                s.error = f"timed out after {s.timeout_s:.0f} s"
            s.proc = subprocess.CompletedProcess(s.argv, p.returncode, stdout, "")
        except Exception as exc:  # noqa: BLE001 - the reading test reports it
            s.error = f"{type(exc).__name__}: {exc}"
        finally:
            s.done.set()


def _start(names: list[str]) -> None:
    with _lock:
        names = [n for n in names if n not in _SUITES]
        if not names:
            return
        defined = _suites()
        for n in names:
            _SUITES[n] = defined[n]
    threading.Thread(target=_run, args=(names,), name="vllm-steer-background-suites", daemon=True).start()


def start_for(node_ids: list[str]) -> None:
    """Start, in the background, the suites whose reading tests are among ``node_ids`` (collected order)."""
    wanted = [suite for test, suite in READERS.items() if any(n.endswith(test) for n in node_ids)]
    if wanted:
        _start(wanted)


def result(name: str) -> Suite:
    """The finished suite ``name`` (started now if the session did not start it)."""
    _start([name])
    s = _SUITES[name]
    s.done.wait()
    return s


@atexit.register
def _stop() -> None:
    for p in _RUNNING:
        if p.poll() is None:
            p.kill()
