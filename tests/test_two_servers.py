"""Two ``./dev serve`` side by side on one machine (issue 42): vLLM's CPU default pins every engine to the first
core, so a second CPU server beside a first crawled and never came up; ``./dev serve`` runs unpinned (``nobind``).
Two real ``./dev serve`` (SmolLM2, eager to keep it cheap, started at the same time on two ports) both print their
"vllm-steer ready" line and answer a steered completion each (on one, the curl ``./dev serve`` printed, as printed),
then stop with everything they started.

Eager engines do not show the pinned hang (s23: forced to ``auto``, both eager servers came up in ~3 min on the
shared box at load ~20, as unpinned ones did); it was seen with compiled engines, whose start (~2 x 2-4 min here)
CI's budget cannot hold. So the binding the servers run with is read from their ``/proc/PID/environ``."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np

from tests.engine_job import EAGER_ENV, ROOT
from tests.server import free_port, log_tail, spawn
from vllm_steer import steering_body

READY_TIMEOUT_S = 600.0  # two engines warming up together on CI's 2 shared cores (~40 s each on a quiet box)
STOP_TIMEOUT_S = 60.0
LAYER = 15


def _fake_uv(tmp_path: Path) -> Path:
    """A ``uv`` that installs nothing: the test's own venv is set up already, and two ``./dev setup`` installing
    into it at once (under the running suite) is not what is tested."""
    bindir = tmp_path / "uvbin"
    bindir.mkdir()
    uv = bindir / "uv"
    uv.write_text("#!/bin/sh\nexit 0\n")
    uv.chmod(uv.stat().st_mode | stat.S_IEXEC)
    return bindir


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def _dev_serve(port: int, log: Path, env: dict):
    """``./dev serve --enforce-eager`` on ``port``, in its own process group (ended with the test process); on
    exit the whole group is stopped (SIGTERM, then SIGKILL) and must be gone."""
    with open(log, "w") as fh:
        proc = spawn([str(ROOT / "dev"), "serve", "--enforce-eager"], env={**env, "PORT": str(port)}, stdout=fh)
    try:
        yield proc
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if _group_alive(proc.pid):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                proc.poll()  # reaps the server itself; its children are reaped by init once it is gone
                time.sleep(0.2)
            if not _group_alive(proc.pid):
                break


def _ready_line(proc, log: Path, deadline: float) -> str:
    while True:
        ready = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("vllm-steer ready:")]
        if ready:
            return ready[0]
        assert proc.poll() is None, f"./dev serve exited rc={proc.returncode}:\n{log_tail(log)}"
        assert time.monotonic() < deadline, f"no ready line in {READY_TIMEOUT_S:.0f} s:\n{log_tail(log)}"
        time.sleep(1)


def test_two_dev_servers_run_side_by_side(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}  # ./dev serve's own default
    env.update(EAGER_ENV, VLLM_STEER_VENV=str(Path(sys.executable).parent.parent),
               PATH=f"{_fake_uv(tmp_path)}:{env['PATH']}")
    ports = [free_port()]
    while len(ports) < 2:
        ports += [p for p in [free_port()] if p not in ports]
    logs = [tmp_path / f"serve-{p}.log" for p in ports]
    with ExitStack() as stack:
        procs = [stack.enter_context(_dev_serve(port, log, env)) for port, log in zip(ports, logs)]
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc, port, log in zip(procs, ports, logs):
            line = _ready_line(proc, log, deadline)
            assert f"at http://127.0.0.1:{port}/v1." in line and "90 sites" in line, line
            # the server is the shell ./dev ran in (exec): its environment says how vLLM binds threads
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert b"VLLM_CPU_OMP_THREADS_BIND=nobind" in environ
        vector = np.random.default_rng(0).standard_normal((1, 576)).astype("float32") * 2.5
        body = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                "max_tokens": 1, "temperature": 0, "logprobs": 1}
        for port, log in zip(ports, logs):
            url = f"http://127.0.0.1:{port}/v1/completions"
            plain = httpx.post(url, json=body, timeout=240)
            steered = httpx.post(url, json={**body, **steering_body({"post_mlp": (vector, [LAYER])})}, timeout=240)
            assert plain.status_code == steered.status_code == 200, (plain.text, steered.text, log_tail(log))
            assert "steering" not in plain.json() and steered.json()["steering"]["sites"] == 1, steered.json()
            # the steered token's log-prob moved (one token: the text of both may still read " Paris")
            lp = [r.json()["choices"][0]["logprobs"]["top_logprobs"][0] for r in (plain, steered)]
            assert lp[0] != lp[1], lp
        # the curl ./dev serve printed before the server started, pasted as printed
        (curl,) = [line.strip() for line in logs[0].read_text().splitlines() if line.startswith("  curl -s ")]
        done = subprocess.run(["bash", "-c", curl], cwd=ROOT, capture_output=True, text=True, timeout=240)
        answer = json.loads(done.stdout)
        assert answer["choices"][0]["text"] and answer["steering"]["sites"] == 1, (curl, done.stdout, done.stderr)
    for proc in procs:
        assert not _group_alive(proc.pid), f"./dev serve's process group {proc.pid} outlived the test"
