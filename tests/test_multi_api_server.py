"""``--api-server-count 2`` (README: heavy per-request traffic): every API server process prepares
steered requests; a module preloaded from ``steer.modules`` resolves in each of them, and one
registered, replaced or deleted through either process is seen so by both (the engine core holds
the registry); so is a runtime SAE (registered, refused as a duplicate or at a held site, deleted, its
site taken by another). ``/metrics`` (prometheus multiprocess mode, a scrape lands on either process)
counts every request and upload once. Capture results reach the process that took the request on
the side channel, with no capture RPC issued."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np


def test_steering_through_two_api_server_processes(tiny_model, tmp_path):
    from safetensors.numpy import save_file

    from tests.server import openai_server
    from vllm_steer.client import steering_body
    from vllm_steer.core.layout import config_hash

    model = tiny_model("llama")
    hidden = json.loads(open(f"{model}/config.json").read())["hidden_size"]
    save_file({"post_mlp.1": np.full(hidden, 3.0, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    cfg = json.dumps({"steer": {"modules": {"m": str(tmp_path / "m.safetensors")}, "sae_slots": {"post_mlp.1": 8},
                                "sae_root": str(tmp_path), "conditions": True, "capture": ["activations"]}})
    with openai_server(model, "--dtype", "float32", "--enforce-eager", "--api-server-count", "2",
                       "--additional-config", cfg, log=tmp_path / "server.log") as (base, _):
        vec = np.full((1, hidden), 3.0, dtype=np.float32)
        want = config_hash({"post_mlp": {1: vec[0]}}, "float32")
        plain = {"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0}
        texts = set()
        for _ in range(8):  # a new connection each: the kernel spreads them over both processes
            for body in ({**plain, **steering_body({"post_mlp": (vec, [1])})},
                         {**plain, "steering_module": {"name": "m"}}):
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                got = r.json()["steering"]
                assert (got["prefill"], got["decode"], got["sites"]) == (want, want, 1)
                texts.add(r.json()["choices"][0]["text"])
        base_text = httpx.post(f"{base}/v1/completions", json=plain, timeout=120).json()["choices"][0]["text"]
        assert len(texts) == 1 and texts != {base_text}  # the same steering everywhere, and it steers
        _metrics_count_each_event_once(base, model, hidden)
        _modules_are_shared(base, model, hidden)
        _saes_are_shared(base, model, hidden, tmp_path)
        _captures_come_back_without_a_capture_rpc(base, model)
        log = (tmp_path / "server.log").read_text()
        assert "ApiServer_0" in log and "ApiServer_1" in log


CAPTURE = {"activations": {"layers": [1], "hooks": ["post_mlp"], "positions": "last_prompt"}}


def _capture_stats(base: str) -> list[dict]:
    workers = httpx.get(f"{base}/v1/steering", timeout=60).json()["workers"]
    return [w["capture"] for w in workers if w.get("capture") is not None]


def _captures_come_back_without_a_capture_rpc(base: str, model: str) -> None:
    """Capturing requests over new connections (both processes): each response has its own result,
    which the worker pushed to the process that took the request; no capture RPC reached a worker."""
    from vllm_steer.capture.activations import decode_result

    before = _capture_stats(base)
    body = {"model": model, "prompt": "hello there", "max_tokens": 3, "temperature": 0, "capture": CAPTURE}
    answers = _each_connection(8, lambda: httpx.post(f"{base}/v1/completions", json=body, timeout=120))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    vecs = [decode_result(a.json()["capture"]["activations"])["post_mlp.1"] for a in answers]
    assert all(np.array_equal(v, vecs[0]) and np.isfinite(v).all() for v in vecs)
    after = _capture_stats(base)
    assert [c["publish_calls"] for c in after] == [0] * len(after), after  # no capture RPC, ever
    assert sum(c["results_sent"] for c in after) - sum(c["results_sent"] for c in before) == 8, (before, after)
    assert sum(c["result_push_failed"] for c in after) == 0, after


UPLOADS, VECTORS = "vllm_steer_row_uploads_total", 'vllm_steer_requests_total{kind="vectors"}'


def _settled(base: str) -> dict[str, float]:
    """The two counters, scraped until three scrapes in a row agree (engine increments handed to
    either process are in)."""
    from tests.server import scrape_metrics

    seen, deadline = [], time.time() + 60
    while len(seen) < 3 or seen[-1] != seen[-2] or seen[-2] != seen[-3]:
        assert time.time() < deadline, f"/metrics kept changing with no traffic: {seen[-3:]}"
        m = scrape_metrics(base)
        seen.append({k: m.get(k, 0.0) for k in (UPLOADS, VECTORS)})
    return seen[-1]


def _metrics_count_each_event_once(base: str, model: str, hidden: int) -> None:
    """4 new configs through both processes: the request counter (API side, one per process) and
    the engine's upload counter (increments handed to whichever process scrapes) each rise by 4,
    and stay there over more scrapes, landing on both processes."""
    from vllm_steer.client import steering_body

    before = _settled(base)
    for i in range(4):
        vec = np.full((1, hidden), 0.5 + i, dtype=np.float32)
        body = {"model": model, "prompt": "hi", "max_tokens": 2, **steering_body({"post_attn": (vec, [0])})}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 200
    after = _settled(base)
    assert after == {VECTORS: before[VECTORS] + 4, UPLOADS: before[UPLOADS] + 4}
    for _ in range(4):  # new connections: both processes answer, neither adds anything twice
        assert _settled(base) == after


def _each_connection(n: int, call) -> list:
    """``call()`` n times, each on a new connection: the kernel spreads them over both processes."""
    return [call() for _ in range(n)]


def _modules_are_shared(base: str, model: str, hidden: int) -> None:
    from vllm_steer.core.layout import config_hash

    def register(value: float, **extra):
        body = {"name": "shared", "steering_vectors": {"post_mlp": {"1": [value] * hidden}}, **extra}
        return httpx.post(f"{base}/v1/steering/modules", json=body, timeout=120)

    def steered():
        body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0,
                "steering_module": {"name": "shared"}}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=120)

    def key(value: float) -> str:
        return config_hash({"post_mlp": {1: np.full(hidden, value, dtype=np.float32)}}, "float32")

    assert register(2.0).status_code == 201
    for r in _each_connection(12, steered):
        assert r.status_code == 200, r.text
        assert r.json()["steering"]["decode"] == key(2.0)
    for r in _each_connection(6, lambda: register(5.0)):  # either process: the name is taken
        assert r.status_code == 409 and r.json()["error"]["param"] == "name"
    assert register(-3.0, replace=True).status_code == 201
    for r in _each_connection(12, steered):
        assert r.status_code == 200 and r.json()["steering"]["decode"] == key(-3.0), r.text
    listed = _each_connection(6, lambda: httpx.get(f"{base}/v1/steering/modules/shared", timeout=30).json())
    assert {m["version"] for m in listed} == {listed[0]["version"]} and listed[0]["source"] == "json"
    assert httpx.delete(f"{base}/v1/steering/modules/shared", timeout=60).status_code == 200
    for r in _each_connection(12, steered):
        assert r.status_code == 400 and r.json()["error"]["param"] == "steering_module.name", r.text
    for r in _each_connection(4, lambda: httpx.delete(f"{base}/v1/steering/modules/shared", timeout=60)):
        assert r.status_code == 404
    _a_module_condition_is_shared(base, model, hidden)
    names = [m["name"] for m in httpx.get(f"{base}/v1/steering/modules", timeout=30).json()["data"]]
    assert names == ["m"]  # the preload, loaded once for both processes


def _a_module_condition_is_shared(base: str, model: str, hidden: int) -> None:
    """A module registered with a condition through one process gates requests through both: every
    process keys them with the condition (not as the bare vectors) and lists it."""
    from vllm_steer.core.layout import config_hash

    vec = [4.0] * hidden
    cond = {"site": "post_attn.0", "probe": [1.0] * hidden, "threshold": -1e30, "mode": "hard"}
    r = httpx.post(f"{base}/v1/steering/modules", timeout=120, json={
        "name": "gated", "steering_vectors": {"post_attn": {"1": vec}}, "steering_condition": cond})
    assert r.status_code == 201, r.text
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0, "steering_module": {"name": "gated"}}
    answers = _each_connection(12, lambda: httpx.post(f"{base}/v1/completions", json=body, timeout=120))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    keys = {a.json()["steering"]["decode"] for a in answers}
    bare = config_hash({"post_attn": {1: np.asarray(vec, dtype=np.float32)}}, "float32")
    assert len(keys) == 1 and bare not in keys, keys
    listed = _each_connection(6, lambda: httpx.get(f"{base}/v1/steering/modules/gated", timeout=30).json())
    assert all(m["condition"]["threshold"] == -1e30 and m["condition"]["probe"] == {"floats": hidden} for m in listed)
    assert httpx.delete(f"{base}/v1/steering/modules/gated", timeout=60).status_code == 200


def _saes_are_shared(base: str, model: str, hidden: int, tmp_path) -> None:
    """A runtime SAE registered through one process clamps through both; either process refuses a
    duplicate and a second SAE at its site; after a delete through one, both refuse it (400) and the
    site takes another SAE, which both use."""
    from tests.sae_writers import random_sae, write_gemma_scope

    files = {s: write_gemma_scope(str(tmp_path / f"sae{s}"), random_sae(hidden, 16, "jumprelu", seed=s)) for s in (1, 2)}
    clamps = [{"feature": f, "kind": "set", "value": 80.0} for f in (1, 2, 3)]

    def register(name: str, seed: int, **extra):
        body = {"name": name, "path": files[seed], "site": "post_mlp.1", "features": [1, 2, 3], **extra}
        return httpx.post(f"{base}/v1/steering/sae", json=body, timeout=120)

    def clamped(name: str):
        body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0,
                "sae": {"name": name, "clamps": clamps}}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=120)

    assert register("s", 1).status_code == 201
    results = _each_connection(12, lambda: clamped("s"))
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    assert len({r.json()["choices"][0]["text"] for r in results}) == 1
    assert len({json.dumps(r.json()["steering"]) for r in results}) == 1
    for r in _each_connection(6, lambda: register("s", 2)):
        assert r.status_code == 409 and r.json()["error"]["param"] == "name", r.text
    for r in _each_connection(6, lambda: register("t", 2)):
        assert r.status_code == 409 and r.json()["error"]["param"] == "site" and "'s'" in r.json()["error"]["message"]
    listed = _each_connection(6, lambda: httpx.get(f"{base}/v1/steering/sae", timeout=30).json())
    assert all(lst["slots"] == [{"site": "post_mlp.1", "clampable": 8, "sae": "s"}] for lst in listed), listed
    assert httpx.delete(f"{base}/v1/steering/sae/s", timeout=60).status_code == 200
    for r in _each_connection(12, lambda: clamped("s")):  # no SAE left: the field itself is refused
        assert r.status_code == 400 and r.json()["error"]["param"] == "sae" and "no SAE" in r.text, r.text
    for r in _each_connection(4, lambda: httpx.delete(f"{base}/v1/steering/sae/s", timeout=60)):
        assert r.status_code == 404
    assert register("t", 2).status_code == 201
    texts = {r.json()["choices"][0]["text"] for r in _each_connection(12, lambda: clamped("t"))}
    assert len(texts) == 1 and texts != {results[0].json()["choices"][0]["text"]}  # the second SAE's clamps
