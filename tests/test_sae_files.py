"""SAE weight files (vllm_steer.core.sae_files): each format round trips, the meta comes from headers
alone, and every bad file is a SaeFileError naming the file and the key at fault."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from tests.sae_writers import (
    random_sae, random_transcoder, tensors_of, write_gemma_scope, write_json, write_manifest, write_sae_lens,
    write_sae_lens_transcoder, write_safetensors,
)
from vllm_steer.core import sae_files
from vllm_steer.core.bf16 import round_to_bf16
from vllm_steer.core.sae_files import (
    ACTIVATIONS, FORMATS, SITE_HOOKS, SaeFileError, SaeMeta, detect_format, load_sae, parse_site, read_sae_meta,
)

D, F, K = 16, 48, 5


def _same(got, want, rounding=lambda a: a):
    for name in ("w_enc", "b_enc", "w_dec", "b_dec", "threshold"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == np.float32 and a.flags.c_contiguous, name
        np.testing.assert_array_equal(a, rounding(b), err_msg=name)


def _edit(path, drop=(), **changes):
    with open(path) as f:
        data = json.load(f)
    for key in drop:
        del data[key]
    data.update(changes)
    write_json(path, data)


def _lens_weights(d):
    return os.path.join(d, "sae_weights.safetensors")


# --- constants, parse_site, the error type ---------------------------------------------------------


def test_constants():
    assert SITE_HOOKS == ("pre_attn", "post_attn", "post_mlp")
    assert ACTIVATIONS == ("relu", "jumprelu", "topk")
    assert FORMATS == ("gemma_scope", "sae_lens", "manifest", "sparsify", "dictionary_learning")


@pytest.mark.parametrize("text, want", [("post_mlp.12", ("post_mlp", 12)), ("pre_attn.0", ("pre_attn", 0)),
                                        ("post_attn.107", ("post_attn", 107))])
def test_parse_site_good(text, want):
    assert parse_site(text, "site") == want


@pytest.mark.parametrize("text", [" 3", "post_mlp.-1", "sideways.2", "post_mlp.03", "post_mlp", "post_mlp.",
                                  "post_mlp.1 ", " post_mlp.1", "post_mlp.+1", "post_mlp.1.2", "post_mlp.\u0663",
                                  "post_mlp.1\n", "", 3, None])
def test_parse_site_bad(text):
    with pytest.raises(SaeFileError, match=r"^steer\.sae\.site: ") as e:
        parse_site(text, "steer.sae.site")
    assert e.value.key == "steer.sae.site" and e.value.path is None


def test_error_is_a_value_error_and_pickles():
    err = SaeFileError("/x/cfg.json", "d_in", "bad")
    assert isinstance(err, ValueError) and str(err) == "/x/cfg.json: d_in: bad"
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and (back.path, back.key, back.detail) == ("/x/cfg.json", "d_in", "bad")


def test_module_imports_no_torch():
    code = "import sys, vllm_steer.core.sae_files; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- gemma_scope ----------------------------------------------------------------------------------


def test_gemma_scope_round_trip(tmp_path):
    w = random_sae(D, F, "jumprelu", seed=1)
    d = write_gemma_scope(str(tmp_path / "g"), w)
    assert detect_format(d) == "gemma_scope" and detect_format(os.path.join(d, "params.npz")) == "gemma_scope"
    want_meta = SaeMeta(d_model=D, d_sae=F, activation="jumprelu", k=0, dtype="float32", b_dec_in=False)
    for path in (d, os.path.join(d, "params.npz")):
        assert read_sae_meta(path, site="post_mlp.7") == {("post_mlp", 7): want_meta}
        got = load_sae(path, format="gemma_scope", site="post_mlp.7")
        assert list(got) == [("post_mlp", 7)] and got[("post_mlp", 7)].meta == want_meta
        _same(got[("post_mlp", 7)], w)


def test_gemma_scope_float16(tmp_path):
    w = random_sae(D, F, "jumprelu", seed=2)
    d = write_gemma_scope(str(tmp_path / "g"), w, dtype="float16")
    (got,) = load_sae(d, site="pre_attn.2").values()
    assert got.meta.dtype == "float16"
    _same(got, w, lambda a: a.astype(np.float16).astype(np.float32))


def test_gemma_scope_needs_a_site(tmp_path):
    d = write_gemma_scope(str(tmp_path / "g"), random_sae(D, F, "jumprelu"))
    with pytest.raises(SaeFileError, match=r"params\.npz: site: .*pass site="):
        read_sae_meta(d)
    with pytest.raises(SaeFileError, match=r"params\.npz: site: unknown hook 'mlp'"):
        read_sae_meta(d, site="mlp.3")


def test_gemma_scope_meta_reads_headers_only(tmp_path, monkeypatch):
    d = write_gemma_scope(str(tmp_path / "g"), random_sae(D, F, "jumprelu"))

    def refuse(*a, **k):
        raise AssertionError("array data read")

    monkeypatch.setattr(np, "load", refuse)
    monkeypatch.setattr(np.lib.format, "read_array", refuse)
    assert read_sae_meta(d, site="post_mlp.1")[("post_mlp", 1)].d_sae == F
    with pytest.raises(AssertionError, match="array data read"):
        load_sae(d, site="post_mlp.1")


# --- sae_lens -------------------------------------------------------------------------------------


@pytest.mark.parametrize("new_format", [True, False], ids=["v6", "pre-v6"])
@pytest.mark.parametrize("activation, k", [("relu", 0), ("jumprelu", 0), ("topk", K)])
def test_sae_lens_round_trip(tmp_path, activation, k, new_format):
    w = random_sae(D, F, activation, k=k, seed=3, b_dec_in=True)
    d = write_sae_lens(str(tmp_path / "s"), w, hook_name="blocks.4.hook_resid_mid", new_format=new_format)
    assert detect_format(d) == "sae_lens"
    want = SaeMeta(d_model=D, d_sae=F, activation=activation, k=k, dtype="float32", b_dec_in=True)
    assert read_sae_meta(d) == {("post_attn", 4): want}
    got = load_sae(d)
    assert list(got) == [("post_attn", 4)] and got[("post_attn", 4)].meta == want
    _same(got[("post_attn", 4)], w)


@pytest.mark.parametrize("hook_name, site", [
    ("blocks.0.hook_resid_pre", ("pre_attn", 0)), ("blocks.11.hook_resid_mid", ("post_attn", 11)),
    ("blocks.25.hook_resid_post", ("post_mlp", 25)), ("model.layers.9", ("post_mlp", 9)),
])
def test_sae_lens_site_from_hook_name(tmp_path, hook_name, site):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F), hook_name=hook_name)
    assert list(read_sae_meta(d)) == [site]


@pytest.mark.parametrize("new_format", [True, False], ids=["v6", "pre-v6"])
def test_sae_lens_site_argument_overrides_and_unknown_hooks_need_it(tmp_path, new_format):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F), hook_name="blocks.3.hook_mlp_out", new_format=new_format)
    with pytest.raises(SaeFileError, match=r"cfg\.json: site: hook_name 'blocks\.3\.hook_mlp_out' .*pass site="):
        read_sae_meta(d)
    assert list(read_sae_meta(d, site="post_mlp.3")) == [("post_mlp", 3)]
    d2 = write_sae_lens(str(tmp_path / "s2"), random_sae(D, F), hook_name="blocks.3.hook_resid_post")
    assert list(load_sae(d2, site="pre_attn.5")) == [("pre_attn", 5)]


def test_sae_lens_hook_name_in_every_place_sae_lens_put_it(tmp_path):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F), new_format=True)
    cfg = os.path.join(d, "cfg.json")
    _edit(cfg, drop=["metadata"], meta={"hook_name": "blocks.2.hook_resid_pre"})  # sae-lens 6 release candidates
    assert list(read_sae_meta(d)) == [("pre_attn", 2)]
    _edit(cfg, drop=["meta"], hook_point="blocks.6.hook_resid_post")  # the oldest cfgs
    assert list(read_sae_meta(d)) == [("post_mlp", 6)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("activation, k", [("relu", 0), ("jumprelu", 0), ("topk", K)])
def test_sae_lens_half_precision_round_trip(tmp_path, dtype, activation, k):
    w = random_sae(D, F, activation, k=k, seed=4)
    d = write_sae_lens(str(tmp_path / "s"), w, dtype=dtype)
    (meta,) = read_sae_meta(d).values()
    assert meta.dtype == dtype
    (got,) = load_sae(d).values()
    rounding = round_to_bf16 if dtype == "bfloat16" else (lambda a: a.astype(np.float16).astype(np.float32))
    _same(got, w, rounding)
    assert not np.array_equal(got.w_enc, w.w_enc)  # the rounding happened (the check is not vacuous)


def test_sae_lens_log_threshold_is_exponentiated(tmp_path):
    w = random_sae(D, F, "jumprelu", seed=5)
    d = write_sae_lens(str(tmp_path / "s"), w, log_threshold=True)
    (got,) = load_sae(d).values()
    np.testing.assert_allclose(got.threshold, w.threshold, rtol=1e-6)
    assert got.threshold.dtype == np.float32


def test_jumprelu_negative_thresholds_follow_sae_lens(tmp_path):
    """sae-lens' JumpReLU is relu(pre) * (pre > t): a negative threshold lets no negative activation
    through. Loading clamps thresholds at 0, so the kernels' pre * (pre > t) gives the same."""
    import torch

    from vllm_steer.kernels.sae_clamp.naive import JUMPRELU, Sae, encode

    w = random_sae(D, F, "jumprelu", seed=8)
    w.threshold[: F // 2] = -np.abs(w.threshold[: F // 2]) - 0.3  # half the features: t < 0
    (got,) = load_sae(write_sae_lens(str(tmp_path / "s"), w)).values()
    np.testing.assert_array_equal(got.threshold, np.maximum(w.threshold, 0))
    x = np.random.default_rng(9).normal(0, 2, size=(64, D)).astype(np.float32)
    pre = x @ w.w_enc + w.b_enc
    sae_lens = np.maximum(pre, 0) * (pre > w.threshold)
    assert ((pre < 0) & (pre > w.threshold)).sum() > 50  # activations the old formula let through
    np.testing.assert_array_equal(pre * (pre > got.threshold), sae_lens)
    ref = Sae(*(torch.from_numpy(a) for a in (got.w_enc, got.b_enc, got.w_dec, got.b_dec)), activation=JUMPRELU,
              threshold=torch.from_numpy(w.threshold))  # the reference follows sae-lens even unclamped
    np.testing.assert_allclose(encode(ref, torch.from_numpy(x)).numpy(), sae_lens, rtol=1e-5, atol=1e-5)


def _sae_lens_topk_rescaled(x, w, k):
    """sae-lens TopKSAE with rescale_acts_by_decoder_norm: encode scales by the decoder norms, decode divides."""
    norms = np.linalg.norm(w.w_dec.astype(np.float64), axis=1)
    pre = (x @ w.w_enc + w.b_enc) * norms
    acts = np.zeros_like(pre)
    top = np.argsort(-pre, axis=1)[:, :k]
    np.put_along_axis(acts, top, np.maximum(np.take_along_axis(pre, top, axis=1), 0), axis=1)
    return acts, (acts / norms) @ w.w_dec + w.b_dec


def test_sae_lens_topk_decoder_norm_rescaling_is_folded(tmp_path):
    w = random_sae(D, F, "topk", k=K, seed=6)
    d = write_sae_lens(str(tmp_path / "s"), w)
    _edit(os.path.join(d, "cfg.json"), rescale_acts_by_decoder_norm=True)
    (got,) = load_sae(d).values()
    np.testing.assert_allclose(np.linalg.norm(got.w_dec, axis=1), 1.0, rtol=1e-5)
    x = np.random.default_rng(0).normal(size=(7, D))
    want_acts, want_out = _sae_lens_topk_rescaled(x, w, K)
    pre = x @ got.w_enc + got.b_enc
    acts = np.where(pre >= np.sort(pre, axis=1)[:, -K:][:, :1], np.maximum(pre, 0), 0.0)
    np.testing.assert_allclose(acts, want_acts, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acts @ got.w_dec + got.b_dec, want_out, rtol=1e-5, atol=1e-6)


def test_sae_lens_unit_scaling_factor_is_accepted_other_values_refused(tmp_path):
    w = random_sae(D, F, seed=7)
    d = write_sae_lens(str(tmp_path / "s"), w)
    write_safetensors(_lens_weights(d), {**tensors_of(w), "scaling_factor": np.ones(F, np.float32)})
    _same(next(iter(load_sae(d).values())), w)
    write_safetensors(_lens_weights(d), {**tensors_of(w), "scaling_factor": np.full(F, 2.0, np.float32)})
    with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: scaling_factor: .*not supported"):
        load_sae(d)


def test_sae_lens_truncated_data_is_refused_from_its_header(tmp_path, monkeypatch):
    """The header's data offsets are checked against the file's size before any tensor data is read
    (the API process refuses it as the workers would, and no array is allocated from a lying header)."""
    w = random_sae(D, F, "topk", k=K)
    d = write_sae_lens(str(tmp_path / "s"), w)
    path = _lens_weights(d)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    os.truncate(path, 8 + header_len + 12)  # header intact, data cut short
    monkeypatch.setattr(sae_files, "_st_read", lambda *a: pytest.fail("tensor data read"))
    for read in (read_sae_meta, load_sae):
        with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: W_\w+: data truncated"):
            read(d)


@pytest.mark.parametrize("change, key, match", [
    ({"architecture": "gated"}, "architecture", "unsupported architecture 'gated'"),
    ({"architecture": "batchtopk"}, "architecture", "unsupported architecture 'batchtopk'.*saves it for inference as a "
                                                    "JumpReLU SAE"),
    ({"architecture": "standard", "activation_fn": "tanh-relu"}, "activation_fn", "unsupported activation"),
    ({"normalize_activations": "expected_average_only_in"}, "normalize_activations", "not supported"),
    ({"normalize_activations": True}, "normalize_activations", "not supported"),
    ({"reshape_activations": "hook_z"}, "reshape_activations", "not supported"),
    ({"finetuning_scaling_factor": True}, "finetuning_scaling_factor", "not supported"),
    ({"d_in": D + 1}, "d_in", rf"{D + 1} disagrees with W_enc \[{D}, {F}\]"),
    ({"d_sae": F * 2}, "d_sae", rf"{F * 2} disagrees with W_enc"),
    ({"d_sae": "48"}, "d_sae", "expected an integer"),
    ({"apply_b_dec_to_input": "yes"}, "apply_b_dec_to_input", "expected true or false"),
])
def test_sae_lens_cfg_refusals(tmp_path, change, key, match):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F))
    _edit(os.path.join(d, "cfg.json"), **change)
    with pytest.raises(SaeFileError, match=rf"cfg\.json: {key}: .*{match}"):
        read_sae_meta(d)


# --- sae-lens transcoders -------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [False, True], ids=["transcoder", "skip"])
@pytest.mark.parametrize("activation", ["relu", "jumprelu"])
def test_sae_lens_transcoders_load_at_their_layers_post_attn_site(tmp_path, activation, skip):
    """sae-lens' Transcoder / SkipTranscoder (and their JumpReLU kinds), saved as sae-lens saves them: the site is
    post_attn.L (the norm whose output is layer L's MLP input), the meta says transcoder, no b_dec input; W_skip is
    checked, not read (the edit never involves it)."""
    w = random_transcoder(D, F, activation, seed=3)
    d = write_sae_lens_transcoder(str(tmp_path / "t"), w, 4, skip)
    want = SaeMeta(D, F, activation, 0, "float32", False, transcoder=True)
    assert read_sae_meta(d) == {("post_attn", 4): want}
    got = load_sae(d)[("post_attn", 4)]
    assert got.meta == want
    _same(got, w)


@pytest.mark.parametrize("fields, site, input", [
    # Gemma Scope (Gemma 2): TransformerLens' RMSNorm hooks x / scale before * w, the norm's output without its gain
    ({"hook_name": "blocks.7.ln2.hook_normalized"}, ("post_attn", 7), "gain_free"),
    ({"hook_name": "blocks.7.hook_mlp_in", "hf_hook_name": "model.layers.7.pre_feedforward_layernorm.output"},
     ("post_attn", 7), "site"),  # Gemma Scope 2: the HF hook says what the TL name does not (the output, gain in)
    # the HF name, read first, wins over a TL name without the gain
    ({"hook_name": "blocks.7.ln2.hook_normalized", "hf_hook_name": "model.layers.7.mlp"}, ("post_attn", 7), "site"),
    ({"hook_name": "blocks.2.mlp.hook_in"}, ("post_attn", 2), "site"),  # mwhanna's: the MLP's input, gain in
    ({"hook_name": "model.layers.5.mlp"}, ("post_attn", 5), "site"),
])
def test_sae_lens_transcoder_sites_from_hook_names(tmp_path, fields, site, input):
    d = write_sae_lens_transcoder(str(tmp_path / "t"), random_transcoder(D, F), 0)
    cfg = json.load(open(os.path.join(d, "cfg.json")))
    cfg["metadata"].update(fields, hook_name_out=f"blocks.{site[1]}.hook_mlp_out")
    write_json(os.path.join(d, "cfg.json"), cfg)
    meta = read_sae_meta(d)
    assert list(meta) == [site] and meta[site].input == input
    assert load_sae(d)[site].meta.input == input


@pytest.mark.parametrize("change, key, match", [
    ({"apply_b_dec_to_input": True}, "apply_b_dec_to_input", "not supported for a transcoder"),
    ({"d_out": D + 2}, "d_out", rf"{D + 2} != d_in {D}"),
    ({"architecture": "clt"}, "architecture", "unsupported architecture 'clt'"),
    ({"metadata": {"hook_name": "blocks.3.hook_resid_mid"}}, "metadata.hook_name", "is not an MLP input"),
    # TransformerLens' hook_mlp_in is the stream before the norm: only an hf_hook_name can say it is the output
    ({"metadata": {"hook_name": "blocks.3.hook_mlp_in"}}, "metadata.hook_name", "is not an MLP input"),
    ({"metadata": {"hook_name": "blocks.3.mlp.hook_in", "hook_name_out": "blocks.5.hook_mlp_out"}},
     "metadata.hook_name_out", "must write the MLP output of the layer it reads"),
    ({"metadata": {"hook_name": "blocks.3.mlp.hook_in", "hook_name_out": "blocks.3.hook_resid_post"}},
     "metadata.hook_name_out", "blocks.3.hook_mlp_out"),
])
def test_sae_lens_transcoder_cfg_refusals_name_the_field(tmp_path, change, key, match):
    d = write_sae_lens_transcoder(str(tmp_path / "t"), random_transcoder(D, F), 3, **change)
    with pytest.raises(SaeFileError, match=rf"cfg\.json: {key}: .*{match}"):
        read_sae_meta(d)


def test_sae_lens_transcoder_missing_d_out_and_w_skip_and_bad_sites(tmp_path):
    d = write_sae_lens_transcoder(str(tmp_path / "t"), random_transcoder(D, F), 3)
    _edit(os.path.join(d, "cfg.json"), drop=("d_out",))
    with pytest.raises(SaeFileError, match=r"cfg\.json: d_out: missing"):
        read_sae_meta(d)
    d = write_sae_lens_transcoder(str(tmp_path / "s"), random_transcoder(D, F), 3, skip=True)
    write_safetensors(_lens_weights(d), tensors_of(random_transcoder(D, F)))  # no W_skip
    with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: W_skip: missing array"):
        read_sae_meta(d)
    write_safetensors(_lens_weights(d), {**tensors_of(random_transcoder(D, F)), "W_skip": np.zeros((D, D + 1))})
    with pytest.raises(SaeFileError, match=r"W_skip: shape \[16, 17\] does not match"):
        read_sae_meta(d)
    d = write_sae_lens_transcoder(str(tmp_path / "u"), random_transcoder(D, F), 3,
                                  metadata={"hook_name": None})  # no hook: the site must be given, a post_attn one
    with pytest.raises(SaeFileError, match="site: .*does not name the MLP input of a layer"):
        read_sae_meta(d)
    assert list(read_sae_meta(d, site="post_attn.6")) == [("post_attn", 6)]
    with pytest.raises(SaeFileError, match="site: a transcoder of layer L sits at post_attn.L"):
        read_sae_meta(d, site="post_mlp.6")


def test_sae_lens_old_hook_z_sae_is_refused(tmp_path):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F), hook_name="blocks.2.attn.hook_z", new_format=False)
    with pytest.raises(SaeFileError, match=r"cfg\.json: reshape_activations: 'hook_z'"):
        read_sae_meta(d, site="post_attn.2")


@pytest.mark.parametrize("new_format", [True, False], ids=["v6", "pre-v6"])
@pytest.mark.parametrize("k, key, match", [
    (None, "k", "needs k"), (0, "k", r"1 <= k <= d_sae \(48\), got 0"), (F + 1, "k", "got 49"),
    (2.5, "k", "expected an integer"),
])
def test_sae_lens_topk_k(tmp_path, new_format, k, key, match):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F, "topk", k=K), new_format=new_format)
    cfg = os.path.join(d, "cfg.json")
    if new_format:
        _edit(cfg, drop=["k"] if k is None else [], **({} if k is None else {"k": k}))
    else:
        _edit(cfg, activation_fn_kwargs={} if k is None else {"k": k})
        key = "k" if k is None else "activation_fn_kwargs.k"
    with pytest.raises(SaeFileError, match=rf"cfg\.json: {key}: .*{match}"):
        read_sae_meta(d)


def test_sae_lens_integral_float_k_is_accepted(tmp_path):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F, "topk", k=K))
    _edit(os.path.join(d, "cfg.json"), k=float(K))  # sae-lens 6.11 allows a float k
    assert next(iter(read_sae_meta(d).values())).k == K


# --- manifest -------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation, k", [("relu", 0), ("jumprelu", 0), ("topk", K)])
def test_manifest_round_trip(tmp_path, activation, k):
    saes = {"post_mlp.12": random_sae(D, F, activation, k=k, seed=8),
            "pre_attn.0": random_sae(D, F, activation, k=k, seed=9)}
    d = write_manifest(str(tmp_path / "m"), saes, activation, k, b_dec_in=True)
    assert detect_format(d) == "manifest"
    want = SaeMeta(D, F, activation, k, "float32", True)
    assert read_sae_meta(d) == {("post_mlp", 12): want, ("pre_attn", 0): want}
    got = load_sae(d)
    assert set(got) == {("post_mlp", 12), ("pre_attn", 0)}
    _same(got[("post_mlp", 12)], saes["post_mlp.12"])
    _same(got[("pre_attn", 0)], saes["pre_attn.0"])


def test_manifest_bf16(tmp_path):
    w = random_sae(D, F, "jumprelu", seed=10)
    d = write_manifest(str(tmp_path / "m"), {"post_attn.3": w}, "jumprelu", dtype="bfloat16")
    assert read_sae_meta(d)[("post_attn", 3)].dtype == "bfloat16"
    _same(load_sae(d)[("post_attn", 3)], w, round_to_bf16)


def test_manifest_meta_reads_headers_only(tmp_path, monkeypatch):
    d = write_manifest(str(tmp_path / "m"), {"post_mlp.1": random_sae(D, F)}, "relu")
    monkeypatch.setattr(sae_files, "_st_read", lambda *a: pytest.fail("tensor data read"))
    assert read_sae_meta(d)[("post_mlp", 1)].d_model == D


def test_manifest_refuses_a_site_argument(tmp_path):
    d = write_manifest(str(tmp_path / "m"), {"post_mlp.1": random_sae(D, F)}, "relu")
    with pytest.raises(SaeFileError, match=r"manifest\.json: site: must not be given"):
        load_sae(d, site="post_mlp.1")


@pytest.mark.parametrize("change, key, match", [
    ({"format": "other"}, "format", "expected 'vllm-steer-sae'"),
    ({"version": 2}, "version", "unsupported version 2"),
    ({"version": True}, "version", "expected an integer"),
    ({"activation": "gelu"}, "activation", "unknown activation 'gelu'"),
    ({"activaton": "relu"}, "activaton", "unknown key"),
    ({"k": 3}, "k", "k is for topk only"),
    ({"b_dec_in": 1}, "b_dec_in", "expected true or false"),
    ({"sites": {}}, "sites", "non-empty"),
    ({"sites": {"post_mlp.01": "post_mlp_1.safetensors"}}, r"sites\['post_mlp\.01'\]", "leading zeros"),
    ({"sites": {"post_mlp.1": "../outside.safetensors"}}, r"sites\['post_mlp\.1'\]", "escapes"),
    ({"sites": {"post_mlp.1": "/etc/passwd"}}, r"sites\['post_mlp\.1'\]", "relative file path"),
    ({"sites": {"post_mlp.1": "missing.safetensors"}}, r"sites\['post_mlp\.1'\]", "file not found"),
    ({"sites": {"post_mlp.1": 7}}, r"sites\['post_mlp\.1'\]", "relative file path"),
])
def test_manifest_refusals(tmp_path, change, key, match):
    d = write_manifest(str(tmp_path / "m"), {"post_mlp.1": random_sae(D, F)}, "relu")
    write_safetensors(str(tmp_path / "outside.safetensors"), tensors_of(random_sae(D, F)))
    _edit(os.path.join(d, "manifest.json"), **change)
    with pytest.raises(SaeFileError, match=rf"manifest\.json: {key}: .*{match}"):
        read_sae_meta(d)


def test_manifest_refuses_a_symlink_out_of_its_directory(tmp_path):
    d = write_manifest(str(tmp_path / "m"), {"post_mlp.1": random_sae(D, F)}, "relu")
    outside = write_safetensors(str(tmp_path / "outside.safetensors"), tensors_of(random_sae(D, F)))
    os.symlink(outside, os.path.join(d, "link.safetensors"))
    _edit(os.path.join(d, "manifest.json"), sites={"post_mlp.1": "link.safetensors"})
    with pytest.raises(SaeFileError, match="escapes"):
        read_sae_meta(d)


@pytest.mark.parametrize("k, match", [(None, "needs k"), (0, "got 0"), (F + 1, "got 49"), ("3", "expected an integer")])
def test_manifest_topk_k(tmp_path, k, match):
    d = write_manifest(str(tmp_path / "m"), {"post_mlp.1": random_sae(D, F, "topk", k=K)}, "topk", K)
    mpath = os.path.join(d, "manifest.json")
    _edit(mpath, drop=["k"]) if k is None else _edit(mpath, k=k)
    with pytest.raises(SaeFileError, match=rf"manifest\.json: k: .*{match}"):
        read_sae_meta(d)


# --- array checks, shared by every format ---------------------------------------------------------


def _bad_arrays(w):
    t = tensors_of(w)
    return {
        "missing": ({k: v for k, v in t.items() if k != "W_dec"}, "W_dec", "missing array"),
        "threshold": ({k: v for k, v in t.items() if k != "threshold"}, "threshold", "missing array .jumprelu needs"),
        "rank_enc": ({**t, "W_enc": t["W_enc"].reshape(-1)}, "W_enc", "wrong rank"),
        "rank_b": ({**t, "b_enc": t["b_enc"][None]}, "b_enc", "wrong rank: expected 1 dims"),
        "w_dec": ({**t, "W_dec": np.ascontiguousarray(t["W_dec"].T)}, "W_dec", r"shape \[16, 48\] does not match"),
        "b_enc": ({**t, "b_enc": t["b_enc"][:-1]}, "b_enc", r"expected \[48\]"),
        "b_dec": ({**t, "b_dec": np.zeros(D + 1, np.float32)}, "b_dec", r"expected \[16\]"),
        "thr": ({**t, "threshold": t["threshold"][:3]}, "threshold", r"expected \[48\]"),
        "extra": ({**t, "W_gate": t["W_enc"]}, "W_gate", "unexpected array for a jumprelu SAE"),
    }


CASES = list(_bad_arrays(random_sae(D, F, "jumprelu")))
JUMPRELU_FORMATS = ("gemma_scope", "sae_lens", "manifest")  # sparsify's TopK arrays: tests/test_sae_sparsify.py


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", JUMPRELU_FORMATS)
def test_bad_arrays_are_refused(tmp_path, fmt, case):
    w = random_sae(D, F, "jumprelu")
    arrays, key, match = _bad_arrays(w)[case]
    if fmt == "gemma_scope":
        d = write_gemma_scope(str(tmp_path / "x"), w)
        np.savez(os.path.join(d, "params.npz"), **arrays)
        file, kw = "params.npz", {"site": "post_mlp.1"}
    elif fmt == "sae_lens":
        d = write_sae_lens(str(tmp_path / "x"), w)
        write_safetensors(_lens_weights(d), arrays)
        file, kw = "sae_weights.safetensors", {}
    else:
        d = write_manifest(str(tmp_path / "x"), {"post_mlp.1": w}, "jumprelu")
        write_safetensors(os.path.join(d, "post_mlp_1.safetensors"), arrays)
        file, kw = "post_mlp_1.safetensors", {}
    with pytest.raises(SaeFileError, match=rf"{file}: {key}: .*{match}"):
        read_sae_meta(d, **kw)
    with pytest.raises(SaeFileError, match=rf"{file}: {key}: ") as e:
        load_sae(d, **kw)
    assert e.value.key == key and e.value.path.endswith(file)


@pytest.mark.parametrize("fmt", JUMPRELU_FORMATS)
@pytest.mark.parametrize("name", ["b_enc", "W_dec", "threshold"])
def test_non_finite_values_are_refused_on_load(tmp_path, fmt, name):
    w = random_sae(D, F, "jumprelu")
    arrays = tensors_of(w)
    arrays[name] = arrays[name].copy()
    arrays[name].flat[3] = np.nan if name != "W_dec" else np.inf
    if fmt == "gemma_scope":
        d, file, kw = write_gemma_scope(str(tmp_path / "x"), w), "params.npz", {"site": "post_mlp.1"}
        np.savez(os.path.join(d, file), **arrays)
    elif fmt == "sae_lens":
        d, file, kw = write_sae_lens(str(tmp_path / "x"), w), "sae_weights.safetensors", {}
        write_safetensors(_lens_weights(d), arrays)
    else:
        d, file, kw = write_manifest(str(tmp_path / "x"), {"post_mlp.1": w}, "jumprelu"), "post_mlp_1.safetensors", {}
        write_safetensors(os.path.join(d, file), arrays)
    read_sae_meta(d, **kw)  # headers are fine
    with pytest.raises(SaeFileError, match=rf"{file}: {name}: non-finite values \(1 of") as e:
        load_sae(d, **kw)
    assert e.value.key == name and e.value.path.endswith(file)


def test_unsupported_dtypes_are_refused(tmp_path):
    w = random_sae(D, F, "jumprelu")
    d = write_gemma_scope(str(tmp_path / "g"), w, dtype="float64")
    with pytest.raises(SaeFileError, match=r"params\.npz: \w+: unsupported dtype '<f8'"):
        read_sae_meta(d, site="post_mlp.1")
    np.savez(os.path.join(d, "params.npz"), **{**tensors_of(w), "b_dec": np.zeros(D, np.int32)})
    with pytest.raises(SaeFileError, match=r"params\.npz: b_dec: unsupported dtype '<i4'"):
        read_sae_meta(d, site="post_mlp.1")
    s = write_sae_lens(str(tmp_path / "s"), w, dtype="float64")
    with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: \w+: unsupported dtype 'F64'"):
        read_sae_meta(s)


def test_bad_safetensors_headers(tmp_path):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F))
    path = _lens_weights(d)
    with open(path, "wb") as f:
        f.write(b"\x05")
    with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: header: not a safetensors file"):
        read_sae_meta(d)
    with open(path, "wb") as f:
        f.write((4).to_bytes(8, "little") + b"[1,2")
    with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: header: .*bad JSON"):
        read_sae_meta(d)
    header = json.dumps({"W_enc": {"dtype": "F32", "shape": [D, F], "data_offsets": [0, 12]}}).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
    with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: W_enc: data_offsets \[0, 12\] do not fit"):
        read_sae_meta(d)


# --- formats --------------------------------------------------------------------------------------


def test_detect_format_failures(tmp_path):
    with pytest.raises(SaeFileError, match=r"nowhere: format: no such file .*params\.npz.*cfg\.json.*manifest"):
        detect_format(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SaeFileError, match=r"empty: format: not an SAE file or directory"):
        load_sae(str(tmp_path / "empty"))
    d = write_sae_lens(str(tmp_path / "both"), random_sae(D, F))
    write_manifest(d, {"post_mlp.1": random_sae(D, F)}, "relu")
    with pytest.raises(SaeFileError, match=r"both: format: ambiguous.*sae_lens, manifest"):
        detect_format(d)
    assert list(read_sae_meta(d, format="manifest")) == [("post_mlp", 1)]
    assert list(read_sae_meta(d, format="sae_lens")) == [("post_mlp", 3)]


def test_unknown_format_name(tmp_path):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F))
    with pytest.raises(SaeFileError, match=r"s: format: unknown format 'saelens'"):
        read_sae_meta(d, format="saelens")


def test_explicit_format_with_missing_files(tmp_path):
    d = write_sae_lens(str(tmp_path / "s"), random_sae(D, F))
    with pytest.raises(SaeFileError, match=r"params\.npz: file: not found"):
        read_sae_meta(d, format="gemma_scope", site="post_mlp.1")
    with pytest.raises(SaeFileError, match=r"manifest\.json: file: not found"):
        read_sae_meta(d, format="manifest")
    os.remove(_lens_weights(d))
    with pytest.raises(SaeFileError, match=r"sae_weights\.safetensors: file: not found"):
        read_sae_meta(d, format="sae_lens")


def test_a_transcoder_and_a_residual_sae_share_a_site_in_the_catalog_and_in_one_request(tmp_path):
    """The catalog keys sites by kind: a residual SAE at post_attn.2 and layer 2's transcoder both load (so do two
    transcoders of one layer: clamp-only, one pack with a region each; not a transcoder with reconstruct, nor one
    registered at runtime); one request clamps both there, and its config key does not depend on the order it
    names them in."""
    from vllm_steer.core.config import SaeModuleConfig, SteerConfig, SteerConfigError
    from vllm_steer.core.errors import SteeringSpecError
    from vllm_steer.core.sae_catalog import runtime_entry, sae_catalog, site_regions, slot_sites
    from vllm_steer.core.sae_rows import sae_config_key
    from vllm_steer.frontend.sae_spec import parse_sae

    tc = write_sae_lens_transcoder(str(tmp_path / "tc"), random_transcoder(D, F), 2)
    tc2 = write_sae_lens_transcoder(str(tmp_path / "tc2"), random_transcoder(D, F, seed=4), 2)
    res = write_sae_lens(str(tmp_path / "res"), random_sae(D, F), hook_name="blocks.2.hook_resid_mid")
    cfg = lambda **sae: SteerConfig.model_validate({"sae": sae, "sae_slots": {"post_attn.2": 4}})  # noqa: E731
    catalog = sae_catalog(cfg(tc={"path": tc}, res={"path": res, "site": "post_attn.1"}), D, 4)
    assert catalog["tc"].transcoder and list(catalog["tc"].sites) == [("post_attn", 2)]
    catalog = sae_catalog(SteerConfig.model_validate({"sae": {"tc": {"path": tc}, "res": {"path": res}}}), D, 4)
    two = sae_catalog(cfg(tc={"path": tc}, tc2={"path": tc2}), D, 4)  # clamp-only: they share the site's pack
    assert [(r.name, r.offset, r.size) for r in site_regions(two, {})[(("post_attn", 2), True)]] == [
        ("tc", 0, F), ("tc2", F, F)]
    with pytest.raises(SteerConfigError, match=r"steer\.sae\.tc: .*a transcoder clamps only"):
        sae_catalog(cfg(tc={"path": tc, "reconstruct": True}), D, 4)
    with pytest.raises(SteeringSpecError, match="a transcoder cannot be registered at runtime") as e:
        c = cfg(tc={"path": res, "site": "post_attn.1"}).model_copy(update={"sae_root": str(tmp_path)})
        runtime_entry("rt", SaeModuleConfig(path=tc), c, D, 4, slot_sites(c, 4), 1)
    assert e.value.field == "path"
    both = [{"name": "tc", "clamps": [{"feature": 1, "kind": "set", "value": 2.0}]},
            {"name": "res", "clamps": [{"feature": 3, "kind": "add", "value": 1.0}]}]
    pre, dec = parse_sae(both, catalog)
    assert [(e[0], e[1], e[2]) for e in pre] == [("tc", "post_attn", 2), ("res", "post_attn", 2)] and pre == dec
    ids = {n: e.identity for n, e in catalog.items()}
    assert sae_config_key(None, pre, ids) == sae_config_key(None, parse_sae(both[::-1], catalog)[0], ids)
    with pytest.raises(SteeringSpecError, match=r"SAE 'tc' clamps site post_attn\.2 twice in the prefill phase"):
        parse_sae([both[0], both[0]], catalog)
