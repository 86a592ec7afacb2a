"""Capture over HTTP: a third-party driver consumer (plugins/vllm-steer-probe) found by entry point
returns a per-request result in the OpenAI response that matches transformers; a bad capture spec
is a 400; a consumer that raises leaves the server serving; filesystem captures of concurrent
requests are each complete; a slow driver consumer delays only its own request's ``capture`` field
(a timeout error after ``steer.capture_result_timeout_s``), never other requests' tokens."""

from __future__ import annotations

import json
import math
import threading
import time
import warnings

import httpx
import numpy as np
import pytest
import torch

from tests import hf_oracle
from tests.conftest import API_CAPTURE_ROWS, CAPTURE_TIMEOUT_S, LONG_STREAM_TOKENS, PROBE_LAYER, PROBE_SEED, process_stalled_between
from tests.server import log_tail, scrape_metrics
from vllm_steer.capture.filesystem import load_request

PROMPT = "The capital of France is"


def complete(base, model, **body):
    return httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body})


def test_probe_result_comes_back_in_the_response_and_matches_transformers(api_server):
    from vllm_steer_probe import probe_weights

    base, model = api_server[0], api_server[1]
    r = complete(base, model)
    assert r.status_code == 200, r.text
    got = r.json()["capture"]["probe"]
    hf, tok = hf_oracle.load(model)
    with torch.no_grad():
        hs = hf(torch.tensor([tok(PROMPT)["input_ids"]]), output_hidden_states=True).hidden_states
    h = hs[PROBE_LAYER + 1][0, -1].double().numpy()  # post_mlp of PROBE_LAYER at the last prompt token
    logit = float(probe_weights(576, PROBE_SEED) @ h)
    assert got["rows"] == 1
    assert math.isclose(got["logit"], logit, rel_tol=1e-4, abs_tol=1e-3)
    assert math.isclose(got["score"], 1 / (1 + math.exp(-logit)), rel_tol=1e-4, abs_tol=1e-6)


def test_streaming_response_ends_with_a_capture_chunk_equal_to_the_non_streaming_result(api_server):
    from openai import OpenAI

    base, model = api_server[0], api_server[1]
    whole = complete(base, model).json()["capture"]["probe"]
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    with_capture = [c for c in chunks if "capture" in c]
    assert len(with_capture) == 1 and with_capture[0] is chunks[-1]  # one last chunk, before [DONE]
    last = with_capture[0]
    assert last["choices"] == [] and last["id"] == chunks[0]["id"] and last["object"] == chunks[0]["object"]
    assert last["capture"]["probe"]["rows"] == whole["rows"] == 1
    assert math.isclose(last["capture"]["probe"]["logit"], whole["logit"], rel_tol=1e-5, abs_tol=1e-5)
    # the openai client takes the extra chunk in its stride (as it does the usage chunk)
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    got = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in got if c.choices) == complete(base, model).json()["choices"][0]["text"]
    assert got[-1].model_extra["capture"]["probe"]["rows"] == 1


@pytest.mark.parametrize("capture, words", [
    ({"nope": {"layers": [1]}}, "capture.nope"),
    ({"fs": {"layers": [99]}}, "capture.fs.layers"),
    ({"fs": {"hooks": ["mid"]}}, "capture.fs.hooks"),
    ({"fs": {"positions": "some"}}, "capture.fs.positions"),
    ({"fs": {"layers": [1], "colour": "red"}}, "capture.fs"),
    ({"fs": {"layers": [1], "wait": "no"}}, "capture.fs: consumer 'filesystem': wait must be true or false"),
    ({"probe": {"layers": [1], "threshold": 2}}, "capture.probe"),
], ids=["unknown-instance", "layer-range", "hook", "positions", "fs-extra-key", "fs-wait", "probe-extra-key"])
def test_bad_capture_spec_is_a_400_naming_the_consumer(api_server, capture, words):
    base, model = api_server[0], api_server[1]
    r = complete(base, model, capture=capture)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert complete(base, model).status_code == 200


def test_a_raising_consumer_is_counted_and_the_server_keeps_serving(api_server):
    base, model = api_server[0], api_server[1]
    for _ in range(2):
        r = complete(base, model, capture={"explode": {"layers": [2], "hooks": ["pre_attn"]}})
        assert r.status_code == 200
    status = httpx.get(f"{base}/v1/steering", timeout=30).json()
    assert status["workers"][0]["capture"]["consumer_errors"] >= 4  # on_rows + on_finish, twice
    assert complete(base, model).status_code == 200


def test_concurrent_requests_each_get_complete_files(api_server):
    """Eight concurrent capturing requests each get their own complete files; the odd ones ask ``"wait": false``
    (their responses do not wait for the files, which are published behind them all the same)."""
    base, model, _, root = api_server
    ids, errors = [], []

    def run(i):
        spec = {"layers": [0, 7], "hooks": ["pre_attn", "post_mlp"], "positions": "all_prompt", "wait": i % 2 == 0}
        r = complete(base, model, prompt=f"{PROMPT} number {i}", capture={"fs": spec})
        (ids if r.status_code == 200 else errors).append((i, r.json()["id"]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and len(ids) == 8
    deadline = time.monotonic() + 30
    for i, resp_id in sorted(ids):  # waited (even i): published before its response, so readable at once
        while True:
            try:
                got = load_request(str(root), f"{resp_id}-0")
                break
            except FileNotFoundError:
                assert i % 2 == 1 and time.monotonic() < deadline
                time.sleep(0.05)
        assert sorted(got) == [(0, "post_mlp"), (0, "pre_attn"), (7, "post_mlp"), (7, "pre_attn")]
        n = len(got[(0, "pre_attn")][0])
        assert all(rows.shape == (n, 576) and np.isfinite(rows).all() for _, rows in got.values())
    assert not list(root.rglob("*.tmp"))


def test_a_prompt_wider_than_the_capture_pool_is_chunked_and_every_row_kept(api_server):
    """30 sites x a ~50-token prompt is ~3x the pool (steer.capture_max_rows): the scheduler chunks the prefill
    (engine.capture_budget), the file holds every prompt position of every site, no row is dropped, and the
    capped steps are on /metrics."""
    base, model, log, root = api_server
    before = scrape_metrics(base)
    r = complete(base, model, prompt=" ".join(["The tide came in over the grey stones"] * 6), max_tokens=2,
                 capture={"fs": {"layers": "all", "hooks": ["post_mlp"], "positions": "all_prompt"}})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    assert n * 30 > 2 * API_CAPTURE_ROWS
    got = load_request(str(root), f"{r.json()['id']}-0")
    assert sorted(got) == [(layer, "post_mlp") for layer in range(30)]
    for site, (positions, rows) in got.items():
        np.testing.assert_array_equal(positions, np.arange(n), err_msg=str(site))
        assert rows.shape == (n, 576) and np.isfinite(rows).all()
    deadline = time.monotonic() + 120  # a scrape may answer with the engine's values of the scrape before (CI stalls)
    while (now := scrape_metrics(base))["vllm_steer_capture_throttled_steps_total"] < (
            before["vllm_steer_capture_throttled_steps_total"] + 2):
        assert time.monotonic() < deadline, f"throttled steps {now['vllm_steer_capture_throttled_steps_total']}"
        time.sleep(0.2)
    assert now["vllm_steer_capture_dropped_rows_total"] == before["vllm_steer_capture_dropped_rows_total"]


SLOW_S = 2 * CAPTURE_TIMEOUT_S  # the slow consumer's sleep: past the timeout
SLOW_SPEC = {"layers": [0], "hooks": ["pre_attn"], "positions": "last_prompt"}


def _stream_times(base, model, i, out, max_tokens, stop):
    """Arrival time of every SSE event of a long unsteered streaming completion (into ``out[i]``);
    the stream is closed early once ``stop`` is set."""
    times = out[i]
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
            "model": model, "prompt": f"{PROMPT} {i}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
            if stop.is_set():
                return


def _concurrent_streams(base, model, n=3, during=None, max_tokens=120, hold_s=2.0):
    """Run ``n`` streams at once (read in threads). With ``during``: once every stream has had 5 events
    (or one has, 30 s on) it runs ``during()``, the streams are read ``hold_s`` longer and then closed. Returns (each stream's
    event times, what ``during`` returned, when the streams were opened)."""
    times: dict[int, list[float]] = {i: [] for i in range(n)}
    stop = threading.Event()
    begun = time.monotonic()
    threads = [threading.Thread(target=_stream_times, args=(base, model, i, times, max_tokens, stop)) for i in range(n)]
    [t.start() for t in threads]
    got = None
    if during is not None:  # every stream going, or at least one and 30 s passed (a late one is reported)
        start = time.monotonic()
        while min(len(t) for t in times.values()) < 5:
            waited = time.monotonic() - start
            if waited > 90 or (waited > 30 and max(len(t) for t in times.values()) >= 5):
                break
            time.sleep(0.01)
        got = during()
        time.sleep(hold_s)
        stop.set()
    [t.join(120) for t in threads]
    if during is None:
        assert all(len(t) > max_tokens - 20 for t in times.values())  # the tokens, the capture chunk, [DONE]
    return [times[i] for i in range(n)], got, begun


def _gaps(streams):
    """Inter-event gaps of every stream, its first event (the time to first token) excluded."""
    return np.concatenate([np.diff(t) for t in streams])


def _engine_gaps(streams, start, end):
    """Gaps between consecutive events of any stream within [start, end]: the engine stepping at all.
    An engine held by a consumer stalls every stream at once; this is the gap that shows it."""
    merged = np.sort(np.concatenate([np.asarray(t) for t in streams]))
    inside = merged[(merged >= start) & (merged <= end)]
    return np.diff(np.concatenate([[start], inside, [end]]))


def test_a_slow_driver_consumer_delays_only_its_own_capture_field_never_other_tokens(api_server):
    base, model, log = api_server[0], api_server[1], api_server[2]
    complete(base, model)  # warm
    baseline, _, _ = _concurrent_streams(base, model)
    normal = _gaps(baseline)
    p95 = float(np.percentile(normal, 95))

    def slow_request():
        """Streamed, so the engine's part (its tokens) and the capture wait (the last chunk) are timed apart:
        returns (status, the capture chunk, when it was sent, when its last token came, when it ended)."""
        t0, last_token, cap = time.monotonic(), None, None
        with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True,
                "capture": {"slow": {**SLOW_SPEC, "sleep_s": SLOW_S}}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "capture" in event:
                        cap = event["capture"]
                    elif event.get("choices"):
                        last_token = time.monotonic()
        return r.status_code, cap, t0, last_token, time.monotonic()

    # The streams are held open (they are long: tests.conftest.LONG_STREAM_TOKENS) until the slow
    # response is back, then closed; the check needs one stream decoding across the slow request's
    # finish and its response's wait.
    bound = max(3.0, 6 * p95)
    for attempt in range(2):  # measured again once if this process itself was not run during the window
        streams, (status, cap, t0, last_token, t1), begun = _concurrent_streams(
            base, model, during=slow_request, max_tokens=LONG_STREAM_TOKENS)
        engine = _engine_gaps(streams, t0, t1 + 1.0)
        waited = t1 - (last_token or t0)  # the capture chunk after the request's own last token
        timed = engine.max() < bound and CAPTURE_TIMEOUT_S - 0.5 <= waited < CAPTURE_TIMEOUT_S + 2.5
        if timed or attempt or not process_stalled_between(t0, t1 + 1.0):
            break
        warnings.warn(f"the test process was not run during the slow request ({t1 - t0:.1f} s, streams' largest "
                      f"gap {engine.max():.1f} s): measured again")
    gaps = _gaps(streams)
    spans = [(len(t), round(t[0] - t0, 2) if t else None, round(t[-1] - t0, 2) if t else None) for t in streams]
    # Normal here (CPU lane, SmolLM2, 3 streams on a shared 2-core box): p95 ~0.1 s, an odd gap up to
    # ~1.1 s. Before the fix every stream stopped for SLOW_S (8 s) when the slow request finished.
    stalled = [(i, round(float(np.diff(t).max()), 2) if len(t) > 1 else None, round(t[0] - begun, 2) if t else None)
               for i, t in enumerate(streams) if len(t) < 2 or np.diff(t).max() >= bound or t[0] - begun > 10 * bound]
    report = (f"inter-event gaps: baseline p95 {p95 * 1e3:.0f} ms max {normal.max() * 1e3:.0f} ms; with the slow "
              f"consumer p95 {np.percentile(gaps, 95) * 1e3:.0f} ms max {gaps.max() * 1e3:.0f} ms, any stream's "
              f"events at most {engine.max() * 1e3:.0f} ms apart; slow request's last token after "
              f"{(last_token or t0) - t0:.2f} s, its capture chunk {waited:.2f} s later; streams' "
              f"(events, first, last event after its start) {spans}; streams (index, largest gap, first event after "
              f"opening) with a gap over {bound:.1f} s, no events or a first event over {10 * bound:.0f} s late: {stalled}")
    print(report)
    if stalled:  # one stream quiet while the others decode is not the engine held: reported, pass or fail
        warnings.warn(f"a stream stalled while others decoded: {report}\n{log_tail(log, 60)}")
    if last_token is not None and last_token - t0 > bound:  # its tokens late, not its capture: reported
        warnings.warn(f"the slow request's tokens came late: {report}\n{log_tail(log, 60)}")
    # the streams decoded while the slow request finished and its response waited (its finish fell inside them)
    assert any(t[0] < t0 and t[-1] > t1 + 1.0 for t in streams), report
    # the engine kept stepping: from the slow request's start to a second after its response, tokens
    # kept coming (on some stream) with no gap a held engine core would leave
    assert engine.max() < bound, report
    assert status == 200 and last_token is not None and cap is not None, report
    # the response waited for its slow consumer until the timeout, not for its sleep (timed from its own last
    # token: the engine's part of the request is not what this checks)
    assert CAPTURE_TIMEOUT_S - 0.5 <= waited < CAPTURE_TIMEOUT_S + 2.5 < SLOW_S, f"{report}\n{log_tail(log, 80)}"
    assert cap["slow"] == {"error": "timeout",
                           "message": f"no result within {CAPTURE_TIMEOUT_S} s (steer.capture_result_timeout_s)"}
    assert cap["probe"]["rows"] == 1  # the fast consumer's result came in (its own lane)
    # once its lane is free the slow consumer answers again, and nothing of the timed-out request leaks
    deadline = time.monotonic() + SLOW_S + 3 * CAPTURE_TIMEOUT_S
    while True:
        r = complete(base, model, capture={"slow": {**SLOW_SPEC, "sleep_s": 0}})
        assert r.status_code == 200, r.text
        if "error" not in r.json()["capture"]["slow"] or time.monotonic() > deadline:
            break
    assert r.json()["capture"]["slow"] == {"slept_s": 0.0}
