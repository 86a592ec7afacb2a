"""dictionary_learning trainer folders (core/sae_dictlearn.py) against dictionary-learning 0.1.0 itself (pinned in
the CI locks, imported without its package ``__init__``): for each dictionary class, a random instance built by its
own trainer, saved as ``trainSAE`` saves it (``torch.save(ae.state_dict())`` + the trainer's config.json), loads
as the activation it maps to, and the plain-torch reference (kernels/sae_clamp/naive.py) on it equals the class's
``encode`` / ``decode``, with and without clamps; every refusal names its field."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.sae_oracle import DICTLEARN_TRAINERS, dictlearn_trainer
from tests.sae_writers import write_json
from vllm_steer.core.sae_files import SaeFileError, SaeMeta, detect_format, load_sae, read_sae_meta
from vllm_steer.core.sae_paths import DENIED, SaePathError, runtime_access
from vllm_steer.kernels.sae_clamp import naive

D, F, K, LAYER = 16, 48, 5, 3
SITE = ("post_mlp", LAYER)
ACT = {"relu": naive.RELU, "jumprelu": naive.JUMPRELU, "topk": naive.TOPK}
# dict_class -> (our activation, b_dec_in)
MAPS_TO = {"AutoEncoder": ("relu", True), "AutoEncoderNew": ("relu", False), "GatedAutoEncoder": ("jumprelu", True),
           "JumpReluAutoEncoder": ("jumprelu", False), "AutoEncoderTopK": ("topk", True),
           "BatchTopKSAE": ("jumprelu", True), "MatryoshkaBatchTopKSAE": ("jumprelu", True)}


def _save(folder, ae, config, state=None) -> str:
    """A trainer folder as dictionary_learning's ``trainSAE`` writes it."""
    os.makedirs(folder, exist_ok=True)
    torch.save(state if state is not None else {k: v.cpu() for k, v in ae.state_dict().items()},
               os.path.join(folder, "ae.pt"))
    write_json(os.path.join(folder, "config.json"), json.loads(json.dumps(config)))
    return str(folder)


def _saved(tmp_path, dict_class="AutoEncoderTopK", seed=0, **kw):
    ae, config = dictlearn_trainer(dict_class, D, F, K, LAYER, seed=seed, **kw)
    return _save(tmp_path / "trainer_0", ae, config), ae, config


def _naive(w) -> naive.Sae:
    return naive.Sae(torch.from_numpy(w.w_enc), torch.from_numpy(w.b_enc), torch.from_numpy(w.w_dec),
                     torch.from_numpy(w.b_dec), ACT[w.meta.activation],
                     None if w.threshold is None else torch.from_numpy(w.threshold), w.meta.k, w.meta.b_dec_in)


CASES = [(c, 0.2) for c in DICTLEARN_TRAINERS] + [("BatchTopKSAE", -1.0)]  # -1: a threshold never learned


@pytest.mark.parametrize("dict_class, threshold", CASES, ids=[f"{c}{'-untrained' if t < 0 else ''}" for c, t in CASES])
@torch.no_grad()
def test_each_class_loads_and_the_reference_equals_its_encode_and_decode(tmp_path, dict_class, threshold):
    folder, ae, _ = _saved(tmp_path, dict_class, seed=3, threshold=threshold)
    activation, b_dec_in = MAPS_TO[dict_class]
    meta = SaeMeta(d_model=D, d_sae=F, activation=activation, k=K if activation == "topk" else 0, dtype="float32",
                   b_dec_in=b_dec_in)
    assert detect_format(folder) == "dictionary_learning"
    assert read_sae_meta(folder) == {SITE: meta}
    w = load_sae(folder)[SITE]
    sae = _naive(w)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(4)) * 2.0
    want = ae.encode(x)
    f = naive.encode(sae, x)
    torch.testing.assert_close(f, want, rtol=1e-5, atol=1e-5)
    active = (want > 0).float().mean()
    assert 0.05 < active < 0.95 and torch.equal(f > 0, want > 0)  # some latents on, some off: the gate matters
    if dict_class == "GatedAutoEncoder":  # the gate differs from relu of the magnitude: JumpReLU thresholds at work
        assert ((ae.encoder(x - ae.decoder_bias) + ae.gate_bias <= 0) & (ae.r_mag.exp() * ae.encoder(
            x - ae.decoder_bias) + ae.mag_bias > 0)).any()

    # reconstruct (no clamps) is decode(encode(x)); a delta with clamps is x + decode(f') - decode(f)
    rows = torch.ones(64, dtype=torch.int32)
    kind, value, only = torch.zeros(2, F, dtype=torch.int8), torch.zeros(2, F), torch.zeros(2, F, dtype=torch.int8)
    got = naive.sae_clamp_naive(x, rows, sae, torch.tensor([0, naive.RECONSTRUCT], dtype=torch.int8), kind, value, only)
    torch.testing.assert_close(got, ae.decode(want), rtol=1e-5, atol=1e-5)
    kind[1, [3, 17, 30]] = torch.tensor([naive.SET, naive.ADD, naive.SCALE], dtype=torch.int8)
    value[1, [3, 17, 30]] = torch.tensor([4.0, 2.5, 3.0])
    only[1, 30] = 1
    got = naive.sae_clamp_naive(x, rows, sae, torch.tensor([0, naive.DELTA], dtype=torch.int8), kind, value, only)
    f_new = naive.clamp(want, kind[rows.long()], value[rows.long()], only[rows.long()])
    torch.testing.assert_close(got, x + ae.decode(f_new) - ae.decode(want), rtol=1e-5, atol=1e-5)
    assert (got - x).abs().max() > 0.1  # the clamps moved the stream


def test_bf16_weights_and_explicit_format(tmp_path):
    ae, config = dictlearn_trainer("BatchTopKSAE", D, F, K, LAYER, seed=1)
    state = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in ae.state_dict().items()}
    folder = _save(tmp_path / "bf16", ae, config, state)
    meta = read_sae_meta(folder, format="dictionary_learning")[SITE]
    assert meta.dtype == "bfloat16" and meta.activation == "jumprelu"
    w = load_sae(folder)[SITE]
    np.testing.assert_array_equal(w.w_enc, state["encoder.weight"].float().T.numpy())
    np.testing.assert_array_equal(w.threshold, np.full(F, state["threshold"].float().item(), np.float32))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SaeFileError, match=r"empty: format: not a dictionary_learning trainer folder"):
        read_sae_meta(str(tmp_path / "empty"), format="dictionary_learning")


def _cfg(update):
    def edit(config):
        config["trainer"].update(update)
        return config
    return edit


CONFIG_REFUSALS = {  # name -> (edit of the config, key, message)
    "unknown_class": (_cfg({"dict_class": "BatchTopKCrossCoder"}), "trainer.dict_class",
                      r"'BatchTopKCrossCoder' is not served \(served: AutoEncoder, "),
    "no_class": (lambda c: {**c, "trainer": {k: v for k, v in c["trainer"].items() if k != "dict_class"}},
                 "trainer.dict_class", "missing"),
    "no_trainer": (lambda c: {"buffer": c["buffer"]}, "trainer", "missing or not an object"),
    "submodule": (_cfg({"submodule_name": "mlp_out_layer_3"}), "trainer.submodule_name",
                  r"'mlp_out_layer_3' is not served: only resid_post_layer_N"),
    "submodule_none": (_cfg({"submodule_name": None}), "trainer.submodule_name", "missing: .*pass site="),
    "layer": (_cfg({"layer": 4}), "trainer.layer", "4 disagrees with submodule_name resid_post_layer_3"),
    "activation_dim": (_cfg({"activation_dim": 32}), "trainer.activation_dim",
                       r"32 disagrees with the arrays \(activation_dim 16, dict_size 48\)"),
    "dict_size": (_cfg({"dict_size": 64}), "trainer.dict_size", "64 disagrees with the arrays"),
    "k": (_cfg({"k": 7}), "trainer.k", r"7 disagrees with ae\.pt's k \(5\)"),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_config_refusals_name_the_field(tmp_path, case):
    edit, key, match = CONFIG_REFUSALS[case]
    ae, config = dictlearn_trainer("AutoEncoderTopK", D, F, K, LAYER)
    folder = _save(tmp_path / "t", ae, edit(config))
    for read in (read_sae_meta, load_sae):
        with pytest.raises(SaeFileError, match=rf"config\.json: {key}: {match}") as e:
            read(folder)
        assert e.value.key == key


def test_site_argument(tmp_path):
    ae, config = dictlearn_trainer("AutoEncoder", D, F, K, LAYER)
    folder = _save(tmp_path / "t", ae, config)
    assert list(read_sae_meta(folder, site="post_mlp.3")) == [SITE]
    with pytest.raises(SaeFileError, match=r"config\.json: site: post_mlp\.4 disagrees with submodule_name "
                                           r"resid_post_layer_3 \(post_mlp\.3\)"):
        read_sae_meta(folder, site="post_mlp.4")
    config["trainer"]["submodule_name"] = None
    folder = _save(tmp_path / "u", ae, config)
    assert list(read_sae_meta(folder, site="post_mlp.9")) == [("post_mlp", 9)]


def _state(dict_class="AutoEncoderTopK"):
    ae, config = dictlearn_trainer(dict_class, D, F, K, LAYER)
    return ae, config, {k: v.clone() for k, v in ae.state_dict().items()}


ARRAY_REFUSALS = {  # name -> (dict_class, edit of the state dict, key, message)
    "missing": ("AutoEncoderTopK", lambda s: s.pop("b_dec"), "b_dec", "missing array for a AutoEncoderTopK"),
    "unexpected": ("AutoEncoder", lambda s: s.update(extra=torch.zeros(3)), "extra",
                   "unexpected array for a AutoEncoder"),
    "w_dec": ("AutoEncoderTopK", lambda s: s.update({"decoder.weight": s["decoder.weight"].T.clone()}),
              "decoder.weight", r"shape \[48, 16\] does not match encoder\.weight \[48, 16\]: expected \[16, 48\]"),
    "rank": ("JumpReluAutoEncoder", lambda s: s.update(W_enc=s["W_enc"].reshape(-1)), "W_enc", "wrong rank"),
    "threshold": ("JumpReluAutoEncoder", lambda s: s.update(threshold=s["threshold"][:-1].clone()), "threshold",
                  r"shape \[47\] does not match W_enc \[16, 48\]: expected \[48\]"),
    "k_range": ("AutoEncoderTopK", lambda s: s.update(k=torch.tensor(F + 1, dtype=torch.int32)), "k",
                r"topk needs 1 <= k <= d_sae \(48\), got 49"),
    "dtype": ("AutoEncoder", lambda s: s.update(bias=s["bias"].double()), "bias", "unsupported dtype float64"),
    "groups": ("MatryoshkaBatchTopKSAE", lambda s: s.update(group_sizes=torch.tensor([12, 30])), "group_sizes",
               r"expected positive sizes summing to dict_size 48, got \[12, 30\]"),
}


@pytest.mark.parametrize("case", list(ARRAY_REFUSALS))
def test_array_refusals_name_the_array(tmp_path, case):
    dict_class, edit, key, match = ARRAY_REFUSALS[case]
    ae, config, state = _state(dict_class)
    edit(state)
    folder = _save(tmp_path / "t", ae, config, state)
    for read in (read_sae_meta, load_sae):
        with pytest.raises(SaeFileError, match=rf"ae\.pt: {key}: {match}") as e:
            read(folder)
        assert e.value.key == key


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def test_ae_pt_is_never_unpickled_beyond_tensors(tmp_path):
    ae, config, state = _state()
    folder = _save(tmp_path / "t", ae, config, {**state, "payload": _Payload()})
    with pytest.raises(SaeFileError, match=r"ae\.pt: file: not a torch\.save state dict torch\.load\(weights_only"
                                           r"=True\) reads") as e:
        read_sae_meta(folder)
    assert e.value.key == "file"
    folder = _save(tmp_path / "u", ae, config, {**state, "step": 3})
    with pytest.raises(SaeFileError, match=r"ae\.pt: step: expected a tensor, got int"):
        read_sae_meta(folder)
    with open(os.path.join(folder, "ae.pt"), "wb") as f:
        f.write(b"not a zip")
    with pytest.raises(SaeFileError, match=r"ae\.pt: file: not a torch\.save state dict"):
        read_sae_meta(folder)


def test_non_finite_weights_are_refused_on_load(tmp_path):
    ae, config, state = _state("GatedAutoEncoder")
    state["r_mag"][2] = 200.0  # exp overflows float32: the folded W_enc would be inf
    folder = _save(tmp_path / "t", ae, config, state)
    read_sae_meta(folder)
    with pytest.raises(SaeFileError, match=r"ae\.pt: r_mag: non-finite values"):
        load_sae(folder)


def test_runtime_paths_ae_pt_linking_out_of_the_root_is_refused_and_the_size_cap_holds(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    folder, _, _ = _saved(root)
    files = runtime_access((str(root),), 1 << 30)
    assert list(read_sae_meta(folder, files=files)) == [SITE]
    assert load_sae(folder, files=files)[SITE].meta.k == K
    with pytest.raises(SaeFileError, match=r"ae\.pt: file: .*over steer\.max_sae_bytes"):
        read_sae_meta(folder, files=runtime_access((str(root),), 4096))
    outside.mkdir()
    os.replace(os.path.join(folder, "ae.pt"), outside / "ae.pt")
    os.symlink(outside / "ae.pt", os.path.join(folder, "ae.pt"))
    with pytest.raises(SaePathError) as e:
        read_sae_meta(folder, files=files)
    assert str(e.value) == DENIED


def test_steer_sae_config_and_runtime_registration_accept_it(tmp_path):
    from vllm_steer.core.config import SaeModuleConfig, SteerConfig
    from vllm_steer.core.sae_catalog import runtime_entry, sae_catalog, slot_sites
    from vllm_steer.server.schemas import SaeRegistration

    folder, _, _ = _saved(tmp_path / "dl")
    config = SteerConfig.model_validate({"sae": {"dl": {"path": folder, "format": "dictionary_learning"}}})
    catalog = sae_catalog(config, D, 4)
    e = catalog["dl"]
    assert e.full and list(e.sites) == [SITE] and e.sites[SITE].k == K
    cfg = SteerConfig.model_validate({"sae_root": str(tmp_path), "sae_slots": {
        f"post_mlp.{LAYER}": {"features": 8, "d_sae": 64, "k": K, "reconstruct": True}}})
    reg = SaeRegistration(name="rt", path=folder, format="dictionary_learning", features=[0, 3])
    c = SaeModuleConfig(path=reg.path, format=reg.format, site=reg.site, features=tuple(reg.features))
    entry = runtime_entry("rt", c, cfg, D, 4, slot_sites(cfg, 4), 1)
    assert list(entry.sites) == [SITE] and entry.full
