"""The public API (``vllm_steer.__all__``) against the shared SmolLM2 server: ``Client`` and
``AsyncClient`` register, list, use and delete a module with numpy vectors (equal to the same vectors
sent inline), read SAEs and status, all as typed answers (``client_types``) equal to the raw JSON the routes
give, and raise ``SteeringAPIError`` with the server's status and field; importing ``vllm_steer`` does not import
vLLM."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import msgspec
import numpy as np
import pytest

import vllm_steer
from tests.conftest import API_KEY
from tests.steering_cases import vector
from vllm_steer import Applied, AsyncClient, Client, Completion, Module, Sae, SaeList, Status, SteeringAPIError
from vllm_steer.client_types import decoded

VEC = vector(576, 33, 60.0)
PROMPT = "The capital of France is"


def test_every_public_name_resolves_and_import_stays_light():
    assert all(getattr(vllm_steer, name) is not None for name in vllm_steer.__all__)
    code = "import sys, vllm_steer; assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vllm_steer.nope  # noqa: B018


def _keys(response: Completion) -> tuple:
    """The config keys a response reports (its ``steering`` also says what was applied: module, counts)."""
    return response.steering.prefill, response.steering.decode


def test_client_module_lifecycle_equals_inline_vectors(api_server):
    base = api_server[0]
    with Client(base, api_key=API_KEY) as c:
        summary = c.register_module("client-mod", steering_vectors={"post_mlp": {14: VEC}}, description="d")
        assert isinstance(summary, Module) and summary.layers == [14] and summary.hooks == ["post_mlp"]
        assert summary.sites == {"steering_vectors": ["post_mlp.14"]} and summary.in_flight is None
        assert "client-mod" in {m.name for m in c.modules()} and c.module("client-mod").in_flight == 0
        raw_module = httpx.get(f"{base}/v1/steering/modules/client-mod", timeout=60).json()
        assert c.module("client-mod").as_dict() == raw_module  # every key the route gives, typed
        via = c.complete(PROMPT, module={"name": "client-mod"}, max_tokens=8, temperature=0)
        inline = c.complete(PROMPT, steering_vectors={"post_mlp": {14: VEC}}, max_tokens=8, temperature=0)
        plain = c.complete(PROMPT, max_tokens=8, temperature=0)
        assert via.text == inline.text != plain.text and via.text == via.raw["choices"][0]["text"]
        assert _keys(via) == _keys(inline) and isinstance(via.steering, Applied)
        # the applied report, typed: the module at the version registered, its default scale, one site moved
        assert (via.steering.module.name, via.steering.module.version) == ("client-mod", summary.version)
        assert via.steering.module.scale == 1.0 and via.steering.module.norm is None and via.steering.sites == 1
        assert inline.steering.module is None and inline.steering.sites == 1 and plain.steering is None
        assert via.usage.completion_tokens == 8 and via.choices[0].finish_reason == "length"
        assert via.capture == via.raw["capture"] and "probe" in via.capture  # the server's capture-all consumer
        # a condition (numpy probe, sent packed) on a module and on a request: a hard gate every token passes
        # steers fully
        cond = {"site": "post_mlp.10", "probe": vector(576, 7, 1.0), "threshold": -1e30, "mode": "hard"}
        assert c.register_module("client-cond", steering_vectors={"post_mlp": {14: VEC}}, condition=cond).condition == {
            **cond, "probe": {"dtype": "float32", "packed": True}}
        gated = c.complete(PROMPT, module={"name": "client-cond"}, max_tokens=8, temperature=0)
        sent = c.complete(PROMPT, steering_vectors={"post_mlp": {14: VEC}}, condition=cond, max_tokens=8, temperature=0)
        assert gated.text == sent.text == inline.text
        assert _keys(gated) == _keys(sent) != _keys(inline)
        assert gated.steering.condition is sent.steering.condition is True and via.steering.condition is False
        assert c.delete_module("client-cond").deleted == "client-cond"
        # projections: a numpy direction (sent packed) equals the same direction as a JSON list
        ablate = c.complete(PROMPT, projections={"post_mlp": {14: [{"direction": VEC, "mode": "ablate"}]}},
                            max_tokens=8, temperature=0)
        listed = c.complete(PROMPT, projections={"post_mlp.14": [{"direction": VEC.tolist(), "mode": "ablate"}]},
                            max_tokens=8, temperature=0)
        assert ablate.steering == listed.steering and "steering" not in plain.raw  # one config key, applied
        assert ablate.steering.projections == 1 and ablate.text == listed.text
        with pytest.raises(SteeringAPIError) as e:
            c.register_module("client-mod", steering_vectors={"post_mlp": {14: VEC}})
        assert e.value.status == 409 and e.value.param == "name"
        assert c.delete_module("client-mod").deleted == "client-mod"
        with pytest.raises(SteeringAPIError) as e:
            c.complete(PROMPT, module="client-mod", max_tokens=2)
        assert e.value.status == 400 and e.value.param == "steering_module.name" and "unknown steering module" in e.value.message
        saes = c.saes()
        assert isinstance(saes, SaeList) and "fz" in {s.name for s in saes.data}
        fz = c.sae("fz")
        assert isinstance(fz, Sae) and fz.source == "config" and fz.d_sae == 64 and fz.modes[0] == "delta"
        assert [s.site for s in saes.slots] == [s["site"] for s in httpx.get(f"{base}/v1/steering/sae",
                                                                              timeout=60).json()["slots"]]
        status = c.status()
        assert isinstance(status, Status) and status.enabled and status.config["max_configs"] == 16
        assert status.model.hidden_size == 576 and status.model.num_layers == 30 and "post_mlp" in status.model.hooks
        assert status.workers and all(w.steering and w.rows == 16 for w in status.workers)


def test_async_client_does_the_same(api_server):
    async def run():
        async with AsyncClient(api_server[0], api_key=API_KEY) as c:
            await c.register_module("async-mod", steering_vectors={"post_mlp": {14: VEC}})
            try:
                via = await c.complete(PROMPT, module="async-mod", max_tokens=8, temperature=0)
                inline = await c.complete(PROMPT, steering_vectors={"post_mlp": {14: VEC}}, max_tokens=8, temperature=0)
            finally:
                await c.delete_module("async-mod")
            with pytest.raises(SteeringAPIError) as e:
                await c.module("async-mod")
            return via, inline, e.value

    via, inline, err = asyncio.run(run())
    assert isinstance(via, Completion) and via.text == inline.text and via.steering.module.name == "async-mod"
    assert err.status == 404 and err.param == "name"


def test_client_without_the_key_is_refused_naming_it(api_server):
    with Client(api_server[0]) as c, pytest.raises(SteeringAPIError) as e:
        c.register_module("nokey", steering_vectors={"post_mlp": {14: np.ones(576, np.float32)}})
    assert e.value.status == 401


def test_typed_answers_tolerate_new_keys_and_name_a_wrong_shape():
    """A newer server's extra keys are ignored; a body of another shape is a ValueError naming where."""
    status = decoded({"version": "9", "enabled": True, "model": {"num_layers": 2, "hidden_size": 8, "hooks": ["post_mlp"],
                                                                  "dtype": "bfloat16", "new": 1},
                      "config": {}, "workers": [{"pid": 7, "new": [1]}], "newer": {}}, Status)
    assert status.model.hidden_size == 8 and status.workers[0].pid == 7 and status.workers[0].steering is False
    body = {"id": "c", "model": "m", "choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}],
            "steering": {"prefill": "k", "decode": None, "sites": 2, "module": {"name": "j", "version": 3, "norm": 0.1},
                         "new": True}}
    out = decoded(body, Completion)
    assert out.texts == ["a", "b"] and out.raw is body and out.steering.module.norm == 0.1
    assert out.steering.module.scale is None and out.usage is None
    with pytest.raises(msgspec.ValidationError, match=r"\$\.model\.hooks"):
        decoded({"version": "9", "enabled": True, "model": {"num_layers": 2, "hidden_size": 8, "hooks": 3,
                                                             "dtype": "x"}, "config": None}, Status)
    with pytest.raises(ValueError, match="name"):
        decoded({"data": [{"name": 1}]}, SaeList)


_RACE = """
import sys, threading
sys.setswitchinterval(1e-6)
from vllm_steer.client_types import Completion, decoded
body = {"id": "c", "model": "m", "choices": [{"index": 0, "text": "a"}], "usage": {"total_tokens": 2},
        "steering": {"prefill": "k", "module": {"name": "j"}}}
go = threading.Barrier(8)
def one():
    go.wait()
    decoded(body, Completion)
threads = [threading.Thread(target=one) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
"""


def test_first_answers_decoded_on_several_threads_at_once_do_not_crash():
    """msgspec builds a Struct's decoding info at its first use, and two threads doing that at once segfaulted the
    extraction example in CI (its pool decodes completions in parallel; 5 of 30 runs of this script crashed before
    `core.struct_info.prebuild`). Each run is a fresh interpreter, so each is a first use."""
    codes = [subprocess.run([sys.executable, "-c", _RACE], capture_output=True).returncode for _ in range(20)]
    assert codes == [0] * 20
