"""EleutherAI sparsify checkpoints (core/sae_sparsify.py) against sparsify 1.3.3 itself (``eai-sparsify``, pinned in
ci/requirements.lock): folders its own ``save_to_disk`` wrote load as TopK SAEs whose arrays equal the tensors its
``load_from_disk`` reads; the plain-torch reference (kernels/sae_clamp/naive.py) on them equals its ``encode`` /
``decode``; every refusal names its field; a root, a folder, ``site``, ``steer.sae`` and runtime registration."""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest
import torch

from tests.sae_oracle import sparsify_clamped, sparsify_coder, sparsify_module
from tests.sae_writers import random_sae, sparsify_cfg, write_json, write_safetensors, write_sparsify
from vllm_steer.core import sae_files
from vllm_steer.core.sae_files import SaeFileError, SaeMeta, detect_format, load_sae, read_sae_meta
from vllm_steer.core.sae_paths import DENIED, SaePathError, runtime_access
from vllm_steer.kernels.sae_clamp import naive

D, F, K = 16, 48, 5


def _coder(seed: int = 0, dtype=torch.float32, num_latents: int = F, k: int = K, bias_shift: float = 0.0, **cfg):
    """A sparsify SparseCoder with random weights (and nonzero biases: b_dec matters)."""
    return sparsify_coder(D, num_latents, k, seed, dtype, bias_shift, **cfg)


def _saved(root, hookpoint: str, **kw) -> str:
    folder = os.path.join(root, hookpoint)
    _coder(**kw).save_to_disk(folder)
    return folder


def _edit(folder, drop=(), **changes):
    path = os.path.join(folder, "cfg.json")
    with open(path) as f:
        data = json.load(f)
    for key in drop:
        del data[key]
    write_json(path, {**data, **changes})


# --- (a) the loader against sparsify's own files ------------------------------------------------------------


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_folders_sparsify_saved_load_as_topk_saes_with_its_tensors(tmp_path, dtype, name):
    root = tmp_path / "ckpt"
    a, b = _saved(root, "layers.3", seed=1, dtype=dtype), _saved(root, "layers.11", seed=2, dtype=dtype)
    assert detect_format(str(root)) == detect_format(a) == "sparsify"
    meta = SaeMeta(d_model=D, d_sae=F, activation="topk", k=K, dtype=name, b_dec_in=True)
    assert read_sae_meta(str(root)) == {("post_mlp", 3): meta, ("post_mlp", 11): meta}
    got = load_sae(str(root))
    assert list(got) == [("post_mlp", 3), ("post_mlp", 11)]
    for site, folder in ((("post_mlp", 3), a), (("post_mlp", 11), b)):
        ref = sparsify_module().SparseCoder.load_from_disk(folder)  # sparsify's own reader
        w = got[site]
        assert w.meta == meta and w.threshold is None
        for arr, tensor in ((w.w_enc, ref.encoder.weight.T), (w.b_enc, ref.encoder.bias), (w.w_dec, ref.W_dec),
                            (w.b_dec, ref.b_dec)):
            assert arr.dtype == np.float32 and arr.flags.c_contiguous
            np.testing.assert_array_equal(arr, tensor.detach().float().numpy())
    assert load_sae(a)[("post_mlp", 3)].meta == meta  # one folder alone: its name is its hookpoint


def test_expansion_factor_gives_the_width_when_num_latents_is_zero(tmp_path):
    folder = _saved(tmp_path, "layers.2", num_latents=0, expansion_factor=3)
    assert read_sae_meta(folder)[("post_mlp", 2)].d_sae == 3 * D


def test_the_test_writer_writes_what_sparsify_writes(tmp_path):
    """tests/sae_writers.write_sparsify (used where no sparsify coder is at hand) against save_to_disk."""
    own = _saved(tmp_path / "a", "layers.4")
    w = random_sae(D, F, "topk", k=K, seed=3, b_dec_in=True)
    ours = write_sparsify(str(tmp_path / "b" / "layers.4"), w)
    with open(os.path.join(own, "cfg.json")) as f1, open(os.path.join(ours, "cfg.json")) as f2:
        assert json.load(f1) == json.load(f2)
    headers = [sae_files._st_shapes(sae_files._st_header(os.path.join(p, "sae.safetensors"), sae_files.UNRESTRICTED))
               for p in (own, ours)]
    assert headers[0] == headers[1]
    ref = sparsify_module().SparseCoder.load_from_disk(ours)  # strict: every tensor name and shape as it expects
    np.testing.assert_array_equal(ref.encoder.weight.detach().numpy(), w.w_enc.T)
    np.testing.assert_array_equal(load_sae(ours)[("post_mlp", 4)].w_enc, w.w_enc)


def test_a_training_checkpoint_root_and_site(tmp_path):
    """The trainer's save dir holds config.json, state files and best/ beside the hookpoint folders; ``site``
    picks one hookpoint of a root."""
    root = tmp_path / "run"
    _saved(root, "layers.1", seed=1)
    _saved(root, "layers.7", seed=2)
    _saved(root / "best", "layers.1", seed=3)
    write_json(str(root / "config.json"), {"sae": {}, "batch_size": 32})
    (root / "state.pt").write_bytes(b"\x00" * 8)
    assert list(read_sae_meta(str(root))) == [("post_mlp", 1), ("post_mlp", 7)]
    assert list(load_sae(str(root), site="post_mlp.7")) == [("post_mlp", 7)]
    assert list(read_sae_meta(str(root), site="blocks.1.hook_resid_post")) == [("post_mlp", 1)]
    with pytest.raises(SaeFileError, match=r"run: site: no hookpoint folder for post_mlp\.5 .*'layers\.1', 'layers"):
        read_sae_meta(str(root), site="post_mlp.5")
    with pytest.raises(SaeFileError, match=r"run: site: no hookpoint folder for pre_attn\.1 .*layers\.N is post_mlp"):
        read_sae_meta(str(root), site="pre_attn.1")


def test_a_folder_site_argument_must_agree_and_a_renamed_folder_needs_one(tmp_path):
    folder = _saved(tmp_path, "layers.3")
    assert list(read_sae_meta(folder, site="post_mlp.3")) == [("post_mlp", 3)]
    with pytest.raises(SaeFileError, match=r"layers\.3: site: post_mlp\.4 disagrees with the folder's hookpoint"):
        read_sae_meta(folder, site="post_mlp.4")
    renamed = _saved(tmp_path, "my-sae")
    with pytest.raises(SaeFileError, match=r"my-sae: site: the folder name 'my-sae' is not a hookpoint .*pass site="):
        read_sae_meta(renamed)
    assert list(load_sae(renamed, site="post_attn.2")) == [("post_attn", 2)]


def test_the_meta_reads_headers_only(tmp_path, monkeypatch):
    folder = _saved(tmp_path, "layers.3")

    def refuse(*a, **k):
        raise AssertionError("array data read")

    monkeypatch.setattr(sae_files, "_st_read", refuse)
    monkeypatch.setattr(importlib.import_module("vllm_steer.core.sae_sparsify"), "_st_read", refuse)
    assert read_sae_meta(folder)[("post_mlp", 3)].d_sae == F
    with pytest.raises(AssertionError, match="array data read"):
        load_sae(folder)


CFG_REFUSALS = {  # name -> (cfg changes, drop, key, message)
    "groupmax": ({"activation": "groupmax"}, (), "activation", "'groupmax' .* is not served: only topk"),
    "activation": ({"activation": "relu"}, (), "activation", "unknown activation 'relu'"),
    "signed": ({"signed": True}, (), "signed", "a signed SAE .*drops the field and would load it as unsigned"),
    "signed_type": ({"signed": "no"}, (), "signed", "expected true or false"),
    "transcode_type": ({"transcode": "yes"}, (), "transcode", "expected true or false"),
    "skip": ({"skip_connection": True}, (), "skip_connection", r"a skip connection on an SAE \(transcode false\) is "
                                                               "not served: only skip transcoders"),
    "multi_topk_type": ({"multi_topk": 1}, (), "multi_topk", "expected true or false"),
    "no_k": ({}, ("k",), "k", "missing"),
    "no_d_in": ({}, ("d_in",), "d_in", "missing"),
    "k_zero": ({"k": 0}, (), "k", r"topk needs 1 <= k <= d_sae \(48\), got 0"),
    "k_big": ({"k": F + 1}, (), "k", r"topk needs 1 <= k <= d_sae \(48\), got 49"),
    "k_type": ({"k": "5"}, (), "k", "expected an integer"),
    "d_in": ({"d_in": D + 1}, (), "d_in", r"17 disagrees with encoder\.weight \[48, 16\]"),
    "num_latents": ({"num_latents": F + 2}, (), "num_latents", r"50 disagrees with encoder\.weight"),
    "expansion_factor": ({"num_latents": 0, "expansion_factor": 2}, (), "expansion_factor",
                         r"2 x d_in 16 disagrees with encoder\.weight \[48, 16\] \(num_latents is 0\)"),
}


@pytest.mark.parametrize("case", list(CFG_REFUSALS))
def test_cfg_refusals_name_the_field(tmp_path, case):
    changes, drop, key, match = CFG_REFUSALS[case]
    folder = write_sparsify(str(tmp_path / "ckpt" / "layers.2"), random_sae(D, F, "topk", k=K, b_dec_in=True))
    _edit(folder, drop, **changes)
    for path in (folder, str(tmp_path / "ckpt")):  # the folder, and the root holding it
        with pytest.raises(SaeFileError, match=rf"layers\.2/cfg\.json: {key}: {match}") as e:
            read_sae_meta(path)
        assert e.value.key == key


def test_multi_topk_and_unknown_keys_load_as_sparsify_reads_them(tmp_path):
    folder = write_sparsify(str(tmp_path / "layers.2"), random_sae(D, F, "topk", k=K, b_dec_in=True),
                            multi_topk=True, normalize_decoder=False, some_future_field=3)
    assert read_sae_meta(folder)[("post_mlp", 2)].k == K


def test_hookpoints_of_another_kind_are_refused(tmp_path):
    """An SAE of a submodule's output is not the residual stream; a transcoder's hookpoint must be an MLP
    (layers.L.mlp); a root mixing SAEs and transcoders is refused (one steer.sae entry is one kind) unless site
    picks one folder."""
    w = random_sae(D, F, "topk", k=K, b_dec_in=True)
    sub = write_sparsify(str(tmp_path / "sub" / "layers.3.self_attn"), w)
    for path, kw in ((sub, {}), (sub, {"site": "post_mlp.3"}), (str(tmp_path / "sub"), {})):
        with pytest.raises(SaeFileError, match=r"layers\.3\.self_attn: hookpoint: 'layers\.3\.self_attn' is not served "
                                               r"as an SAE's hookpoint: only layers\.N"):
            read_sae_meta(path, **kw)
    for name in ("layers.3", "layers.3.self_attn"):
        tc = write_sparsify(str(tmp_path / "tc" / name), w, transcode=True)
        with pytest.raises(SaeFileError, match=rf"{name}: hookpoint: '{name}' is not served as a transcoder's "
                                               r"hookpoint: only layers\.L\.mlp"):
            read_sae_meta(tc)
    renamed = write_sparsify(str(tmp_path / "my-tc"), w, transcode=True)
    with pytest.raises(SaeFileError, match=r"my-tc: site: a transcoder of layer L sits at post_attn\.L"):
        read_sae_meta(renamed, site="post_mlp.3")
    assert list(read_sae_meta(renamed, site="post_attn.3")) == [("post_attn", 3)]
    with pytest.raises(SaeFileError, match=r"layers\.3\.mlp: site: post_attn\.4 disagrees with the folder's "
                                           r"hookpoint layers\.3\.mlp \(post_attn\.3\)"):
        read_sae_meta(write_sparsify(str(tmp_path / "one" / "layers.3.mlp"), w, transcode=True), site="post_attn.4")
    # a root with a hookpoint we do not map: refused naming it, unless site picks a layers.N folder
    write_sparsify(str(tmp_path / "mixed" / "embed_tokens"), w)
    write_sparsify(str(tmp_path / "mixed" / "layers.5"), w)
    with pytest.raises(SaeFileError, match=r"embed_tokens: site: the folder name 'embed_tokens' is not a hookpoint"):
        read_sae_meta(str(tmp_path / "mixed"))
    assert list(read_sae_meta(str(tmp_path / "mixed"), site="post_mlp.5")) == [("post_mlp", 5)]
    both = tmp_path / "both"
    write_sparsify(str(both / "layers.5"), w)
    write_sparsify(str(both / "layers.5.mlp"), w, transcode=True)
    with pytest.raises(SaeFileError, match=r"both: transcode: the checkpoint holds SAEs and transcoders \(layers\.5"
                                           r"\.mlp\): one steer\.sae entry is one kind; load each with site="):
        read_sae_meta(str(both))
    assert list(read_sae_meta(str(both), site="post_attn.5")) == [("post_attn", 5)]
    assert list(read_sae_meta(str(both), site="post_mlp.5")) == [("post_mlp", 5)]


# --- (c) transcoders: sparsify's TopK transcoders and skip transcoders ---------------------------------------


@pytest.mark.parametrize("skip", [False, True], ids=["transcoder", "skip_transcoder"])
def test_transcoders_sparsify_saved_load_at_post_attn_without_w_skip(tmp_path, skip):
    """A checkpoint root of sparsify-saved (skip) transcoders (hookpoints layers.L.mlp): transcoders at post_attn.L,
    TopK, b_dec not subtracted from the input (sparsify's encode does not for a transcoder), their arrays sparsify's
    own; W_skip checked for its shape and never read (the clamps' edit does not contain it)."""
    root = tmp_path / "tc"
    cfg = {"transcode": True, "skip_connection": skip}
    for layer in (1, 3):
        sparsify_coder(D, F, K, seed=layer, **cfg).save_to_disk(root / f"layers.{layer}.mlp")
    meta = SaeMeta(d_model=D, d_sae=F, activation="topk", k=K, dtype="float32", b_dec_in=False, transcoder=True)
    assert read_sae_meta(str(root)) == {("post_attn", 1): meta, ("post_attn", 3): meta}
    got = load_sae(str(root))
    ref = sparsify_module().SparseCoder.load_from_disk(root / "layers.3.mlp")
    w = got[("post_attn", 3)]
    for arr, tensor in ((w.w_enc, ref.encoder.weight.T), (w.b_enc, ref.encoder.bias), (w.w_dec, ref.W_dec),
                        (w.b_dec, ref.b_dec)):
        np.testing.assert_array_equal(arr, tensor.detach().float().numpy())
    assert read_sae_meta(str(root), site="post_attn.1") == {("post_attn", 1): meta}
    if skip:  # W_skip's shape is checked; a missing one is named
        arrays = {**_arrays(w), "W_skip": np.zeros((D, D + 1), np.float32)}
        write_safetensors(str(root / "layers.1.mlp" / "sae.safetensors"), arrays)
        with pytest.raises(SaeFileError, match=r"sae\.safetensors: W_skip: shape \[16, 17\] does not match"):
            read_sae_meta(str(root / "layers.1.mlp"))
        write_safetensors(str(root / "layers.1.mlp" / "sae.safetensors"), _arrays(w))
        with pytest.raises(SaeFileError, match=r"sae\.safetensors: W_skip: missing array"):
            read_sae_meta(str(root / "layers.1.mlp"))
    else:
        write_safetensors(str(root / "layers.1.mlp" / "sae.safetensors"), {**_arrays(w), "W_skip": np.zeros((D, D))})
        with pytest.raises(SaeFileError, match=r"sae\.safetensors: W_skip: unexpected array"):
            read_sae_meta(str(root / "layers.1.mlp"))


@pytest.mark.parametrize("skip", [False, True], ids=["transcoder", "skip_transcoder"])
@pytest.mark.parametrize("bias_shift", [0.0, 4.0], ids=["dense", "fewer_than_k_active"])
@torch.no_grad()
def test_transcoder_pack_edits_the_mlp_output_as_sparsify_forward_with_clamped_latents(tmp_path, skip, bias_shift):
    """The worker's pack of a sparsify (skip) transcoder (a TopK full pack at post_attn.L, weights rounded to bf16 as
    staged) and the reference's edit of the MLP's output from its input (``clamp_delta_naive``, as the norm's
    ``transcoder_step``) equal sparsify's own forward with the latents clamped minus its forward (W_skip x cancels),
    per row (OFF, every clamp kind); the catalog refuses reconstruct and runtime registration, naming the field."""
    from vllm_steer.core.config import SaeModuleConfig, SteerConfig, SteerConfigError
    from vllm_steer.core.errors import SteeringSpecError
    from vllm_steer.core.sae_catalog import runtime_entry, sae_catalog, slot_sites
    from vllm_steer.core.sae_rows import wire_entry
    from vllm_steer.kernels.sae_clamp.packed import N_FULL, clamp_delta_naive
    from vllm_steer.runtime.sae_tables import SaeTables

    site = ("post_attn", 2)
    coder = sparsify_coder(D, F, K, seed=11, bias_shift=bias_shift, bf16=True, transcode=True, skip_connection=skip)
    coder.save_to_disk(tmp_path / "tc" / "layers.2.mlp")
    cfg = SteerConfig.model_validate({"sae": {"tc": {"path": str(tmp_path / "tc"), "features": [1, 4, 9, 30]}}})
    catalog = sae_catalog(cfg, D, 4)
    assert catalog["tc"].transcoder and catalog["tc"].full and list(catalog["tc"].sites) == [site]
    tables = SaeTables(catalog, {}, {site}, 4, D, torch.device("cpu"), runtime_access(None, 1))
    assert not tables.packs and len(tables.tc_packs[site]) == N_FULL and tables.tc_topk == {site: K}
    feats = np.array([1, 4, 9, 30])
    kind = torch.zeros(4, F, dtype=torch.int8)
    value, only = torch.zeros(4, F), torch.zeros(4, F, dtype=torch.int8)
    kind[1, feats] = torch.tensor([naive.SET, naive.ADD, naive.SCALE, naive.SET], dtype=torch.int8)
    value[1, feats] = torch.tensor([5.0, 2.0, 3.0, 4.0])
    only[1, 9] = 1
    kind[3, 30], value[3, 30] = naive.SCALE, 0.0  # ablate one latent
    for r, mode in ((1, naive.DELTA), (2, naive.OFF), (3, naive.DELTA)):
        slots = np.nonzero(kind[r, feats].numpy())[0].astype(np.int32)
        codes = (kind[r, feats[slots]].numpy().astype(np.int32) | only[r, feats[slots]].numpy().astype(np.int32) * 4)
        if len(slots) and mode:
            tables.write_row(r, [wire_entry("tc", *site, int(mode), slots, codes, value[r, feats[slots]].numpy())])
    x = torch.randn(30, D, generator=torch.Generator().manual_seed(12)) * 2.0  # the MLP's input
    rows = torch.arange(30) % 4
    got = clamp_delta_naive(x, rows, tables.tc_packs[site], tables.tc_topk[site])
    want = sparsify_clamped(coder, x, kind[rows], value[rows], only[rows])
    want[(rows == 0) | (rows == 2)] = 0.0  # rows 0 and 2 (OFF) are not clamped
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[rows == 1].abs().amax(-1) > 0.1).all()  # the clamps moved the output
    with pytest.raises(SteerConfigError, match=r"steer\.sae\.tc: .*a transcoder clamps only"):
        sae_catalog(cfg.model_copy(update={"sae": {"tc": SaeModuleConfig(path=str(tmp_path / "tc"),
                                                                         reconstruct=True)}}), D, 4)
    rt = SteerConfig.model_validate({"sae_root": str(tmp_path), "sae_slots": {"post_attn.2": {
        "features": 8, "d_sae": 64, "k": K}}})
    with pytest.raises(SteeringSpecError, match="a transcoder cannot be registered at runtime") as e:
        runtime_entry("rt", SaeModuleConfig(path=str(tmp_path / "tc")), rt, D, 4, slot_sites(rt, 4), 1)
    assert e.value.field == "path"


def _arrays(w):
    return {"encoder.weight": np.ascontiguousarray(w.w_enc.T), "encoder.bias": w.b_enc, "W_dec": w.w_dec,
            "b_dec": w.b_dec}


ARRAY_REFUSALS = {  # name -> (arrays from the good ones, key, message)
    "missing": (lambda t: {k: v for k, v in t.items() if k != "W_dec"}, "W_dec", "missing array; the file holds"),
    "w_skip": (lambda t: {**t, "W_skip": np.zeros((D, D), np.float32)}, "W_skip", "unexpected array for a sparsify"),
    "rank": (lambda t: {**t, "encoder.weight": t["encoder.weight"].reshape(-1)}, "encoder.weight", "wrong rank"),
    "w_dec": (lambda t: {**t, "W_dec": np.ascontiguousarray(t["W_dec"].T)}, "W_dec",
              r"shape \[16, 48\] does not match encoder\.weight \[48, 16\]: expected \[48, 16\]"),
    "bias": (lambda t: {**t, "encoder.bias": t["encoder.bias"][:-1]}, "encoder.bias", r"expected \[48\]"),
    "b_dec": (lambda t: {**t, "b_dec": np.zeros(D + 1, np.float32)}, "b_dec", r"expected \[16\]"),
}


@pytest.mark.parametrize("case", list(ARRAY_REFUSALS))
def test_array_refusals_name_the_array(tmp_path, case):
    make, key, match = ARRAY_REFUSALS[case]
    w = random_sae(D, F, "topk", k=K, b_dec_in=True)
    folder = write_sparsify(str(tmp_path / "layers.2"), w)
    write_safetensors(os.path.join(folder, "sae.safetensors"), make(_arrays(w)))
    for read in (read_sae_meta, load_sae):
        with pytest.raises(SaeFileError, match=rf"sae\.safetensors: {key}: .*{match}") as e:
            read(folder)
        assert e.value.key == key


def test_non_finite_weights_are_refused_on_load(tmp_path):
    w = random_sae(D, F, "topk", k=K, b_dec_in=True)
    folder = write_sparsify(str(tmp_path / "layers.2"), w)
    arrays = _arrays(w)
    arrays["encoder.weight"] = arrays["encoder.weight"].copy()
    arrays["encoder.weight"][1, 2] = np.nan
    write_safetensors(os.path.join(folder, "sae.safetensors"), arrays)
    read_sae_meta(folder)
    with pytest.raises(SaeFileError, match=r"sae\.safetensors: encoder\.weight: non-finite values \(1 of"):
        load_sae(folder)


def test_no_hookpoint_folder_and_explicit_format(tmp_path):
    (tmp_path / "empty" / "layers.1").mkdir(parents=True)
    with pytest.raises(SaeFileError, match=r"empty: format: not an SAE file or directory.*sparsify"):
        read_sae_meta(str(tmp_path / "empty"))
    with pytest.raises(SaeFileError, match=r"empty: format: no sparsify hookpoint folder"):
        read_sae_meta(str(tmp_path / "empty"), format="sparsify")
    folder = _saved(tmp_path, "layers.2")
    assert list(read_sae_meta(folder, format="sparsify")) == [("post_mlp", 2)]


def test_runtime_paths_a_folder_linking_out_of_the_root_is_refused_whatever_it_points_at(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    _saved(root / "ckpt", "layers.1")
    _saved(outside, "layers.2")
    files = runtime_access((str(root),), 1 << 30)
    assert list(read_sae_meta(str(root / "ckpt"), files=files)) == [("post_mlp", 1)]
    os.symlink(outside / "layers.2", root / "ckpt" / "layers.2")
    with pytest.raises(SaePathError) as e:
        read_sae_meta(str(root / "ckpt"), files=files)
    assert str(e.value) == DENIED
    os.remove(root / "ckpt" / "layers.2")
    os.symlink(outside / "no-such-folder", root / "ckpt" / "layers.2")
    with pytest.raises(SaePathError) as e:
        read_sae_meta(str(root / "ckpt"), files=files)
    assert str(e.value) == DENIED
    with pytest.raises(SaePathError):  # a link leaving the root refuses the root, whichever hookpoint is picked
        read_sae_meta(str(root / "ckpt"), site="post_mlp.1", files=files)
    assert list(read_sae_meta(str(root / "ckpt" / "layers.1"), files=files)) == [("post_mlp", 1)]


def test_steer_sae_config_and_runtime_registration_accept_it(tmp_path):
    from vllm_steer.core.config import SaeModuleConfig, SteerConfig
    from vllm_steer.core.sae_catalog import runtime_entry, sae_catalog, slot_sites
    from vllm_steer.server.schemas import SaeRegistration

    root = tmp_path / "ckpt"
    _saved(root, "layers.1", seed=1)
    _saved(root, "layers.2", seed=2)
    catalog = sae_catalog(SteerConfig.model_validate({"sae": {"sp": {"path": str(root), "format": "sparsify"}}}),
                          D, 4)
    e = catalog["sp"]
    assert e.full and list(e.sites) == [("post_mlp", 1), ("post_mlp", 2)] and e.features == tuple(range(F))
    assert {m.k for m in e.sites.values()} == {K}
    cfg = SteerConfig.model_validate({"sae_root": str(tmp_path), "sae_slots": {
        "post_mlp.2": {"features": 8, "d_sae": 64, "k": K, "reconstruct": True}}})
    reg = SaeRegistration(name="rt", path=str(root), format="sparsify", site="post_mlp.2", features=[0, 3])
    c = SaeModuleConfig(path=reg.path, format=reg.format, site=reg.site, features=tuple(reg.features))
    entry = runtime_entry("rt", c, cfg, D, 4, slot_sites(cfg, 4), 1)
    assert list(entry.sites) == [("post_mlp", 2)] and entry.full


# --- (b) the plain-torch reference against sparsify's encode / decode -------------------------------------------


def _naive_sae(folder, site) -> naive.Sae:
    w = load_sae(folder)[site]
    return naive.Sae(torch.from_numpy(w.w_enc), torch.from_numpy(w.b_enc), torch.from_numpy(w.w_dec),
                     torch.from_numpy(w.b_dec), naive.TOPK, None, w.meta.k, w.meta.b_dec_in)


@pytest.mark.parametrize("multi_topk", [False, True])
@pytest.mark.parametrize("bias_shift", [0.0, 5.0], ids=["dense", "fewer_than_k_active"])
@torch.no_grad()
def test_the_reference_equals_sparsify_encode_and_decode(tmp_path, multi_topk, bias_shift):
    folder = _saved(tmp_path, "layers.6", seed=7, multi_topk=multi_topk, bias_shift=bias_shift)
    coder = sparsify_module().SparseCoder.load_from_disk(folder)
    sae = _naive_sae(folder, ("post_mlp", 6))
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(8)) * 2.0
    top_acts, top_indices, _ = coder.encode(x)
    want = torch.zeros(40, F).scatter(-1, top_indices, top_acts)
    f = naive.encode(sae, x)
    torch.testing.assert_close(f, want, rtol=1e-5, atol=1e-5)
    active = f > 0
    if bias_shift:  # the case sparsify pads its k with zeros: some rows have fewer than k active latents
        assert (active.sum(-1) < K).any()
    assert torch.equal(active, want > 0) and (active.sum(-1) <= K).all()

    # reconstruct (no clamps) is sparsify's decode(encode(x)); a delta with clamps is x + decode(f') - decode(f)
    rows, f_all = torch.ones(40, dtype=torch.int32), torch.arange(F).expand(40, F)
    kind, value, only = torch.zeros(2, F, dtype=torch.int8), torch.zeros(2, F), torch.zeros(2, F, dtype=torch.int8)
    got = naive.sae_clamp_naive(x, rows, sae, torch.tensor([0, naive.RECONSTRUCT], dtype=torch.int8), kind, value, only)
    torch.testing.assert_close(got, coder.decode(top_acts, top_indices), rtol=1e-5, atol=1e-5)
    kind[1, [3, 17, 30]] = torch.tensor([naive.SET, naive.ADD, naive.SCALE], dtype=torch.int8)
    value[1, [3, 17, 30]] = torch.tensor([4.0, 2.5, 3.0])
    got = naive.sae_clamp_naive(x, rows, sae, torch.tensor([0, naive.DELTA], dtype=torch.int8), kind, value, only)
    f_new = naive.clamp(want, kind[rows.long()], value[rows.long()], only[rows.long()])
    ref = x + coder.decode(f_new, f_all) - coder.decode(want, f_all)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (got - x).abs().max() > 0.1  # the clamps moved the stream
