"""Safe to operate (issue 25), over HTTP on SmolLM2 with one usable row (``max_configs: 2``; a real
model decodes slowly enough on the CPU lane for a stream to hold the row while others wait):
cached module rows are evicted for a request instead of starving it, a request that can never fit is
a 400, a request that waits past ``max_row_wait_s`` while running requests hold the row is a 503
(streaming too, before any byte), and a server that cannot steer refuses steering fields.
"""

from __future__ import annotations

import json
import re
import threading
import time
import warnings

import httpx
import numpy as np
import pytest

from tests.conftest import API_MAX_MODEL_LEN, API_SERVER_ARGS, LONG_STREAM_TOKENS
from tests.server import log_tail, openai_server, scrape_metrics

HIDDEN = 576  # SmolLM2-135M's
WAIT_S = 0.5
# A client's bound on one answer: CI's 2-core box has stalled the path to the API server for up to ~100 s
# (NOTES, Traps); the engine's own wait, in the refusal's message, is what holds WAIT_S.
CLIENT_S = 240


def _vec(seed: int) -> list[float]:
    return (np.random.default_rng(seed).standard_normal(HIDDEN) * 4).astype(np.float32).tolist()


def _steer(seed: int, layer: int = 1) -> dict:
    return {"post_mlp": {str(layer): _vec(seed)}}


@pytest.fixture(scope="module")
def one_row(smollm2_path, tmp_path_factory):
    model = smollm2_path
    log = tmp_path_factory.mktemp("one_row") / "server.log"
    cfg = json.dumps({"steer": {"max_configs": 2, "max_row_wait_s": WAIT_S}})
    with openai_server(model, *API_SERVER_ARGS, "--additional-config", cfg, log=log,
                       max_model_len=API_MAX_MODEL_LEN) as (base, _):
        yield base, model, log


def _complete(base: str, model: str, timeout: float = 120, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=timeout,
                      json={"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, **body})


def test_cached_module_rows_are_evicted_for_a_new_config(one_row):
    """Three modules on one usable row: each registration caches its rows, none reserves them, so a
    request with its own vector still runs at once (the cached rows are evicted, and counted)."""
    base, model = one_row[:2]
    before = scrape_metrics(base).get("vllm_steer_row_evictions_total", 0.0)
    for i in range(3):
        r = httpx.post(f"{base}/v1/steering/modules", timeout=60, json={"name": f"cache{i}", "steering_vectors": _steer(i)})
        assert r.status_code == 201, r.text
    r = _complete(base, model, timeout=30, steering_vectors=_steer(99))
    assert r.status_code == 200 and r.json()["steering"]["prefill"], r.text
    for i in range(3):  # every module still steers: its evicted row is rebuilt from the worker's copy
        r = _complete(base, model, timeout=30, steering_module={"name": f"cache{i}", "scale": 0.5})
        assert r.status_code == 200 and r.json()["steering"]["prefill"], r.text
    deadline = time.time() + 30
    while scrape_metrics(base).get("vllm_steer_row_evictions_total", 0.0) < before + 4:
        assert time.time() < deadline, scrape_metrics(base)
        time.sleep(0.5)


def test_a_request_that_can_never_fit_is_a_400_naming_the_field(one_row):
    base, model = one_row[:2]
    r = _complete(base, model, prefill_steering_vectors=_steer(1), decode_steering_vectors=_steer(2))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "decode_steering_vectors" and "steer.max_configs" in err["message"]
    r = _complete(base, model, stream=True, prefill_steering_vectors=_steer(1), decode_steering_vectors=_steer(2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "decode_steering_vectors"


class _Holder(threading.Thread):
    """A long steered stream that holds the only row while it is read (in this thread), until the
    test sets ``stop`` (it runs minutes on the CPU lane: a slow machine never sees it end first)."""

    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base, self.model = base, model
        self.started = threading.Event()
        self.stop = threading.Event()
        self.events = 0

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Hello", "max_tokens": LONG_STREAM_TOKENS, "ignore_eos": True,
                "stream": True, "steering_vectors": _steer(7)}
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=CLIENT_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.started.set()
                    self.events += 1
                if self.stop.is_set():
                    return  # closing the stream aborts the request: its row frees


def test_a_request_waiting_past_the_bound_is_a_503_streaming_too(one_row):
    """The only row is held by a running request: a request with another config waits
    ``max_row_wait_s`` and is refused with a 503 saying why (a stream before any byte); once the
    holder is gone the same request runs. Waits and refusals show on /metrics."""
    base, model, log = one_row
    before = scrape_metrics(base).get("vllm_steer_row_wait_timeouts_total", 0.0)
    holder = _Holder(base, model)
    holder.start()
    answers: dict = {}

    errors: dict = {}

    def plain() -> None:
        t0 = time.time()
        try:
            answers["plain"] = (_complete(base, model, timeout=CLIENT_S, steering_vectors=_steer(8)), time.time() - t0)
        except Exception as e:  # reported with the timing below
            errors["plain"] = f"{type(e).__name__}: {e} after {time.time() - t0:.1f} s"

    def stream() -> None:
        t0 = time.time()
        try:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=CLIENT_S, json={
                    "model": model, "prompt": "Hi", "max_tokens": 4, "stream": True,
                    "steering_vectors": _steer(9)}) as s:
                answers["stream"] = (s.status_code, s.headers["content-type"], s.read(), time.time() - t0)
        except Exception as e:
            errors["stream"] = f"{type(e).__name__}: {e} after {time.time() - t0:.1f} s"

    try:
        assert holder.started.wait(CLIENT_S), "the holding stream never started"
        clients = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(CLIENT_S + 10)
        timing = (f"holder events {holder.events}; plain answered after "
                  f"{answers.get('plain', (None, None))[1]} s, stream after {answers.get('stream', [None] * 4)[3]} s; "
                  f"client errors {errors}")
        if not holder.is_alive() or len(answers) < 2 or max(answers["plain"][1], answers["stream"][3]) > 10:
            warnings.warn(f"row-wait refusals were slow: {timing}\n{log_tail(log, 40)}")
        assert holder.is_alive(), f"the holder must still run for this test to mean anything: {timing}"
        assert len(answers) == 2, f"{timing}\n{log_tail(log, 60)}"
    finally:
        holder.stop.set()
        holder.join(60)
    r, waited = answers["plain"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    message = r.json()["error"]["message"]
    assert "steer.max_row_wait_s" in message and r.headers.get("retry-after")
    # The engine's own wait (in the message) holds the bound; the client's time adds the API process and
    # this 2-core box's scheduling (CI once saw 29 s there with the engine's wait unknown): reported.
    engine_waited = float(re.search(r"waited ([0-9.]+) s", message).group(1))
    assert WAIT_S <= engine_waited < WAIT_S + 10, (message, timing)
    assert engine_waited <= waited + 0.05, (message, timing)
    if waited > engine_waited + 10:
        warnings.warn(f"the 503 took {waited:.1f} s, the engine waited {engine_waited:.2f} s: {timing}\n"
                      f"{log_tail(log, 60)}")
    status, ctype, body, _ = answers["stream"]  # refused before any byte of a stream: a plain JSON error
    assert status == 503 and ctype == "application/json", body
    assert "steer.max_row_wait_s" in json.loads(body)["error"]["message"]
    deadline = time.time() + 30
    while True:  # the aborted holder's row frees: the same request runs now
        r = _complete(base, model, timeout=60, steering_vectors=_steer(8))
        if r.status_code == 200 or time.time() > deadline:
            break
    assert r.status_code == 200 and r.json()["steering"]["prefill"], r.text
    while scrape_metrics(base).get("vllm_steer_row_wait_timeouts_total", 0.0) < before + 2:
        assert time.time() < deadline + 30, scrape_metrics(base)
        time.sleep(0.5)


def test_values_that_overflow_once_scaled_are_a_400_before_the_stream(one_row):
    base, model = one_row[:2]
    r = httpx.post(f"{base}/v1/steering/modules", timeout=60, json={"name": "big", "steering_vectors": _steer(3)})
    assert r.status_code in (201, 409), r.text
    for stream in (False, True):
        r = _complete(base, model, stream=stream, steering_module={"name": "big", "scale": 1e39})
        assert r.status_code == 400 and r.json()["error"]["param"] == "steering_module.scale", r.text
        r = _complete(base, model, stream=stream, steering_module={"name": "big", "scale": 1e38})
        assert r.status_code == 400 and r.json()["error"]["param"] == "steering_module.scale", r.text
        assert "float32" in r.json()["error"]["message"]
    nan = '{"model": "%s", "prompt": "Hi", "max_tokens": 2, "stream": true, "steering_vectors": {"post_mlp": {"1": [NaN%s]}}}'
    r = httpx.post(f"{base}/v1/completions", timeout=60, headers={"content-type": "application/json"},
                   content=nan % (model, ", 0.0" * (HIDDEN - 1)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "steering_vectors.post_mlp.1", r.text


def test_a_server_without_the_endpoint_plugin_refuses_to_start_or_refuses_the_fields(tiny_model, tmp_path):
    """vLLM loads endpoint plugins only when VLLM_PLUGINS names them: with the steer block on such a
    server does not start (one line says what to set); without it, steering fields are a 400."""
    model = tiny_model("llama")
    with pytest.raises(RuntimeError) as e:
        with openai_server(model, "--enforce-eager", "--additional-config", '{"steer": {}}', log=tmp_path / "a.log",
                           env={"VLLM_PLUGINS": None}, timeout=240):
            pass
    assert "start the server with VLLM_PLUGINS=steer" in str(e.value)
    with openai_server(model, "--enforce-eager", log=tmp_path / "b.log", env={"VLLM_PLUGINS": None}) as (base, _):
        for stream in (False, True):
            r = _complete(base, model, stream=stream, steering_vectors=_steer(1))
            assert r.status_code == 400 and r.json()["error"]["param"] == "steering_vectors", r.text
            assert "VLLM_PLUGINS=steer" in r.json()["error"]["message"]
        r = _complete(base, model, vllm_xargs={"capture": json.dumps({"x": {}})})
        assert r.status_code == 400 and r.json()["error"]["param"] == "capture", r.text
        assert _complete(base, model).status_code == 200
