"""The capture result channel without an engine: a worker's ``ResultPusher`` sends over a real ZMQ
ipc socket to a ``ResultInbox``, which hands each waiting response its ids' results when every
expected message is in, keeps results that came before the wait, and ends a wait at its deadline
(timeout error per missing driver instance) or at once when the engine is dead."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from vllm_steer.capture import inbox as inbox_mod
from vllm_steer.capture.inbox import ResultInbox, engine_dead_error, timeout_error
from vllm_steer.runtime.result_push import ResultPusher


@pytest.fixture
def box():
    b = ResultInbox()
    yield b
    b.close()


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_pushed_results_reach_the_waiting_response_and_early_ones_are_kept(box):
    pusher = ResultPusher()
    box.expect("early", ["acts"], 1)
    box.expect("pp", ["acts"], 2)  # two pipeline stages each send one message
    assert pusher.push(box.address, "early", 1, {"acts": {"n": 1}})  # before anyone waits
    _until(lambda: box.stats["received"] == 1)

    async def main():
        waiting = asyncio.ensure_future(box.wait(["early", "pp"], 5.0))
        await asyncio.sleep(0.1)
        pusher.push(box.address, "pp", 1, {"acts": {"n": 2}})  # first stage: the driver result
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the second stage's worker consumers are still at it
        pusher.push(box.address, "pp", 1, {})
        t0 = time.monotonic()
        got = await waiting
        return got, time.monotonic() - t0

    got, took = asyncio.run(main())
    assert got == {"early": {"acts": {"n": 1}}, "pp": {"acts": {"n": 2}}}
    assert took < 1.0
    assert box.wait_blocking(["early"], 0.1) == {"early": {}}  # handed over once
    pusher.close()


def test_a_wait_ends_at_its_deadline_with_partial_results_and_timeout_errors(box):
    box.expect("r", ["quick", "stuck"], 1)
    box.deliver("r", 0, {"quick": {"ok": True}})  # a partial result: the request is not complete
    t0 = time.monotonic()
    got = asyncio.run(box.wait(["r"], 0.3))
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert got == {"r": {"quick": {"ok": True}, "stuck": timeout_error(0.3)}}


def test_a_dead_engine_ends_every_wait_at_once(box):
    box.expect("a", ["acts"], 1)
    box.expect("b", ["acts"], 1)
    dead = {"now": False}

    async def main():
        waits = [asyncio.ensure_future(box.wait([k], 30.0, dead=lambda: dead["now"])) for k in "ab"]
        await asyncio.sleep(0.2)
        dead["now"] = True
        t0 = time.monotonic()
        got = await asyncio.gather(*waits)
        return got, time.monotonic() - t0

    got, took = asyncio.run(main())
    assert got == [{"a": {"acts": engine_dead_error()}}, {"b": {"acts": engine_dead_error()}}]
    assert took < 1.0


def test_bounds_evict_the_oldest_and_unknown_messages_are_counted(box, monkeypatch):
    from prometheus_client import REGISTRY

    def exported(stat: str) -> float:  # what /metrics shows (this process's registry)
        return REGISTRY.get_sample_value(f"vllm_steer_capture_inbox_{stat}_total") or 0.0

    before = {k: exported(k) for k in ("evicted", "unexpected")}
    monkeypatch.setattr(inbox_mod, "MAX_ENTRIES", 2)
    for k in ("a", "b", "c"):
        box.expect(k, ["acts"], 1)
    assert box.stats["evicted"] == 1 and list(box._entries) == ["b", "c"]
    box.deliver("a", 1, {"acts": 1})
    assert box.stats["unexpected"] == 1
    box.ttl = 0.0
    box.deliver("b", 1, {"acts": 2})
    box._swept = 0.0
    box.expect("d", ["acts"], 1)  # a complete result past its TTL goes
    assert list(box._entries) == ["c", "d"] and box.stats["evicted"] == 2
    assert {k: exported(k) - v for k, v in before.items()} == {"evicted": 2, "unexpected": 1}


def test_a_push_to_nobody_never_blocks_and_is_counted_past_the_bound(monkeypatch):
    from vllm_steer.runtime import result_push

    monkeypatch.setattr(result_push, "SEND_HWM", 4)
    pusher = ResultPusher()
    t0 = time.monotonic()
    sent = [pusher.push("ipc:///tmp/vllm-steer-nobody-listens", "k", 1, {"x": i}) for i in range(200)]
    assert time.monotonic() - t0 < 5.0
    assert not all(sent) and pusher.failed == sent.count(False) > 0
    pusher.close()


def test_a_result_msgpack_cannot_encode_arrives_as_an_error_object(box):
    pusher = ResultPusher()
    box.expect("r", ["odd", "fine", "arr"], 1)
    assert pusher.push(box.address, "r", 0, {"fine": [1, 2]})
    assert pusher.push(box.address, "r", 1, {"odd": object(), "arr": np.arange(3, dtype=np.float32)})
    got = box.wait_blocking(["r"], 5.0)["r"]
    assert got["fine"] == [1, 2] and got["odd"]["error"] == "unserializable" and got["arr"] == [0.0, 1.0, 2.0]
    pusher.close()
