"""Runtime SAEs of every architecture (issue 39 item 3), without an engine: ``steer.sae_slots`` reserves a
clamp-only region (ReLU / JumpReLU, delta) or a full site (``{"features", "d_sae", "k", "reconstruct"}``: TopK
and reconstruct too); registrations are checked against what the site reserved (the field at fault and the
limit in the message), and the worker stages a runtime TopK / reconstruct SAE into the reserved full pack so that
it clamps and reconstructs like the reference with the same (bfloat16-rounded) weights, a smaller SAE padded with
features that are never active. The engine oracle of the same is in tests/test_sae_engine.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.sae_writers import random_sae, write_gemma_scope, write_manifest, write_sae_lens
from vllm_steer.core.config import SaeModuleConfig, SteerConfig, SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import Slot, runtime_entry, sae_catalog, slot_sites
from vllm_steer.core.sae_paths import runtime_access
from vllm_steer.frontend.sae_spec import parse_sae
from vllm_steer.kernels.sae_clamp import naive
from vllm_steer.kernels.sae_clamp.packed import apply_site_naive

D, LAYERS = 16, 4
FULL = ("post_mlp", 2)  # reserved for TopK k=4 SAEs of up to 32 features, reconstruct allowed
SLOTS = {"post_mlp.1": 8, "post_mlp.2": {"features": 6, "d_sae": 32, "k": 4, "reconstruct": True},
         "post_mlp.3": {"features": 6, "d_sae": 32}}
KIND = {"set": naive.SET, "add": naive.ADD, "scale": naive.SCALE}


def _cfg(d, **extra) -> SteerConfig:
    return SteerConfig.model_validate({"sae_slots": SLOTS, "sae_root": str(d), **extra})


def _bf16(w):
    r = lambda a: torch.from_numpy(a).bfloat16().float().numpy()  # noqa: E731
    return dataclasses.replace(w, w_enc=r(w.w_enc), w_dec=r(w.w_dec))


def test_slots_parse_and_a_full_reservation_holds_its_site_alone(tmp_path):
    cfg = _cfg(tmp_path)
    assert slot_sites(cfg, LAYERS) == {("post_mlp", 1): Slot(8), FULL: Slot(6, 32, 4, True),
                                       ("post_mlp", 3): Slot(6, 32)}
    with pytest.raises(ValueError, match=r"post_mlp\.2: k and features must not exceed d_sae \(3\)"):
        SteerConfig.model_validate({"sae_slots": {"post_mlp.2": {"features": 2, "d_sae": 3, "k": 4}}})
    with pytest.raises(ValueError, match="d_sae"):
        SteerConfig.model_validate({"sae_slots": {"post_mlp.2": {"features": 2}}})
    lens = write_sae_lens(str(tmp_path / "s"), random_sae(D, 8), hook_name="blocks.2.hook_resid_post")
    with pytest.raises(SteerConfigError, match=r"steer\.sae_slots\.post_mlp\.2: a full reservation \(d_sae\) holds "
                                               r"its site alone, and the SAE 's' is loaded there"):
        sae_catalog(_cfg(tmp_path, sae={"s": {"path": lens}}), D, LAYERS)


def _register(cfg, path: str, **config):
    return runtime_entry("rt", SaeModuleConfig(path=path, **config), cfg, D, LAYERS, slot_sites(cfg, LAYERS), 1)


def test_registrations_are_checked_against_what_their_site_reserved(tmp_path):
    """Each refusal names the registration's field and the site's reservation (its limit)."""
    cfg = _cfg(tmp_path)
    topk = {L: write_manifest(str(tmp_path / f"k{L}"), {f"post_mlp.{L}": random_sae(D, 24, "topk", k=4, seed=L)},
                              "topk", 4) for L in (1, 2, 3)}
    topk8 = write_manifest(str(tmp_path / "k8"), {"post_mlp.2": random_sae(D, 24, "topk", k=8)}, "topk", 8)
    big = write_gemma_scope(str(tmp_path / "big"), random_sae(D, 40, "jumprelu"))
    relu = {L: write_manifest(str(tmp_path / f"r{L}"), {f"post_mlp.{L}": random_sae(D, 24, "relu", seed=L)}, "relu")
            for L in (1, 2, 3)}
    assert _register(cfg, topk[2], features=[0, 5, 7], reconstruct=True).full
    assert _register(cfg, relu[3], features=[1, 2]).full is False  # a full site takes it for delta
    cases = [
        ((topk[1], {"features": [0]}), "path", r"site post_mlp\.1 holds 8 clampable features, ReLU / JumpReLU, "
                                               r"delta only \(steer\.sae_slots\): a TopK SAE needs a site reserved "
                                               r"with d_sae"),
        ((relu[1], {"features": [0], "reconstruct": True}), "reconstruct",
         r"reconstruct needs a site reserved with d_sae and reconstruct: true"),
        ((relu[3], {"features": [0], "reconstruct": True}), "reconstruct",
         r"site post_mlp\.3 holds 6 clampable features of at most d_sae 32, ReLU / JumpReLU, delta only"),
        ((topk8, {"features": [0]}), "path", r"TopK k=4, delta or reconstruct \(steer\.sae_slots\); this SAE is TopK "
                                             r"k=8"),
        ((topk[3], {"features": [0]}), "path",
         r"ReLU / JumpReLU, delta only \(steer\.sae_slots\); this SAE is TopK k=4"),
        ((relu[2], {"features": [0]}), "path", r"this SAE is relu"),
        ((big, {"site": "post_mlp.3", "features": [0]}), "path", r"at most d_sae 32, .*; this SAE has d_sae 40"),
        ((topk[2], {"features": list(range(7))}), "features", r"7 clampable features, but site post_mlp\.2 holds 6"),
    ]
    for (path, config), field, words in cases:
        with pytest.raises(SteeringSpecError, match=words) as e:
            _register(cfg, path, **config)
        assert e.value.field == field, (path, config)


def _reference_edit(w, mode: int, clamps: list, x: torch.Tensor) -> torch.Tensor:
    sae = naive.Sae(*(torch.from_numpy(a) for a in (w.w_enc, w.b_enc, w.w_dec, w.b_dec)),
                    {"relu": naive.RELU, "jumprelu": naive.JUMPRELU, "topk": naive.TOPK}[w.meta.activation],
                    None if w.threshold is None else torch.from_numpy(w.threshold), w.meta.k, w.meta.b_dec_in)
    f = w.meta.d_sae
    kind, value, only = torch.zeros(2, f, dtype=torch.int8), torch.zeros(2, f), torch.zeros(2, f, dtype=torch.int8)
    for c in clamps:
        kind[1, c["feature"]], value[1, c["feature"]] = KIND[c["kind"]], c["value"]
    modes = torch.tensor([naive.OFF, mode], dtype=torch.int8)
    return naive.sae_clamp_naive(x, torch.ones(x.shape[0], dtype=torch.int32), sae, modes, kind, value, only)


@pytest.mark.parametrize("d_sae", [32, 20], ids=["the-reserved-size", "smaller-padded"])
def test_a_runtime_topk_sae_in_a_full_reservation_clamps_and_reconstructs_like_the_reference(tmp_path, d_sae):
    """A TopK SAE (b_dec applied to the input, as sae-lens' apply_b_dec_to_input) registered into the full
    reservation of post_mlp.2: delta clamps, reconstruct with and without clamps, an OFF row bit for bit; the
    padding of a smaller SAE never enters the TopK (k of its own features are chosen)."""
    from vllm_steer.runtime.sae_tables import SaeTables

    cfg = _cfg(tmp_path)
    slots = slot_sites(cfg, LAYERS)
    tables = SaeTables({}, slots, set(slots), 5, D, torch.device("cpu"),
                       runtime_access(cfg.sae_root, cfg.max_sae_bytes))
    pack = tables.packs[FULL]
    assert len(pack) == 13 and tables.topk[FULL] == 4 and tables.topk[("post_mlp", 1)] == 0
    # a larger SAE first: its weights must not survive the smaller one's staging
    first = write_manifest(str(tmp_path / "first"), {"post_mlp.2": random_sae(D, 32, "topk", k=4, seed=8)}, "topk", 4)
    tables.load_runtime(first, None, None, (0, 1, 2, 3, 4, 5), [FULL])
    w = random_sae(D, d_sae, "topk", k=4, seed=9, b_dec_in=True)
    path = write_sae_lens(str(tmp_path / "tk"), w, hook_name="blocks.2.hook_resid_post")
    entry = _register(cfg, path, features=[1, 3, 6, 19], reconstruct=True)
    assert entry.sites[FULL].activation == "topk" and entry.sites[FULL].k == 4, entry.sites
    assert tables.load_runtime(path, None, None, entry.features, [FULL]) == [FULL]
    catalog = {"rt": entry}
    clamps = [{"feature": 3, "kind": "set", "value": 5.0}, {"feature": 19, "kind": "add", "value": 2.0}]
    rows = {1: {"name": "rt", "clamps": clamps}, 2: {"name": "rt", "mode": "reconstruct"},
            3: {"name": "rt", "mode": "reconstruct", "clamps": clamps[:1]}}
    for r, item in rows.items():
        tables.write_row(r, parse_sae(item, catalog)[0])
    x = torch.from_numpy(np.random.default_rng(3).normal(0, 2.0, size=(8, D)).astype(np.float32))
    index = torch.tensor([1, 2, 3, 0, 4, 1, 2, 3])
    got = apply_site_naive(x, index, pack, tables.topk[FULL])
    wr = _bf16(w)
    want = {0: x, 4: x, 1: _reference_edit(wr, naive.DELTA, clamps, x),
            2: _reference_edit(wr, naive.RECONSTRUCT, [], x), 3: _reference_edit(wr, naive.RECONSTRUCT, clamps[:1], x)}
    for t, r in enumerate(index.tolist()):
        torch.testing.assert_close(got[t], want[r][t], rtol=1e-4, atol=1e-4, msg=f"token {t}, row {r}")
    assert torch.equal(got[index == 0], x[index == 0]) and torch.equal(got[index == 4], x[index == 4])
    assert (want[2] - x).abs().max() > 0.1 and (want[1] - x).abs().max() > 0.1  # both really edit the stream
