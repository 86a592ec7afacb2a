"""SAEs registered over HTTP on the shared server (conftest: ``sae_slots`` reserves post_mlp.8 for 16
features; ``sae_root`` is where registrations may read): refusals with the status and field, paths
outside the root (one 403 whatever the reason), a registered SAE steering completions, delete while in
flight (the request finishes with the SAE, the site stays busy until then), re-registration."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from tests.conftest import API_KEY, LONG_STREAM_TOKENS, SAE_SLOT, SAE_SLOT_SIZE
from tests.sae_writers import random_sae, write_gemma_scope, write_manifest, write_sparsify
from tests.server import log_tail, scrape_metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HIDDEN, F = 576, 64
CLAMPS = [{"feature": f, "kind": "set", "value": 60.0} for f in (1, 2, 3, 4)]


@pytest.fixture(scope="module")
def server(api_server, sae_root):
    d = sae_root / "rt_sae"
    files = {seed: write_gemma_scope(str(d / f"s{seed}"), random_sae(HIDDEN, F, "jumprelu", seed=seed)) for seed in (31, 32)}
    files["topk"] = write_manifest(str(d / "topk"), {SAE_SLOT: random_sae(HIDDEN, F, "topk", k=4)}, "topk", 4)
    sp = random_sae(HIDDEN, F, "topk", k=4, b_dec_in=True)  # EleutherAI sparsify folders (layers.L: post_mlp.L)
    files["sparsify"] = write_sparsify(str(d / "sp" / f"layers.{SAE_SLOT.split('.')[1]}"), sp)
    files["sparsify_tc"] = write_sparsify(str(d / "sp_tc" / "layers.8.mlp"), sp, transcode=True)
    return api_server[0], api_server[1], files, api_server[2]


def post(base, body, headers=AUTH):
    return httpx.post(f"{base}/v1/steering/sae", json=body, headers=headers, timeout=60)


def delete(base, name):
    return httpx.delete(f"{base}/v1/steering/sae/{name}", headers=AUTH, timeout=60)


def text(base, model, **fields):
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _long_stream(base, model, started, stop, out):
    """A long streamed completion (tests.conftest.LONG_STREAM_TOKENS) clamped by ``rt``: ``started`` is set once its text is longer
    than an 8-token answer's, the stream is closed (the request aborted) when ``stop`` is set;
    ``out`` gets the status and the text so far."""
    req = {"model": model, "prompt": "The capital of France is", "max_tokens": LONG_STREAM_TOKENS, "temperature": 0,
           "ignore_eos": True, "stream": True, "sae": {"name": "rt", "clamps": CLAMPS}}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=req, timeout=120) as r:
            out["status"], out["text"], out["events"] = r.status_code, "", 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out["text"] += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                    out["events"] += 1
                    out["last_event"] = time.monotonic()
                    if out["events"] >= 12:
                        started.set()
                elif line and not line.startswith("data: [DONE]"):
                    out["text"] += line
                if stop.is_set():
                    break
    finally:
        started.set()


def _refused_at_site(base) -> float:
    """``vllm_steer_sae_registrations_refused_total`` of 409s naming ``site``, as /metrics shows it."""
    return sum(v for k, v in scrape_metrics(base).items() if k.startswith("vllm_steer_sae_registrations_refused_total")
               and 'status="409"' in k and 'field="site"' in k)


def _refusal(r, status: int, param: str, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_registrations_are_refused_with_the_field_at_fault(server):
    base, _, files, _ = server
    good = {"name": "rt", "path": files[31], "site": SAE_SLOT, "features": list(range(8))}
    assert post(base, good, headers={}).status_code == 401
    cases = [
        ({**good, "colour": "red"}, 400, "colour", "unknown field"),
        ({k: v for k, v in good.items() if k != "path"}, 400, "path", "needs the path"),
        ({**good, "path": files[31] + "/nowhere"}, 403, "path", "inside steer.sae_root"),
        ({**good, "site": "post_mlp.9"}, 400, "site", "not reserved"),
        ({**good, "site": "sideways.3"}, 400, "site", "unknown hook"),
        ({**good, "features": list(range(SAE_SLOT_SIZE + 1))}, 400, "features", f"holds {SAE_SLOT_SIZE}"),
        ({**good, "features": [1, F]}, 400, "features", "out of range"),
        ({**good, "features": [1, 1]}, 400, "features", "duplicate"),
        ({**good, "features": [True]}, 400, "features.0", "integer"),
        ({**good, "reconstruct": True}, 400, "reconstruct", f"site {SAE_SLOT} holds {SAE_SLOT_SIZE} clampable "
                                                            "features, ReLU / JumpReLU, delta only (steer.sae_slots): "
                                                            "reconstruct needs a site reserved with d_sae"),
        ({**good, "path": files["topk"], "site": None}, 400, "path", "a TopK SAE needs a site reserved with d_sae"),
        ({**good, "path": files["sparsify"], "format": "sparsify", "site": None}, 400, "path",
         "a TopK SAE needs a site reserved with d_sae"),
        ({**good, "path": files["sparsify_tc"], "site": None}, 400, "path",
         "a transcoder cannot be registered at runtime"),
        ({**good, "name": "../x"}, 400, "name", "module name is"),
        ({**good, "name": "fz"}, 409, "name", "loaded at start-up"),
    ]
    for body, status, param, words in cases:
        _refusal(post(base, body), status, param, words)
    r = httpx.post(f"{base}/v1/steering/sae", content=b"{nope", headers=AUTH, timeout=60)
    _refusal(r, 400, "body", "invalid JSON")
    _refusal(delete(base, "fz"), 409, "name", "loaded at start-up")
    _refusal(delete(base, "never"), 404, "name", "unknown SAE")
    listed = httpx.get(f"{base}/v1/steering/sae", timeout=30).json()
    assert [s["name"] for s in listed["data"]] == ["fz"]  # nothing half-registered
    assert listed["slots"] == [{"site": SAE_SLOT, "clampable": SAE_SLOT_SIZE, "sae": None}]


def test_paths_outside_the_root_get_one_403(server, sae_root, tmp_path):
    """Outside the root, missing, a symlink or '..' leaving it, a device: the same status and body."""
    base, _, files, _ = server
    outside = write_gemma_scope(str(tmp_path / "outside"), random_sae(HIDDEN, F, "jumprelu", seed=31))
    link = sae_root / "escape"
    if not link.is_symlink():
        os.symlink(outside, link)
    good = {"name": "rt_out", "site": SAE_SLOT, "features": list(range(8))}
    paths = [outside, str(link), str(sae_root / ".." / os.path.basename(tmp_path) / "outside"),
             str(sae_root / "missing"), "/dev/zero", "/etc/passwd"]
    answers = [post(base, {**good, "path": p}) for p in paths]
    assert {r.status_code for r in answers} == {403}, [r.text for r in answers]
    bodies = {r.text for r in answers}
    assert len(bodies) == 1, bodies
    err = answers[0].json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("PermissionDeniedError", "path", 403)
    assert "inside steer.sae_root" in err["message"] and str(sae_root) not in err["message"]
    assert [s["name"] for s in httpx.get(f"{base}/v1/steering/sae", timeout=30).json()["data"]] == ["fz"]


def test_register_steer_delete_in_flight_and_reuse_the_site(server):
    base, model, files, log = server
    body = {"name": "rt", "path": files[31], "site": SAE_SLOT, "features": list(range(8))}
    r = post(base, body)
    assert r.status_code == 201, r.text
    assert (r.json()["sites"], r.json()["clampable"], r.json()["source"]) == ([SAE_SLOT], 8, "runtime")
    _refusal(post(base, body), 409, "name", "replace=true")
    before = _refused_at_site(base)
    _refusal(post(base, {**body, "name": "other"}), 409, "site",
             "holds the SAE 'rt' (steer.sae_slots reserves one runtime SAE per site; no reserved site is free)")
    metrics = scrape_metrics(base)  # the only reserved site is held: none free, the refusal counted
    assert metrics['vllm_steer_sae_slots{state="held"}'] == 1 and metrics['vllm_steer_sae_slots{state="free"}'] == 0
    assert _refused_at_site(base) == before + 1
    try:
        plain, first = text(base, model), text(base, model, sae={"name": "rt", "clamps": CLAMPS})
        assert first != plain and text(base, model, sae={"name": "rt", "clamps": CLAMPS}) == first
        # beside the config SAE at another site, in one request
        both = text(base, model, sae=[{"name": "rt", "clamps": CLAMPS}, {"name": "fz", "clamps": CLAMPS}])
        assert both not in (first, plain)
        refused = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Hi", "sae": {"name": "rt", "clamps": [{"feature": 9, "value": 1.0}]}})
        _refusal(refused, 400, "sae.clamps[0].feature", "not clampable")

        out, started, stop = {}, threading.Event(), threading.Event()
        t = threading.Thread(target=_long_stream, args=(base, model, started, stop, out))
        steps, t0 = [], time.monotonic()  # (step, seconds since the stream began): for a failure message
        t.start()
        assert started.wait(120), "no token streamed within 120 s"
        steps.append(("started", time.monotonic() - t0))
        assert httpx.get(f"{base}/v1/steering/sae/rt", timeout=30).json()["in_flight"] == 1, out
        steps.append(("in_flight read", time.monotonic() - t0))
        assert delete(base, "rt").status_code == 200
        steps.append(("deleted", time.monotonic() - t0))
        after = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Hi", "sae": {"name": "rt", "clamps": CLAMPS}})
        steps.append(("refused completion", time.monotonic() - t0))
        _refusal(after, 400, "sae.name", "unknown SAE")
        # the running request still clamps at the site: another SAE may not take it yet
        busy = post(base, {**body, "name": "rt2", "path": files[32]})
        steps.append(("refused registration", time.monotonic() - t0))
        running = t.is_alive()  # a long stream: it cannot have finished by now
        stop.set()  # close the stream: vLLM aborts the request, which frees the site
        t.join(120)
        if t.is_alive() or out.get("status") != 200 or not running:
            timing = ", ".join(f"{name} {s:.1f} s" for name, s in steps)
            pytest.fail(f"the in-flight request (running at the post: {running}; {out.get('events')} events, the "
                        f"last {out.get('last_event', t0) - t0:.1f} s in; {timing}): {out.get('text', '')[:300]!r}; "
                        f"the server log ends:\n{log_tail(log, 40)}")
        _refusal(busy, 409, "site", "still clamp")
        assert out["text"].startswith(first)  # it ran with rt (greedy: same prefix)

        deadline = time.monotonic() + 60  # the abort reaches the engine soon after the close
        while (again := post(base, {**body, "name": "rt2", "path": files[32]})).status_code == 409 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert again.status_code == 201, again.text
        second = text(base, model, sae={"name": "rt2", "clamps": CLAMPS})
        assert second not in (first, plain)
        assert delete(base, "rt2").status_code == 200
        # the first file again: its weights are staged anew in place, nothing of rt2 remains
        assert post(base, body).status_code == 201
        assert text(base, model, sae={"name": "rt", "clamps": CLAMPS}) == first
        assert text(base, model) == plain
    finally:
        for name in ("rt", "rt2"):
            delete(base, name)
    assert [s["name"] for s in httpx.get(f"{base}/v1/steering/sae", timeout=30).json()["data"]] == ["fz"]
