"""The capture result channel without an engine: a worker's ``ResultPusher`` sends over a real ZMQ
ipc socket to a ``ResultInbox``, which hands each waiting response its ids' results when every
expected message is in, keeps results that came before the wait, and ends a wait at its deadline
(timeout error per missing driver instance) or at once when the engine is dead. Under pipeline
parallelism: per-stage results merged (``activations``) or failed per stage, and the front end and the
workers agreeing on which stages report."""

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


# ---- pipeline parallelism (issue 37 item 4): per-stage results merged where the request is taken ---------

HIDDEN = 8
STAGE_SITES = ([(0, "pre_attn"), (0, "post_attn")], [(0, "post_mlp"), (1, "pre_attn"), (1, "post_mlp")])


def _activations_result(sites, rows_of, reduce="mean", dropped_rows=0):
    """What an ``activations`` instance returns after seeing ``sites``' rows (one stage's, or all)."""
    from vllm_steer.capture.activations import ActivationStats

    acts = ActivationStats("act")
    for layer, hook in sites:
        positions, rows = rows_of[(layer, hook)]
        acts.on_rows("r", layer, hook, positions[:3], rows[:3], {})  # two packets, as two steps send them
        acts.on_rows("r", layer, hook, positions[3:], rows[3:], {})
    return acts.on_request_finished("r", {"params": {"reduce": reduce}, "dropped_rows": dropped_rows})


def _stage_rows():
    rng = np.random.default_rng(5)
    return {site: (np.arange(5), rng.standard_normal((5, HIDDEN)).astype(np.float32))
            for sites in STAGE_SITES for site in sites}


@pytest.mark.parametrize("reduce", ["mean", "last"])
def test_an_activations_result_from_two_stages_merges_into_the_one_stage_result(box, reduce):
    """Each stage's instance sees its own sites; the stages' messages arrive in any order over the real
    socket (the later stage first, the worker-consumer-only message of a stage apart); the response gets
    exactly the result one instance seeing every site returns (same sites order, bytes, counts)."""
    from vllm_steer.capture.activations import ActivationStats, decode_result

    rows_of = _stage_rows()
    whole = _activations_result(STAGE_SITES[0] + STAGE_SITES[1], rows_of, reduce)
    per_stage = [_activations_result(sites, rows_of, reduce, dropped_rows=k + 1) for k, sites in enumerate(STAGE_SITES)]
    box.expect("r", ["act"], 2, requests=1, stages={"act": (0, 1)}, merge={"act": ActivationStats.merge})
    pusher = ResultPusher()
    assert pusher.push(box.address, "r", 0, {"act": per_stage[1]}, stage=1)  # a partial: a worker lane still at it
    assert pusher.push(box.address, "r", 1, {}, stage=1)
    assert pusher.push(box.address, "r", 1, {"act": per_stage[0]}, stage=0)
    got = box.wait_blocking(["r"], 5.0)["r"]["act"]
    assert got["sites"] == whole["sites"] == ["post_attn.0", "post_mlp.0", "pre_attn.0", "post_mlp.1", "pre_attn.1"]
    assert got["data"] == whole["data"] and got["count"] == whole["count"] == [5] * 5
    assert got["dropped_rows"] == 3  # each stage's drops
    assert set(decode_result(got)) == set(whole["sites"])
    pusher.close()


def test_activations_merge_refuses_a_site_two_stages_returned():
    from vllm_steer.capture.activations import ActivationStats

    rows_of = _stage_rows()
    a = _activations_result(STAGE_SITES[0], rows_of)
    with pytest.raises(ValueError, match="post_attn.0 is in two stages"):
        ActivationStats.merge([a, a])


def _merge_fail(results):
    raise RuntimeError("cannot")


def test_a_failed_or_silent_stage_decides_only_its_instances_result(box):
    """Per driver instance: an error object from one stage is its result (the stage named); a stage that
    never answered is a timeout there; an instance on the answering stage alone keeps its result, and
    one that returned nothing there has no key; a raising merge and a class without merge are errors."""
    died = {"error": "consumer_died", "message": "the consumers' process died"}
    merge = {"span": lambda rs: {"n": sum(r["n"] for r in rs)}, "bad": _merge_fail, "died": lambda rs: rs}
    stages = {"span": (0, 1), "died": (0, 1), "bad": (0, 1), "plain": (0, 1), "first": (0,), "silent": (0,),
              "late": (0, 2)}
    box.expect("r", sorted(stages), 3, requests=1, stages=stages, merge=merge)  # stages 0, 1, 2 send
    box.deliver("r", 1, {"span": {"n": 1}, "died": {"n": 1}, "bad": {"n": 1}, "plain": {"n": 1},
                         "first": {"n": 7}, "late": {"n": 1}}, stage=0)
    box.deliver("r", 1, {"span": {"n": 2}, "died": died, "bad": {"n": 2}, "plain": {"n": 2}}, stage=1)
    got = box.wait_blocking(["r"], 0.3)["r"]  # stage 2 never answers
    assert got == {"span": {"n": 3}, "died": {**died, "stage": 1}, "first": {"n": 7},
                   "bad": {"error": "merge_failed", "message": got["bad"]["message"]},
                   "plain": {"error": "not_mergeable", "message": got["plain"]["message"]},
                   "late": {**timeout_error(0.3), "stage": 2}}
    assert "RuntimeError: cannot" in got["bad"]["message"] and "stages [0, 1]" in got["plain"]["message"]
    box.expect("s", ["act"], 2, requests=1, stages={"act": (0, 1)}, merge={"act": lambda rs: rs})
    box.deliver("s", 1, {"act": {"n": 1}}, stage=0)
    assert box.wait_blocking(["s"], 5.0, dead=lambda: True)["s"] == {"act": {**engine_dead_error(), "stage": 1}}
    box.expect("none", [], 0)  # nothing will come (no stage holds a consumer of it): complete now
    t0 = time.monotonic()
    assert box.wait_blocking(["none"], 5.0) == {"none": {}} and time.monotonic() - t0 < 1.0


def _pp_frontend(pp: int):
    from types import SimpleNamespace

    import torch

    from vllm_steer.frontend.prepare import SteeringFrontend

    mc = SimpleNamespace(dtype=torch.float32, hf_text_config=SimpleNamespace(num_hidden_layers=4),
                         get_hidden_size=lambda: HIDDEN)
    steer = {"capture": [{"name": "activations", "instance": "act"}, {"name": "probe", "instance": "probe",
                                                                       "params": {"dim": HIDDEN}},
                         {"name": "filesystem", "instance": "fs", "params": {"root": "/nonexistent"}}]}
    return SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": steer},
                                            parallel_config=SimpleNamespace(pipeline_parallel_size=pp)))


def test_the_front_end_expects_each_driver_instance_from_the_stages_of_its_sites(probe_plugin):
    """4 layers on 2 stages (layers 0-1, 2-3; post_mlp.L is on layer L+1's stage): a mergeable driver may
    span stages, a driver without merge is refused (400, naming the field and both stages) only when its
    sites span them; the messages that end a request come from every stage when a worker consumer
    captures it, else from its drivers' stages."""
    from vllm_steer.capture.activations import ActivationStats
    from vllm_steer.core.errors import SteeringSpecError

    fe = _pp_frontend(2)

    def expect(capture, n=1):
        return fe.capture_expectation(fe.engine_extra_args({"capture": capture}).payload.capture, n)

    both = {"layers": [0, 3], "hooks": ["pre_attn"], "positions": "all"}
    late = {"sites": ["post_mlp.1", "pre_attn.3"], "positions": "all"}
    assert expect({"act": both, "fs": both}, n=2) == {
        "instances": ["act"], "messages": 4, "requests": 2, "stages": {"act": (0, 1)}, "merge": {"act": ActivationStats.merge}}
    assert expect({"act": late, "probe": late}) == {
        "instances": ["act", "probe"], "messages": 1, "requests": 1, "stages": {"act": (1,), "probe": (1,)}, "merge": {}}
    assert expect({"fs": late})["messages"] == 2  # a worker consumer: every stage finishes its request
    with pytest.raises(SteeringSpecError) as refused:
        expect({"probe": {"sites": ["pre_attn.1", "post_mlp.1"]}})
    assert refused.value.field == "capture.probe.sites"
    assert "pre_attn.1 is on stage 0, post_mlp.1 on stage 1" in str(refused.value)
    assert _pp_frontend(1).capture_expectation({"act": both, "probe": both}, 3) == {
        "instances": ["act", "probe"], "messages": 3}


@pytest.mark.parametrize("pp", [1, 2])
def test_a_request_whose_consumers_all_say_not_to_wait_is_complete_at_once_and_gets_no_reply(probe_plugin, pp):
    """``"wait": false`` to the filesystem consumer (a worker consumer's ``response_waits``): with no driver beside it
    nothing is expected (complete at once) and its payload carries no reply address (the workers push nothing back);
    with a driver, or the filesystem consumer's default, the response waits as before."""
    from vllm_steer.frontend.prepare import _prepared

    fe = _pp_frontend(pp)
    nowait = {"layers": [0, 3], "hooks": ["pre_attn"], "positions": "all", "wait": False}
    waits = {k: v for k, v in nowait.items() if k != "wait"}

    def payload(capture):
        return _prepared(fe, {"capture": capture}, f"req-{pp}").payload

    assert fe.capture_expectation({"fs": nowait}, 2) == {"instances": [], "messages": 0}
    assert payload({"fs": nowait}).capture_reply is None
    for capture in ({"fs": waits}, {"fs": nowait, "act": waits}, {"act": waits}):
        assert fe.capture_expectation(capture, 1)["messages"] >= 1, capture
        assert payload(capture).capture_reply == inbox_mod.inbox().address, capture


def test_each_stage_hears_of_a_request_where_the_front_end_expects_its_messages(probe_plugin):
    """The two ends count stages apart (the worker by the sites its norms hold, written out here per
    stage; the front end by vLLM's layer partition): a driver hears of a request on exactly the stages
    the front end expects its results from, a worker consumer on every stage; the finish meta names
    the stage."""
    import torch

    from vllm_steer.core.config import SteerConfig
    from vllm_steer.runtime.capture import CaptureRuntime

    hooks = ("pre_attn", "post_attn", "post_mlp")
    stage_sites = ([("pre_attn", 0), ("post_attn", 0), ("post_mlp", 0), ("pre_attn", 1), ("post_attn", 1)],
                   [("post_mlp", 1), ("pre_attn", 2), ("post_attn", 2), ("post_mlp", 2), ("pre_attn", 3),
                    ("post_attn", 3), ("post_mlp", 3)])
    cfg = SteerConfig.model_validate({"capture": ["activations:instance=act", "logging:instance=fs"],
                                      "hooks": list(hooks)})
    runtimes = [CaptureRuntime(cfg, sites, 4, 16, HIDDEN, torch.float32, torch.device("cpu"), pp_rank=k, pp_size=2)
                for k, sites in enumerate(stage_sites)]
    fe = _pp_frontend(2)
    try:
        specs = [{"sites": ["post_attn.1"]}, {"sites": ["post_mlp.1"]}, {"sites": ["post_mlp.0", "post_mlp.3"]},
                 {"layers": "all", "hooks": "all"}, {"sites": ["pre_attn.0", "pre_attn.2"]}]
        def heard(request_id, capture):
            for rt in runtimes:
                rt.add_request(request_id, capture, 3)
            return tuple(k for k, rt in enumerate(runtimes) if request_id in rt._requests)

        for i, spec in enumerate(specs):
            capture = fe.engine_extra_args({"capture": {"act": spec}}).payload.capture
            want = fe.capture_expectation(capture, 1)
            assert heard(f"r{i}", capture) == want["stages"]["act"] and want["messages"] == len(want["stages"]["act"])
            both = fe.engine_extra_args({"capture": {"act": spec, "fs": spec}}).payload.capture
            assert heard(f"w{i}", both) == (0, 1) and fe.capture_expectation(both, 1)["messages"] == 2
        assert [want["stages"]["act"] for want in (fe.capture_expectation({"act": s}, 1) for s in specs)] == [
            (0,), (1,), (0, 1), (0, 1), (0, 1)]
        assert [rt.stage for rt in runtimes] == [0, 1] and {rt.stages for rt in runtimes} == {2}
    finally:
        for rt in runtimes:
            rt.close()
