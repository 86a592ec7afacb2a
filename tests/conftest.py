"""Shared test fixtures: model paths (built offline by tests.fixtures.models) and CPU-lane env."""

from __future__ import annotations

import os

import pytest

for _k, _v in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCHINDUCTOR_VEC_ISA_OK": "1",  # as tests.engine_job.CPU_ENV: no per-ISA probe processes
}.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def smollm2_path():
    from tests.fixtures.models import smollm2

    return str(smollm2())


@pytest.fixture(scope="session")
def tiny_model():
    from tests.fixtures.models import tiny_model as build

    return lambda family: str(build(family))


API_SERVER_CAP = 50_000  # steer.max_request_bytes of the shared API server
API_KEY = "sekret"  # steer.api_key of the shared API server
MODULE_CAP = 150_000  # steer.max_module_bytes of the shared API server (above API_SERVER_CAP)
MAX_MODULES = 24  # steer.max_modules of the shared API server (the tests hold at most ~10 at once)
PRELOAD_LAYER = 5


PROBE_SEED, PROBE_LAYER = 3, 20
# the shared API server's max_model_len: long streams (closed by their tests once done with them) run
# for minutes, so what a test does while one runs never races its end on a slow machine (CI has seen
# a 2,000-token stream end while four small HTTP calls took ~100 s); prefill stays chunked at 2048
API_MAX_MODEL_LEN = 8192
LONG_STREAM_TOKENS = API_MAX_MODEL_LEN - 48
API_SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-num-batched-tokens", "2048")
CAPTURE_TIMEOUT_S = 4  # steer.capture_result_timeout_s of the shared API server (the slow consumer's tests)
API_CAPTURE_ROWS = 512  # steer.capture_max_rows of the shared API server: a wide prompt capture is chunked to fit
SAE_SITE, SAE_D, SAE_CLAMPABLE, SAE_SEED = "post_mlp.12", 64, 32, 11  # the shared server's SAE "fz"
SAE_SLOT, SAE_SLOT_SIZE = "post_mlp.8", 16  # its site reserved for SAEs registered at runtime


@pytest.fixture(scope="session")
def probe_plugin():
    """Install the example third-party consumer package (plugins/vllm-steer-probe) like a user
    would, so the tests prove discovery through its entry points."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pkg = str(Path(__file__).resolve().parent.parent / "plugins" / "vllm-steer-probe")
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if pip.returncode == 0:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", pkg]
    else:
        cmd = [shutil.which("uv") or "uv", "pip", "install", "-q", "-p", sys.executable, "--no-deps", "-e", pkg]
    subprocess.run(cmd, check=True)
    # New processes (the servers) see the editable install through its .pth file; this already
    # running one needs the source path itself.
    if str(Path(pkg) / "src") not in sys.path:
        sys.path.append(str(Path(pkg) / "src"))
    return pkg


@pytest.fixture(scope="session")
def sae_root(tmp_path_factory):
    """The shared server's steer.sae_root: runtime SAE registrations may name files only in here."""
    return tmp_path_factory.mktemp("sae_root")


@pytest.fixture(scope="session")
def api_server(smollm2_path, probe_plugin, tmp_path_factory, sae_root):
    """One OpenAI server (SmolLM2, float32, multi-process) for the request-API, module and capture
    tests: byte caps, module limits, a module API key, a module preloaded from a safetensors file, an SAE
    and a site for runtime ones (files under ``sae_root``), capture consumers (the example probe with a
    global spec, a raising one, the filesystem one, a slow driver, the built-in activations one), and
    conditional steering."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from tests.server import openai_server

    d = tmp_path_factory.mktemp("api")
    vec = np.linspace(-1, 1, 576, dtype=np.float32) * 30
    save_file({f"post_mlp.{PRELOAD_LAYER}": vec}, str(d / "preloaded.safetensors"), metadata={"description": "from disk"})
    from tests.sae_writers import random_sae, write_gemma_scope

    sae = write_gemma_scope(str(d / "sae"), random_sae(576, SAE_D, "jumprelu", seed=SAE_SEED))
    probe = {"name": "probe", "params": {"dim": 576, "seed": PROBE_SEED, "global_spec": {
        "layers": [PROBE_LAYER], "hooks": ["post_mlp"], "positions": "last_prompt"}}}
    capture = [probe, "explode", {"name": "filesystem", "instance": "fs", "params": {"root": str(d / "captures")}}, "slow",
               "activations", {"name": "filesystem", "instance": "sae", "params": {  # examples/capture_sae_lens.py
                   "root": str(d / "captures"), "tag": "sae", "format": "sae_lens", "context_size": 4, "flush_s": 0.2}}]
    cfg = json.dumps({"steer": {"max_configs": 16, "max_request_bytes": API_SERVER_CAP, "api_key": API_KEY,
                                "modules": {"preloaded": str(d / "preloaded.safetensors")},
                                "max_modules": MAX_MODULES, "max_module_bytes": MODULE_CAP, "capture": capture,
                                "capture_result_timeout_s": CAPTURE_TIMEOUT_S, "capture_max_rows": API_CAPTURE_ROWS,
                                "sae": {"fz": {"path": sae, "site": SAE_SITE, "features": list(range(SAE_CLAMPABLE))}},
                                "sae_slots": {SAE_SLOT: SAE_SLOT_SIZE}, "sae_root": str(sae_root),
                                "conditions": True, "max_projections": 2,
                                "site_norms": _site_norms_file(d)}})
    log = d / "server.log"
    # served by its path (what the tests send) and by the dev server's name (what the README's commands send)
    names = ("--served-model-name", smollm2_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    with openai_server(smollm2_path, *API_SERVER_ARGS, *names, "--additional-config", cfg, log=log,
                       max_model_len=API_MAX_MODEL_LEN) as (base, _):
        yield base, smollm2_path, log, d / "captures"


SERVER_NORMS = {f"post_mlp.{layer}": 4.0 + layer for layer in range(30)}  # the shared server's steer.site_norms
# (made up: post_mlp sites only, so a pre_attn ``norm`` strength is the 400 that names calibrate)


def _site_norms_file(d) -> str:
    import json

    (d / "site_norms.json").write_text(json.dumps({"site_norms": SERVER_NORMS}))
    return str(d / "site_norms.json")


SLOW_HTTP_S = 30.0  # an HTTP call of a test slower than this (to its response's headers) is listed at the end (a
# non-streamed 300-token completion takes ~20 s on CI's CPU; the stalls seen were 30-100 s)
_SLOW_HTTP: list[str] = []
_RUNNING = [""]  # the test being run
CLIENT_FLOOR_S = 240.0  # no test HTTP call gives up on reading or writing sooner: CI has stalled 30-100 s


@pytest.fixture(autouse=True)
def _note_running_test(request):
    _RUNNING[0] = request.node.nodeid
    yield


@pytest.fixture(scope="session", autouse=True)
def _time_http_calls():
    """Times every synchronous httpx call of the tests: the CI-only stalls (NOTES, Traps) show at the
    end of the run as which route, in which test, when, for how long. Every call's read, write and
    pool timeouts are raised to ``CLIENT_FLOOR_S``: a test's client outlasts such a stall (tests bound
    what they assert by measuring, never by a client timeout)."""
    import time

    import httpx

    orig = httpx.Client.send

    def send(self, request, **kwargs):
        timeout = request.extensions.get("timeout")
        if timeout:
            request.extensions["timeout"] = {k: v if k == "connect" or v is None else max(v, CLIENT_FLOOR_S)
                                             for k, v in timeout.items()}
        t0, wall = time.monotonic(), time.strftime("%H:%M:%S")
        try:
            return orig(self, request, **kwargs)
        finally:
            if (took := time.monotonic() - t0) > SLOW_HTTP_S:
                _SLOW_HTTP.append(f"{wall} {took:.1f} s {request.method} {request.url.path} in {_RUNNING[0]}")

    httpx.Client.send = send
    yield
    httpx.Client.send = orig


PROCESS_STALLS: list[tuple[float, float]] = []  # (from, to) monotonic: this process was not run for 1 s or more


def process_stalled_between(start: float, end: float) -> bool:
    """Whether this test process went unrun for a second or more at some time in [start, end] (monotonic):
    a timing measured by this process's threads across it says nothing about the server."""
    return any(a < end and b > start for a, b in PROCESS_STALLS)


@pytest.fixture(scope="session", autouse=True)
def _watch_this_process():
    """Notes when this test process itself was not run (a 1 s sleep that ended 5 s or more late), listed
    with the slow calls: a stall there is the client's, not the server's (whose loop watch logs its own)."""
    import threading
    import time

    done = threading.Event()

    def watch() -> None:
        while True:
            t0 = time.monotonic()
            if done.wait(1.0):
                return
            late = time.monotonic() - t0 - 1.0
            if late >= 1.0:
                PROCESS_STALLS.append((t0, t0 + 1.0 + late))
            if late >= 5.0:
                _SLOW_HTTP.append(f"{time.strftime('%H:%M:%S')} the test process was not run for {late:.1f} s "
                                  f"in {_RUNNING[0]}")

    thread = threading.Thread(target=watch, daemon=True, name="test-process-watch")
    thread.start()
    yield
    done.set()


def pytest_terminal_summary(terminalreporter):
    if _SLOW_HTTP:
        terminalreporter.section(f"HTTP calls slower than {SLOW_HTTP_S:g} s (to the response headers), and stalls "
                                  "of this process")
        for line in _SLOW_HTTP:
            terminalreporter.write_line(line)


def pytest_collection_finish(session):
    from tests import background_runs

    background_runs.start_owned([item.nodeid for item in session.items])


def pytest_sessionfinish(session):
    from tests import background_runs

    background_runs.stop_all()
