"""The engine core killed while a capturing stream decodes (issue 37 item 6): the stream ends within
seconds, not after ``steer.capture_result_timeout_s`` (30 s), and its capture chunk holds an
``engine_dead`` error object for the driver instance. One API process (with several, vLLM's process
manager tears every API process down at once and the stream is cut instead)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

# every position, generated ones too: its result waits for the request's end (a prompt-only capture has its
# result once its prefill is planned, before any kill)
CAPTURE = {"activations": {"layers": [1], "hooks": ["post_mlp"], "positions": "all"}}


def _engine_core_pids(proc) -> list[int]:
    import psutil

    kids = psutil.Process(proc.pid).children(recursive=True)
    return [k.pid for k in kids if "EngineCore" in k.name() or "EngineCore" in " ".join(k.cmdline())]


def test_engine_death_ends_a_capturing_stream_at_once(smollm2_path, tmp_path):
    from tests.server import openai_server

    # SmolLM2 on CPU decodes ~20+ ms a token: 2000 tokens outlast the kill by far (the tiny model finished
    # 480 tokens before its third event reached the client, so the kill came after the request's end)
    model = smollm2_path
    cfg = json.dumps({"steer": {"capture": ["activations"]}})
    with openai_server(model, "--dtype", "float32", "--enforce-eager", "--additional-config", cfg,
                       log=tmp_path / "server.log", max_model_len=2048) as (base, proc):
        pids = _engine_core_pids(proc)
        assert pids, "no EngineCore process found"
        body = {"model": model, "prompt": "hello there", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True, "capture": CAPTURE}
        events, killed_at = [], None
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if killed_at is None and len(events) >= 2:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        ended = time.monotonic() - killed_at
    assert events[-1] == "[DONE]", events[-3:]
    assert len(events) < 1000, f"{len(events)} events: the request ended before the kill"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["capture"]["activations"]["error"] == "engine_dead", events[-3:]
    assert ended < 8.0, ended
