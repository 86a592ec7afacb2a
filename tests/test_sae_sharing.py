"""Several SAEs at one site (issue 39 item 3), without an engine: the catalog's rules (clamp-only SAEs and a
``sae_slots`` reservation share a site, a full SAE holds its site alone), a request naming several SAEs at one
site, and the worker's shared pack: one region per SAE, a runtime SAE staged into the reserved one, and a row's
edit equal to the sum of each named SAE's own edit, every encoder reading the same (pristine) stream. The engine
oracle of the same is in tests/test_sae_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sae_writers import random_sae, write_gemma_scope, write_manifest, write_sae_lens
from vllm_steer.core.config import SteerConfig, SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import Slot, runtime_entry, sae_catalog, site_regions, slot_sites
from vllm_steer.core.sae_paths import runtime_access
from vllm_steer.frontend.sae_spec import parse_sae
from vllm_steer.kernels.sae_clamp import naive
from vllm_steer.kernels.sae_clamp.packed import apply_site_naive

D, F, LAYERS = 16, 24, 4
SITE = ("post_mlp", 1)
KIND = {"set": naive.SET, "add": naive.ADD, "scale": naive.SCALE}
ACT = {"relu": naive.RELU, "jumprelu": naive.JUMPRELU, "topk": naive.TOPK}


def _files(d) -> dict:
    """Two clamp-only SAEs of post_mlp.1 (sae-lens ReLU with b_dec_in; Gemma Scope JumpReLU), a TopK manifest there,
    and a runtime SAE's files (ReLU) inside the root ``d``."""
    w = {"a": random_sae(D, F, "relu", seed=1, b_dec_in=True), "b": random_sae(D, F, "jumprelu", seed=2),
         "k": random_sae(D, F, "topk", k=4, seed=3), "rt": random_sae(D, F, "relu", seed=4),
         "rt2": random_sae(D, F, "jumprelu", seed=5)}
    paths = {"a": write_sae_lens(str(d / "a"), w["a"], hook_name="blocks.1.hook_resid_post"),
             "b": write_gemma_scope(str(d / "b"), w["b"]),
             "k": write_manifest(str(d / "k"), {"post_mlp.1": w["k"]}, "topk", 4),
             "rt": write_sae_lens(str(d / "rt"), w["rt"], hook_name="blocks.1.hook_resid_post"),
             "rt2": write_gemma_scope(str(d / "rt2"), w["rt2"])}
    return {"w": w, "path": {k: str(p) for k, p in paths.items()}}


def _cfg(d, files: dict, slots: int = 8, **extra) -> SteerConfig:
    sae = {"a": {"path": files["path"]["a"]}, "b": {"path": files["path"]["b"], "site": "post_mlp.1",
                                                     "features": [1, 4, 9, 20]}, **extra}
    return SteerConfig.model_validate({"sae": sae, "sae_slots": {"post_mlp.1": slots} if slots else {},
                                       "sae_root": str(d)})


def test_clamp_only_saes_and_a_reservation_share_a_site_and_a_full_sae_holds_its_site_alone(tmp_path):
    files = _files(tmp_path)
    catalog = sae_catalog(_cfg(tmp_path, files), D, LAYERS)
    regions = site_regions(catalog, {SITE: Slot(8)})[(SITE, False)]
    assert [(r.name, r.offset, r.size) for r in regions] == [("a", 0, F), ("b", F, 4), (None, F + 4, 8)]
    with pytest.raises(SteerConfigError, match=r"steer\.sae\.k: site post_mlp\.1 already has the SAE 'a', and 'k' is "
                                               r"a full SAE \(TopK or reconstruct\), which holds its site alone"):
        sae_catalog(_cfg(tmp_path, files, k={"path": files["path"]["k"]}), D, LAYERS)
    full_first = SteerConfig.model_validate({"sae": {"a": {"path": files["path"]["a"], "reconstruct": True},
                                                     "b": {"path": files["path"]["b"], "site": "post_mlp.1"}}})
    with pytest.raises(SteerConfigError, match=r"steer\.sae\.b: .*'a' is a full SAE"):
        sae_catalog(full_first, D, LAYERS)
    alone = SteerConfig.model_validate({"sae": {"k": {"path": files["path"]["k"]}}, "sae_slots": {"post_mlp.1": 8}})
    with pytest.raises(SteerConfigError, match=r"steer\.sae_slots\.post_mlp\.1: the SAE 'k' loaded there is a full "
                                               r"SAE \(TopK or reconstruct\), which holds its site alone"):
        sae_catalog(alone, D, LAYERS)
    # a runtime SAE at the shared site is checked against the reservation only (the start-up SAEs keep theirs)
    cfg = _cfg(tmp_path, files)
    from vllm_steer.core.config import SaeModuleConfig

    entry = runtime_entry("rt", SaeModuleConfig(path=files["path"]["rt"], features=[0, 2, 5]), cfg, D, LAYERS,
                          slot_sites(cfg, LAYERS), 1)
    assert list(entry.sites) == [SITE] and entry.features == (0, 2, 5)
    with pytest.raises(SteeringSpecError, match=r"9 clampable features, but site post_mlp\.1 holds 8 "
                                                r"\(steer\.sae_slots\); list fewer features") as e:
        runtime_entry("rt", SaeModuleConfig(path=files["path"]["rt"], features=list(range(9))), cfg, D, LAYERS,
                      slot_sites(cfg, LAYERS), 2)
    assert e.value.field == "features"


def test_one_request_clamps_several_saes_at_one_site_once_each_whatever_their_order(tmp_path):
    from vllm_steer.core.sae_rows import sae_config_key

    catalog = sae_catalog(_cfg(tmp_path, _files(tmp_path)), D, LAYERS)
    both = [{"name": "a", "clamps": [{"feature": 3, "kind": "set", "value": 2.0}]},
            {"name": "b", "clamps": [{"feature": 9, "kind": "add", "value": 1.0}]}]
    pre, dec = parse_sae(both, catalog)
    assert [(e[0], e[1], e[2]) for e in pre] == [("a", *SITE), ("b", *SITE)] and pre == dec
    ids = {n: e.identity for n, e in catalog.items()}
    assert sae_config_key(None, pre, ids) == sae_config_key(None, parse_sae(both[::-1], catalog)[0], ids)
    with pytest.raises(SteeringSpecError, match=r"SAE 'b' clamps site post_mlp\.1 twice in the decode phase") as e:
        parse_sae([both[1], {**both[1], "phase": "decode"}], catalog)
    assert e.value.field == "sae[1]"
    split = parse_sae([{**both[1], "phase": "decode"}, {**both[1], "phase": "prefill"}], catalog)  # a phase each: ok
    assert [len(p) for p in split] == [1, 1]


def _reference(w, clamps: list) -> naive.Sae:
    return naive.Sae(torch.from_numpy(w.w_enc), torch.from_numpy(w.b_enc), torch.from_numpy(w.w_dec),
                     torch.from_numpy(w.b_dec), ACT[w.meta.activation],
                     None if w.threshold is None else torch.from_numpy(w.threshold), w.meta.k, w.meta.b_dec_in)


def _edit(w, clamps: list, x: torch.Tensor) -> torch.Tensor:
    """The reference's DELTA edit of ``x`` by one SAE alone (every token clamped alike)."""
    kind, value, only = torch.zeros(2, F, dtype=torch.int8), torch.zeros(2, F), torch.zeros(2, F, dtype=torch.int8)
    for c in clamps:
        kind[1, c["feature"]], value[1, c["feature"]] = KIND[c["kind"]], c["value"]
        only[1, c["feature"]] = int(c.get("only_if_active", False))
    modes = torch.tensor([naive.OFF, naive.DELTA], dtype=torch.int8)
    index = torch.ones(x.shape[0], dtype=torch.int32)
    return naive.sae_clamp_naive(x, index, _reference(w, clamps), modes, kind, value, only) - x


def test_a_shared_pack_adds_each_saes_own_edit_of_the_same_stream(tmp_path):
    """Start-up SAEs a and b and a runtime SAE in the reserved region of post_mlp.1: a row naming several of them
    moves the stream by the sum of each one's own edit of the unedited stream; a row naming one moves it by that
    one's edit alone; a row naming none leaves it bit for bit. A smaller SAE registered later in the region zeroes
    what the larger one left past its features."""
    files = _files(tmp_path)
    cfg = _cfg(tmp_path, files)
    catalog = sae_catalog(cfg, D, LAYERS)
    from vllm_steer.runtime.sae_tables import SaeTables

    tables = SaeTables(catalog, slot_sites(cfg, LAYERS), {SITE}, 5, D, torch.device("cpu"),
                       runtime_access(cfg.sae_root, cfg.max_sae_bytes))
    from vllm_steer.core.config import SaeModuleConfig

    rt = runtime_entry("rt", SaeModuleConfig(path=files["path"]["rt"], features=[0, 2, 5, 7]), cfg, D, LAYERS,
                       slot_sites(cfg, LAYERS), 1)
    assert tables.load_runtime(files["path"]["rt"], None, None, rt.features, [SITE]) == [SITE]
    catalog = {**catalog, "rt": rt}
    a_clamps = [{"feature": 3, "kind": "set", "value": 4.0}, {"feature": 11, "kind": "scale", "value": 3.0}]
    b_clamps = [{"feature": 9, "kind": "add", "value": 2.5}, {"feature": 20, "kind": "set", "value": 0.0}]
    rt_clamps = [{"feature": 5, "kind": "set", "value": 3.0}, {"feature": 7, "kind": "add", "value": -2.0,
                                                                "only_if_active": True}]
    named = {"a": a_clamps, "b": b_clamps, "rt": rt_clamps}
    rows = {1: ["a", "b", "rt"], 2: ["b"], 3: ["rt"], 4: []}
    for r, names in rows.items():
        entries = parse_sae([{"name": n, "clamps": named[n]} for n in names], catalog)[0] if names else []
        tables.write_row(r, entries)
    pack = tables.packs[SITE]
    assert pack[0].tolist() == [0, 1, 1, 1, 0] and pack[1].shape == (5, F + 4 + 8)
    x = torch.from_numpy(np.random.default_rng(7).normal(0, 1.5, size=(10, D)).astype(np.float32))
    index = torch.tensor([1, 2, 3, 4, 0, 1, 2, 3, 4, 1])
    got = apply_site_naive(x, index, pack, 0)
    w = {**files["w"]}
    for t, r in enumerate(index.tolist()):
        want = x[t : t + 1] + sum((_edit(w[n], named[n], x[t : t + 1]) for n in rows.get(r, [])),
                                  torch.zeros(1, D))
        torch.testing.assert_close(got[t : t + 1], want, rtol=1e-5, atol=1e-5)
    idle = (index == 0) | (index == 4)
    assert torch.equal(got[idle], x[idle])
    for n in ("a", "b", "rt"):  # each one really moved its tokens
        assert _edit(w[n], named[n], x).abs().max() > 0.1
    # a smaller SAE in the region: its features first, zeros after (none of rt's weights left behind)
    base = tables.slot_base[SITE]
    tables.load_runtime(files["path"]["rt2"], None, "post_mlp.1", (3, 6), [SITE])
    assert torch.equal(pack[3][base : base + 2], torch.from_numpy(w["rt2"].w_enc[:, [3, 6]].T.copy()))
    assert not pack[3][base + 2 :].any() and not pack[4][base + 2 :].any()
    start_up = np.concatenate([w["a"].w_enc.T, w["b"].w_enc[:, [1, 4, 9, 20]].T])
    assert torch.equal(pack[3][:base], torch.from_numpy(start_up))  # the start-up SAEs' regions untouched
