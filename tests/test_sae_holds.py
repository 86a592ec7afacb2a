"""The engine core's side of a runtime SAE registration across data-parallel engines
(engine/module_rpc.py ``vllm_steer_sae_hold`` / ``_release`` / ``_register_sae``): each engine
answers for itself, a hold keeps the name and sites from another registration until it is recorded,
released or expired, and a registration is refused while unfinished requests clamp at its site."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_steer.core.payload import PAYLOAD_KEY, SteerPayload, encode_payload
from vllm_steer.core.rpc import HoldSae, RegisterSae
from vllm_steer.engine import module_registry, module_rpc
from vllm_steer.engine.module_registry import registry_of


def _core(requests=()):
    core = SimpleNamespace(scheduler=SimpleNamespace(requests={i: r for i, r in enumerate(requests)}))
    registry_of(core, "sae")._counter = None  # no shared file for a test core
    return core


def _clamping(site: str, runtime: bool = True):
    """A request clamping at ``site`` with the runtime SAE "s" (else with a start-up SAE "boot" sharing the site)."""
    hook, layer = site.split(".")
    name = "s" if runtime else "boot"
    payload = SteerPayload(None, "d", sae={"d": [(name, hook, int(layer), 1, b"", b"", b"")]},
                           sae_versions={"s": 1} if runtime else None)
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args={PAYLOAD_KEY: encode_payload(payload)}))


def _call(core, forward=None):
    return module_rpc.Call(core, object(), forward)


def _hold(core, name, version, sites):
    return module_rpc._hold_sae(_call(core), HoldSae(name, version, {"replace": False}, sites))[0]


def _register(core, name, version, sites):
    calls = []
    out = module_rpc._register_sae(_call(core, lambda *a: calls.append(a) or [{"staged": True}]),
                                   RegisterSae("path", None, None, [1], sites, name, version, {"replace": False}))
    return out[0], calls


def test_a_hold_keeps_name_and_sites_from_another_registration_until_recorded():
    core = _core()
    assert _hold(core, "a", 10, ["post_mlp.1"]) == {"held": 10}
    assert _hold(core, "b", 11, ["post_mlp.1"]) == {"refused": "pending", "holder": "a"}
    assert _hold(core, "a", 12, ["post_mlp.2"]) == {"refused": "pending", "holder": "a"}
    assert _register(core, "b", 11, ["post_mlp.1"])[0] == {"refused": "pending", "holder": "a"}
    reply, calls = _register(core, "a", 10, ["post_mlp.1"])  # its own hold does not refuse it
    assert reply == {"staged": True} and len(calls) == 1
    assert registry_of(core, "sae").listing()["versions"] == {"a": 10}
    assert _hold(core, "b", 13, ["post_mlp.1"]) == {"refused": "held", "site": "post_mlp.1", "holder": "a"}
    assert _hold(core, "b", 14, ["post_mlp.3"]) == {"held": 14}  # the recorded hold is gone, another site is free


def test_a_released_or_expired_hold_no_longer_counts(monkeypatch):
    core = _core()
    assert _hold(core, "a", 10, ["post_mlp.1"]) == {"held": 10}
    registry_of(core, "sae").release(10)
    assert _hold(core, "b", 11, ["post_mlp.1"]) == {"held": 11}
    now = module_registry.time.monotonic()
    monkeypatch.setattr(module_registry.time, "monotonic", lambda: now + module_registry.HOLD_SECONDS + 1)
    assert _hold(core, "c", 12, ["post_mlp.1"]) == {"held": 12}


@pytest.mark.parametrize("where", ["hold", "register"])
def test_an_engine_whose_requests_clamp_at_the_site_refuses(where):
    """Requests of a runtime SAE at the site refuse it; those of a start-up SAE sharing the site (its own region of
    the site's pack) do not count."""
    core = _core([_clamping("post_mlp.1"), _clamping("post_mlp.1"), _clamping("post_mlp.2"),
                  _clamping("post_mlp.1", runtime=False)])
    reply = _hold(core, "a", 10, ["post_mlp.1"]) if where == "hold" else _register(core, "a", 10, ["post_mlp.1"])[0]
    assert reply == {"busy": {"post_mlp.1": 2}}
    assert registry_of(core, "sae").listing()["versions"] == {}
    core = _core([_clamping("post_mlp.1", runtime=False), _clamping("post_mlp.2")])
    reply = _hold(core, "a", 10, ["post_mlp.1"]) if where == "hold" else _register(core, "a", 10, ["post_mlp.1"])[0]
    assert reply == ({"held": 10} if where == "hold" else {"staged": True})


def test_a_request_prepared_for_an_sae_registration_that_is_gone_is_refused_in_the_engine():
    """Another API process deleted and re-registered the SAE while this request was on its way: the
    engine core refuses it (400 naming sae.name) instead of clamping with the new weights."""
    from vllm_steer.engine.scheduler import _gone_sae

    core = _core()
    _register(core, "a", 10, ["post_mlp.1"])
    prepared = SteerPayload(sae_versions={"a": 10})
    assert _gone_sae(prepared, core.scheduler) is None and _gone_sae(SteerPayload(), core.scheduler) is None
    registry_of(core, "sae").remove("a")
    gone = _gone_sae(prepared, core.scheduler)
    assert (gone.status, gone.param) == (400, "sae.name") and "registration 10 is gone" in gone.message
    _register(core, "a", 11, ["post_mlp.1"])  # the same name at the same site: other weights
    assert _gone_sae(prepared, core.scheduler).param == "sae.name"
    assert _gone_sae(SteerPayload(sae_versions={"a": 11}), core.scheduler) is None
