"""Site names (vllm_steer.core.site_names), without an engine: the parser, and every place a site is
named (request vectors, module files, capture specs, SAE site / sae_slots / manifest keys / request
clamps) fed TransformerLens names gives exactly what our names give; bad names are errors naming the
field and the accepted forms."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save

from tests.sae_writers import random_sae, write_gemma_scope, write_manifest
from vllm_steer.capture.spec import CaptureSpecError, parse_capture_spec
from vllm_steer.core.config import SaeModuleConfig, SteerConfig, SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import Slot, runtime_entry, sae_catalog, slot_sites
from vllm_steer.core.sae_files import SaeFileError, load_sae, read_sae_meta
from vllm_steer.core.site_names import TL_HOOKS, parse_site_name, tl_hook
from vllm_steer.frontend.module_files import read_safetensors
from vllm_steer.frontend.sae_spec import parse_sae
from vllm_steer.frontend.spec import ModelShape, parse_packed_fast, parse_spec

HOOKS = ("pre_attn", "post_attn", "post_mlp")
SHAPE = ModelShape(num_layers=4, hidden_size=8, hooks=HOOKS, layers=None, max_bytes=1 << 20)
PAIRS = [("pre_attn.0", "blocks.0.hook_resid_pre"), ("post_attn.3", "blocks.3.hook_resid_mid"),
         ("post_mlp.2", "blocks.2.hook_resid_post")]
D, F = 8, 16


def vec(seed: int) -> list[float]:
    return np.random.default_rng(seed).standard_normal(8).astype(np.float32).tolist()


def same_vectors(a: dict, b: dict) -> None:
    assert {h: sorted(ls) for h, ls in a.items()} == {h: sorted(ls) for h, ls in b.items()}
    for h, ls in a.items():
        for l, v in ls.items():
            np.testing.assert_array_equal(v, b[h][l])


# --- the parser -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ours, tl", PAIRS)
def test_both_spellings_parse_to_the_same_site(ours, tl):
    hook, _, layer = ours.partition(".")
    assert parse_site_name(ours) == parse_site_name(tl) == (hook, int(layer))


def test_the_table_and_the_hook_helper():
    assert TL_HOOKS == {"hook_resid_pre": "pre_attn", "hook_resid_mid": "post_attn", "hook_resid_post": "post_mlp"}
    assert tl_hook("hook_resid_post") == "post_mlp" and tl_hook("hook_mlp_out") is None
    assert parse_site_name("blocks.107.hook_resid_post") == ("post_mlp", 107)


@pytest.mark.parametrize("text, words", [
    ("blocks.3.hook_mlp_out", "unknown hook 'hook_mlp_out'"),
    ("blocks.3.hook_attn_out", "only the residual-stream hooks"),
    ("mlp.3", "unknown hook 'mlp'"),
    ("blocks.3", "unknown hook 'blocks'"),
    ("blocks.03.hook_resid_post", "leading zeros"),
    ("blocks.-1.hook_resid_post", "non-negative"),
    ("post_mlp.1 ", "decimal integer"),
    ("post_mlp.\u0663", "decimal integer"),
    ("post_mlp", "blocks.L.hook_resid_pre|mid|post"),
    ("model.blocks.3.hook_resid_post", "'hook.layer'"),
    ("", "'hook.layer'"),
    (3, "got int"),
    (None, "got NoneType"),
])
def test_bad_names_say_what_is_wrong(text, words):
    with pytest.raises(ValueError) as e:
        parse_site_name(text)
    assert words in str(e.value)


# --- request steering vectors ---------------------------------------------------------------------


def test_request_site_keys_equal_the_hook_form():
    a, b, c = vec(1), vec(2), vec(3)
    native = {"post_mlp": {"2": a, "1": b}, "pre_attn": {"0": c}}
    for tier in ("steering_vectors", "prefill_steering_vectors", "decode_steering_vectors"):
        want = parse_spec({tier: native}, SHAPE).tiers[tier]
        tl = parse_spec({tier: {"blocks.2.hook_resid_post": a, "blocks.1.hook_resid_post": b,
                                "blocks.0.hook_resid_pre": c}}, SHAPE).tiers[tier]
        mixed = parse_spec({tier: {"post_mlp": {"2": a}, "blocks.1.hook_resid_post": b, "pre_attn.0": c}},
                           SHAPE).tiers[tier]
        same_vectors(tl, want)
        same_vectors(mixed, want)


def test_a_site_key_merges_with_a_packed_hook():
    from vllm_steer.client import pack

    a, b = vec(1), vec(2)
    want = parse_spec({"steering_vectors": {"post_mlp": {"1": a, "3": b}}}, SHAPE).tiers["steering_vectors"]
    body = {"steering_vectors": {"post_mlp": pack(np.array([a], np.float32), [1]), "blocks.3.hook_resid_post": b}}
    assert parse_packed_fast(body, SHAPE) is None  # a site key takes the general path
    same_vectors(parse_spec(body, SHAPE).tiers["steering_vectors"], want)


@pytest.mark.parametrize("tier, field, words", [
    ({"post_mlp": {"2": vec(0)}, "blocks.2.hook_resid_post": vec(1)}, "steering_vectors.blocks.2.hook_resid_post",
     "site post_mlp.2 is given twice in steering_vectors"),
    ({"blocks.2.hook_resid_post": vec(0), "post_mlp.2": vec(1)}, "steering_vectors.post_mlp.2", "given twice"),
    ({"blocks.2.hook_mlp_out": vec(0)}, "steering_vectors.blocks.2.hook_mlp_out", "unknown hook 'hook_mlp_out'"),
    ({"blocks.4.hook_resid_post": vec(0)}, "steering_vectors.blocks.4.hook_resid_post", "out of range"),
    ({"blocks.1.hook_resid_post": vec(0)[:7]}, "steering_vectors.blocks.1.hook_resid_post", "hidden size"),
    ({"blocks.1.hook_resid_post": {"1": vec(0)}}, "steering_vectors.blocks.1.hook_resid_post", "list of 8 floats"),
    ({"blocks.1.hook_resid_post": [float("nan")] * 8}, "steering_vectors.blocks.1.hook_resid_post", "NaN"),
])
def test_bad_request_site_keys_are_refused_naming_the_field(tier, field, words):
    with pytest.raises(SteeringSpecError) as e:
        parse_spec({"steering_vectors": tier}, SHAPE)
    assert e.value.field == field and words in str(e.value)


def test_request_site_keys_respect_the_servers_hooks_and_layers():
    narrow = ModelShape(4, 8, ("post_mlp",), frozenset({1}), 1 << 20)
    with pytest.raises(SteeringSpecError, match="not enabled on this server"):
        parse_spec({"steering_vectors": {"blocks.1.hook_resid_pre": vec(0)}}, narrow)
    with pytest.raises(SteeringSpecError, match="not steerable"):
        parse_spec({"steering_vectors": {"blocks.2.hook_resid_post": vec(0)}}, narrow)


# --- module files ---------------------------------------------------------------------------------


def test_module_file_tensor_names_in_either_spelling():
    a, b, c = (np.asarray(vec(i), np.float32) for i in range(3))
    ours = read_safetensors(save({"post_mlp.2": a, "prefill.pre_attn.0": b, "decode.post_attn.3": c}), SHAPE)[0]
    tl = read_safetensors(save({"blocks.2.hook_resid_post": a, "prefill.blocks.0.hook_resid_pre": b,
                                "decode.blocks.3.hook_resid_mid": c}), SHAPE)[0]
    assert set(tl) == set(ours)
    for tier in ours:
        same_vectors(tl[tier], ours[tier])


@pytest.mark.parametrize("tensors, field, words", [
    ({"post_mlp.2": np.zeros(8, np.float32), "blocks.2.hook_resid_post": np.ones(8, np.float32)},
     "file.", "named twice"),
    ({"blocks.2.hook_mlp_out": np.zeros(8, np.float32)}, "file.blocks.2.hook_mlp_out", "tensor names must be"),
    ({"early.blocks.2.hook_resid_post": np.zeros(8, np.float32)}, "file.early.blocks.2.hook_resid_post",
     "tensor names must be"),
])
def test_bad_module_file_names_are_refused(tensors, field, words):
    with pytest.raises(SteeringSpecError) as e:
        read_safetensors(save(tensors), SHAPE)
    assert e.value.field.startswith(field) and words in str(e.value)


# --- capture specs --------------------------------------------------------------------------------


def _capture(raw, hooks=HOOKS):
    return parse_capture_spec("fs", raw, 4, hooks)


def test_capture_sites_equal_layers_by_hooks():
    product = _capture({"layers": [3, 1], "hooks": ["post_mlp", "pre_attn"], "positions": "last_prompt", "x": 1})
    named = _capture({"sites": ["blocks.3.hook_resid_post", "pre_attn.1", "blocks.1.hook_resid_post",
                                "blocks.3.hook_resid_pre", "post_mlp.3"], "positions": "last_prompt", "x": 1})
    assert named == product
    assert named.sites == (("pre_attn", 1), ("pre_attn", 3), ("post_mlp", 1), ("post_mlp", 3))
    assert named.params == {"x": 1}


def test_capture_sites_need_not_be_a_product():
    spec = _capture({"sites": ["blocks.3.hook_resid_post", "pre_attn.0"]})
    assert spec.sites == (("pre_attn", 0), ("post_mlp", 3)) and spec.positions == "all_prompt"


@pytest.mark.parametrize("raw, words", [
    ({"sites": ["post_mlp.1"], "layers": [1]}, "capture.fs.sites: give either sites or layers/hooks"),
    ({"sites": ["post_mlp.1"], "hooks": ["post_mlp"]}, "capture.fs.sites: give either sites or layers/hooks"),
    ({"sites": []}, "capture.fs.sites: expected a non-empty list"),
    ({"sites": "blocks.1.hook_resid_post"}, "capture.fs.sites: expected a non-empty list"),
    ({"sites": ["post_mlp.1", "blocks.1.hook_mlp_out"]}, "capture.fs.sites[1]: unknown hook 'hook_mlp_out'"),
    ({"sites": ["blocks.4.hook_resid_post"]}, "capture.fs.sites[0]: layer 4 out of range"),
    ({"sites": ["blocks.1.hook_resid_mid"]}, "capture.fs.sites[0]: hook point 'post_attn' is not enabled"),
])
def test_bad_capture_sites_name_the_field(raw, words):
    with pytest.raises(CaptureSpecError) as e:
        _capture(raw, hooks=("pre_attn", "post_mlp"))
    assert str(e.value).startswith(words)


# --- SAEs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return write_gemma_scope(str(tmp_path_factory.mktemp("gs") / "gs"), random_sae(D, F, "jumprelu", seed=1))


def test_sae_file_site_argument_in_either_spelling(gemma):
    assert read_sae_meta(gemma, site="blocks.2.hook_resid_mid") == read_sae_meta(gemma, site="post_attn.2")
    assert list(load_sae(gemma, site="blocks.2.hook_resid_pre")) == [("pre_attn", 2)]
    with pytest.raises(SaeFileError, match=r"site: unknown hook 'hook_mlp_out'"):
        read_sae_meta(gemma, site="blocks.2.hook_mlp_out")


def test_manifest_site_keys_in_either_spelling(tmp_path):
    saes = {"blocks.1.hook_resid_post": random_sae(D, F, seed=2), "pre_attn.2": random_sae(D, F, seed=3)}
    d = write_manifest(str(tmp_path / "m"), saes, "relu")
    assert set(read_sae_meta(d)) == {("post_mlp", 1), ("pre_attn", 2)}
    dup = write_manifest(str(tmp_path / "dup"), {"blocks.1.hook_resid_post": random_sae(D, F, seed=2),
                                                 "post_mlp.1": random_sae(D, F, seed=3)}, "relu")
    with pytest.raises(SaeFileError, match="site post_mlp.1 is named twice"):
        read_sae_meta(dup)


def _cfg(path: str, site: str, slot: str) -> SteerConfig:
    return SteerConfig.model_validate({"sae": {"fz": {"path": path, "site": site, "features": [0, 1, 2]}},
                                       "sae_slots": {slot: 4}})


def test_sae_config_slots_and_request_sites_in_either_spelling(gemma):
    ours = _cfg(gemma, "post_mlp.2", "post_attn.1")
    tl = _cfg(gemma, "blocks.2.hook_resid_post", "blocks.1.hook_resid_mid")
    assert slot_sites(tl, 4) == slot_sites(ours, 4) == {("post_attn", 1): Slot(4)}
    want, got = sae_catalog(ours, D, 4)["fz"], sae_catalog(tl, D, 4)["fz"]
    assert got.sites == want.sites == {("post_mlp", 2): want.sites[("post_mlp", 2)]}
    clamp = {"name": "fz", "clamps": [{"feature": 1, "kind": "set", "value": 2.0}]}
    for catalog in ({"fz": want}, {"fz": got}):
        a = parse_sae({**clamp, "site": "post_mlp.2"}, catalog)
        b = parse_sae({**clamp, "site": "blocks.2.hook_resid_post"}, catalog)
        assert repr(a) == repr(b)
    with pytest.raises(SteeringSpecError) as e:
        parse_sae({**clamp, "site": "blocks.2.hook_mlp_out"}, {"fz": got})
    assert e.value.field == "sae.site" and "unknown hook 'hook_mlp_out'" in str(e.value)


def test_sae_slots_naming_a_site_twice_are_refused():
    cfg = SteerConfig.model_validate({"sae_slots": {"post_attn.1": 4, "blocks.1.hook_resid_mid": 4}})
    with pytest.raises(SteerConfigError, match=r"sae_slots\.blocks\.1\.hook_resid_mid: site post_attn\.1 is named twice"):
        slot_sites(cfg, 4)


def test_runtime_registration_site_in_either_spelling(gemma):
    root = gemma.rsplit("/", 1)[0]
    cfg = SteerConfig.model_validate({"sae_root": root, "sae_slots": {"post_mlp.1": 8}})
    slots = slot_sites(cfg, 4)
    entry = lambda site: runtime_entry("rt", SaeModuleConfig(path=gemma, site=site, features=(0, 1)), cfg, D, 4, slots, 3)
    assert entry("blocks.1.hook_resid_post").sites == entry("post_mlp.1").sites
    with pytest.raises(SteeringSpecError) as e:
        entry("blocks.1.hook_resid_pre")
    assert e.value.field == "site" and "not reserved" in str(e.value)
