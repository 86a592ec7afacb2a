"""Starts vLLM's OpenAI server (through the vllm-steer launcher) on loopback for HTTP tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.engine_job import CPU_ENV, EAGER_ENV, ROOT, die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], env: dict, stdout) -> subprocess.Popen:
    """A test server process: its own process group (stopped with ``os.killpg``), ended with its parent."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent)


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float, detail) -> None:
    """Until ``base``'s /health answers 200: RuntimeError if the process exits first, TimeoutError after
    ``timeout`` seconds (each message ends with ``detail()``, e.g. the log's tail)."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited rc={proc.returncode}:\n{detail()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"server not up in {timeout}s:\n{detail()}")
        time.sleep(1)


@contextmanager
def openai_server(model: str, *args: str, log: Path, env: dict | None = None, timeout: float = 300,
                  max_model_len: int = 512):
    """Yield (base_url, process) of a running server; kill it on exit. ``env`` values of None unset
    the variable (e.g. ``{"VLLM_PLUGINS": None}``: a server without the endpoint plugin)."""
    port = free_port()
    eager = EAGER_ENV if "--enforce-eager" in args else {}
    full_env = {**os.environ, **CPU_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **eager, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    cmd = [sys.executable, "-m", "vllm_steer.launcher", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len), *args]
    with open(log, "w") as fh:
        proc = spawn(cmd, env=full_env, stdout=fh)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout, lambda: log.read_text()[-4000:])
        yield base, proc
    finally:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
        except Exception:
            if proc.poll() is None:  # an exited server (its start failed) has nothing left to kill
                os.killpg(proc.pid, 9)


def log_tail(log: Path, lines: int = 40) -> str:
    """The server log's last ``lines`` (vLLM's periodic "Running: N reqs, Waiting: M reqs" lines
    included), for a failure message."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def scrape_metrics(base: str) -> dict[str, float]:
    """Every ``vllm_steer_*`` sample of one /metrics scrape, keyed as printed (labels included)."""
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm_steer_"):
            out[name] = float(value)
    return out
