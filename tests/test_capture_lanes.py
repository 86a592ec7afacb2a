"""A capture consumer stuck in a call (CPU, no engine): each lane queues at most
``MAX_QUEUED_FINISHES`` finished requests; the next ones are dropped for that consumer at once (a
driver result ``{"error": "dropped"}``, counted), the other consumers get every request (their
results sent at once, as partial messages), and once the stuck call returns the queued ones are
delivered and each request's final message is sent."""

from __future__ import annotations

import threading
import time

import torch

from vllm_steer.capture.consumer import CaptureConsumer
from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod

RELEASE = threading.Event()


class Stuck(CaptureConsumer):
    location = "driver"

    def __init__(self, instance: str, **params) -> None:
        self.seen: list[str] = []

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        pass

    def on_request_finished(self, request_id, meta):
        RELEASE.wait(60)  # the first call hangs until the test lets it go
        self.seen.append(request_id)
        return {"seen": request_id}


class Quick(Stuck):
    def on_request_finished(self, request_id, meta):
        self.seen.append(request_id)
        return {"seen": request_id}


def _wait(cond, what, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.01)


class Sent:
    """Stands in for the worker's ResultPusher: what would have gone to the submitter."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str, int, dict]] = []
        self.lock = threading.Lock()

    def push(self, address, key, count, results) -> bool:
        with self.lock:
            self.messages.append((address, key, count, dict(results)))
        return True

    def of(self, key):
        with self.lock:
            return [(c, r) for _, k, c, r in self.messages if k == key]


def test_a_stuck_consumer_holds_at_most_its_bound_and_the_rest_are_dropped_for_it_alone(monkeypatch):
    classes = {"stuck": Stuck, "quick": Quick}
    monkeypatch.setattr(capture_mod, "consumer_class", classes.__getitem__)
    monkeypatch.setattr(capture_mod, "MAX_QUEUED_FINISHES", 3)
    cfg = SteerConfig.model_validate({"capture": ["stuck", "quick"]})
    rt = capture_mod.CaptureRuntime(cfg, [("post_mlp", 0)], 2, 16, 8, torch.float32, torch.device("cpu"))
    spec = {"layers": [0], "hooks": ["post_mlp"], "positions": "last_prompt"}
    ids = [f"r{i}" for i in range(6)]
    RELEASE.clear()
    stuck, quick = (rt.consumers[rt.bit_of[n]][1] for n in ("stuck", "quick"))
    sent = rt._pusher = Sent()
    for i, rid in enumerate(ids):  # one at a time: the quick consumer keeps up, the stuck one does not
        rt.add_request(rid, {"stuck": spec, "quick": spec}, prompt_len=4, meta={"capture_reply": "ipc://inbox"})
        rt.finish_request(rid)
        _wait(lambda: len(quick.seen) == i + 1, lambda: f"the quick consumer got {quick.seen}, stats {rt.stats}")
    # r0 is in the stuck call, r1 and r2 wait in its queue (3 slots); r3..r5 found it full
    assert rt.stats["dropped_finishes"] == 3
    for rid in ("r0", "r1", "r2"):  # the quick result went at once; the request is not complete
        assert sent.of(rid) == [(0, {"quick": {"seen": rid}})]
    for rid in ("r3", "r4", "r5"):  # complete at once: no wait for a consumer that will not come
        _wait(lambda: [c for c, _ in sent.of(rid)] == [0, 1], lambda: f"{rid}: {sent.of(rid)}")
        final = sent.of(rid)[-1][1]
        assert final["quick"] == {"seen": rid}
        assert final["stuck"]["error"] == "dropped" and "stuck" in final["stuck"]["message"]
    RELEASE.set()
    _wait(lambda: len(stuck.seen) == 3, f"the stuck consumer got {stuck.seen}")
    for rid in ("r0", "r1", "r2"):
        _wait(lambda: len(sent.of(rid)) == 2, lambda: f"{rid}: {sent.of(rid)}")
        assert sent.of(rid)[-1] == (1, {"quick": {"seen": rid}, "stuck": {"seen": rid}})
    assert {m[0] for m in sent.messages} == {"ipc://inbox"}
    assert stuck.seen == ["r0", "r1", "r2"]  # the dropped ones never reached it
    rt.add_request("r6", {"stuck": spec}, prompt_len=4)  # its slots are free again
    rt.finish_request("r6")
    _wait(lambda: stuck.seen[-1:] == ["r6"], "a freed lane takes requests again")
    assert rt.stats["dropped_finishes"] == 3
