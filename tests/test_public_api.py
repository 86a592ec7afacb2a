"""The public API (``vllm_steer.__all__``) against the shared SmolLM2 server: ``Client`` and
``AsyncClient`` register, list, use and delete a module with numpy vectors (equal to the same vectors
sent inline), read SAEs and status, and raise ``SteeringAPIError`` with the server's status and field;
importing ``vllm_steer`` does not import vLLM."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

import vllm_steer
from tests.conftest import API_KEY
from tests.steering_cases import vector
from vllm_steer import AsyncClient, Client, SteeringAPIError

VEC = vector(576, 33, 60.0)
PROMPT = "The capital of France is"


def test_every_public_name_resolves_and_import_stays_light():
    assert all(getattr(vllm_steer, name) is not None for name in vllm_steer.__all__)
    code = "import sys, vllm_steer; assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vllm_steer.nope  # noqa: B018


def _keys(response: dict) -> tuple:
    """The config keys a response reports (its ``steering`` also says what was applied: module, counts)."""
    return response["steering"]["prefill"], response["steering"]["decode"]


def test_client_module_lifecycle_equals_inline_vectors(api_server):
    base = api_server[0]
    with Client(base, api_key=API_KEY) as c:
        summary = c.register_module("client-mod", steering_vectors={"post_mlp": {14: VEC}}, description="d")
        assert summary["layers"] == [14] and summary["hooks"] == ["post_mlp"]
        assert "client-mod" in {m["name"] for m in c.modules()} and c.module("client-mod")["in_flight"] == 0
        via = c.complete(PROMPT, module={"name": "client-mod"}, max_tokens=8, temperature=0)
        inline = c.complete(PROMPT, steering_vectors={"post_mlp": {14: VEC}}, max_tokens=8, temperature=0)
        plain = c.complete(PROMPT, max_tokens=8, temperature=0)
        assert via["choices"][0]["text"] == inline["choices"][0]["text"] != plain["choices"][0]["text"]
        assert _keys(via) == _keys(inline) and via["steering"]["module"]["name"] == "client-mod"
        # a condition (numpy probe, sent packed) on a module and on a request: a hard gate every token passes
        # steers fully
        cond = {"site": "post_mlp.10", "probe": vector(576, 7, 1.0), "threshold": -1e30, "mode": "hard"}
        assert c.register_module("client-cond", steering_vectors={"post_mlp": {14: VEC}}, condition=cond)["condition"] == {
            **cond, "probe": {"dtype": "float32", "packed": True}}
        gated = c.complete(PROMPT, module={"name": "client-cond"}, max_tokens=8, temperature=0)
        sent = c.complete(PROMPT, steering_vectors={"post_mlp": {14: VEC}}, condition=cond, max_tokens=8, temperature=0)
        assert gated["choices"][0]["text"] == sent["choices"][0]["text"] == inline["choices"][0]["text"]
        assert _keys(gated) == _keys(sent) != _keys(inline)
        assert gated["steering"]["condition"] is sent["steering"]["condition"] is True
        assert c.delete_module("client-cond") == {"deleted": "client-cond"}
        # projections: a numpy direction (sent packed) equals the same direction as a JSON list
        ablate = c.complete(PROMPT, projections={"post_mlp": {14: [{"direction": VEC, "mode": "ablate"}]}},
                            max_tokens=8, temperature=0)
        listed = c.complete(PROMPT, projections={"post_mlp.14": [{"direction": VEC.tolist(), "mode": "ablate"}]},
                            max_tokens=8, temperature=0)
        assert ablate["steering"] == listed["steering"] and "steering" not in plain  # one config key, applied
        assert ablate["choices"][0]["text"] == listed["choices"][0]["text"]
        with pytest.raises(SteeringAPIError) as e:
            c.register_module("client-mod", steering_vectors={"post_mlp": {14: VEC}})
        assert e.value.status == 409 and e.value.param == "name"
        assert c.delete_module("client-mod") == {"deleted": "client-mod"}
        with pytest.raises(SteeringAPIError) as e:
            c.complete(PROMPT, module="client-mod", max_tokens=2)
        assert e.value.status == 400 and e.value.param == "steering_module.name" and "unknown steering module" in e.value.message
        assert "fz" in {s["name"] for s in c.saes()["data"]} and c.sae("fz")["source"] == "config"
        assert c.status()["config"]["max_configs"] == 16


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
    assert via["choices"][0]["text"] == inline["choices"][0]["text"]
    assert err.status == 404 and err.param == "name"


def test_client_without_the_key_is_refused_naming_it(api_server):
    with Client(api_server[0]) as c, pytest.raises(SteeringAPIError) as e:
        c.register_module("nokey", steering_vectors={"post_mlp": {14: np.ones(576, np.float32)}})
    assert e.value.status == 401
