"""The SAE clamping reference (kernels/sae_clamp/naive.py) against the README's formulas written
directly in numpy (float64), for each activation, both modes and every clamp kind."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_steer.kernels.sae_clamp.naive import (
    ADD, DELTA, JUMPRELU, NONE, OFF, RECONSTRUCT, RELU, SCALE, SET, TOPK, Sae, encode, sae_clamp_naive,
)

D, F, K = 24, 40, 6


def _sae(activation: int, b_dec_in: bool, dtype=torch.float32) -> Sae:
    g = torch.Generator().manual_seed(activation * 2 + b_dec_in)
    w_enc = (torch.randn(D, F, generator=g) * 0.4).to(dtype)
    return Sae(w_enc=w_enc, b_enc=(torch.randn(F, generator=g) * 0.2).to(dtype),
               w_dec=(torch.randn(F, D, generator=g) * 0.3).to(dtype), b_dec=(torch.randn(D, generator=g) * 0.1).to(dtype),
               activation=activation, threshold=(torch.rand(F, generator=g) * 0.5).to(dtype), k=K, b_dec_in=b_dec_in)


def _numpy_features(sae: Sae, x: np.ndarray) -> np.ndarray:
    w_enc, b_enc = sae.w_enc.double().numpy(), sae.b_enc.double().numpy()
    b_dec = sae.b_dec.double().numpy()
    pre = (x - b_dec * sae.b_dec_in) @ w_enc + b_enc
    if sae.activation == RELU:
        return np.maximum(pre, 0)
    if sae.activation == JUMPRELU:
        return np.where(pre > sae.threshold.double().numpy(), pre, 0.0)
    out = np.zeros_like(pre)
    for t in range(pre.shape[0]):
        top = np.argsort(-pre[t])[:K]
        out[t, top] = np.maximum(pre[t, top], 0)
    return out


def _numpy_clamp(f, kind, value, only):
    new = f.copy()
    for i in range(f.shape[0]):
        if kind[i] == NONE or (only[i] and f[i] <= 0):
            continue
        new[i] = {SET: value[i], ADD: f[i] + value[i], SCALE: f[i] * value[i]}[kind[i]]
    return new


def _tables(rows: int, seed: int):
    g = np.random.default_rng(seed)
    kind = g.integers(0, 4, size=(rows, F)).astype(np.int8)
    kind[:, F // 2:] = NONE  # a sparse clamp set
    value = g.normal(0, 2, size=(rows, F)).astype(np.float32)
    only = g.integers(0, 2, size=(rows, F)).astype(np.int8)
    kind[0], mode = NONE, np.array([OFF, DELTA, RECONSTRUCT, DELTA, OFF], dtype=np.int8)[:rows]
    return mode, kind, value, only


@pytest.mark.parametrize("activation", [RELU, JUMPRELU, TOPK], ids=["relu", "jumprelu", "topk"])
@pytest.mark.parametrize("b_dec_in", [False, True], ids=["gemma-scope", "b_dec-in"])
def test_reference_equals_the_formulas(activation, b_dec_in):
    sae = _sae(activation, b_dec_in)
    mode, kind, value, only = _tables(5, activation)
    g = np.random.default_rng(7)
    x = g.normal(0, 1, size=(11, D)).astype(np.float32)
    index = np.array([0, 1, 2, 3, 4, 1, 2, 0, 3, 1, 2, 9], dtype=np.int32)  # one spare entry past N
    got = sae_clamp_naive(torch.from_numpy(x), torch.from_numpy(index), sae, torch.from_numpy(mode),
                          torch.from_numpy(kind), torch.from_numpy(value), torch.from_numpy(only)).numpy()
    f = _numpy_features(sae, x.astype(np.float64))
    w_dec, b_dec = sae.w_dec.double().numpy(), sae.b_dec.double().numpy()
    for t in range(x.shape[0]):
        r = index[t]
        if mode[r] == OFF:
            assert np.array_equal(got[t], x[t]), t  # untouched, bit for bit
            continue
        fn = _numpy_clamp(f[t], kind[r], value[r].astype(np.float64), only[r])
        want = x[t] + (fn - f[t]) @ w_dec if mode[r] == DELTA else fn @ w_dec + b_dec
        np.testing.assert_allclose(got[t], want, rtol=1e-4, atol=1e-4, err_msg=f"token {t}")
    assert (kind[index[:11]] != NONE).any() and (mode[index[:11]] != OFF).any()  # the case is not vacuous


def test_clamping_a_feature_to_its_own_value_is_a_no_op_and_reconstruct_without_clamps_decodes():
    sae = _sae(JUMPRELU, False)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(3))
    f = encode(sae, x)
    index = torch.arange(6, dtype=torch.int32)
    kind = torch.full((6, F), SET, dtype=torch.int8)
    only = torch.zeros(6, F, dtype=torch.int8)
    delta = torch.full((6,), DELTA, dtype=torch.int8)
    same = sae_clamp_naive(x, index, sae, delta, kind, f, only)
    torch.testing.assert_close(same, x, rtol=0, atol=1e-5)
    none = torch.zeros(6, F, dtype=torch.int8)
    recon = sae_clamp_naive(x, index, sae, torch.full((6,), RECONSTRUCT, dtype=torch.int8), none, f, only)
    torch.testing.assert_close(recon, f @ sae.w_dec + sae.b_dec, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(recon, x, atol=1e-2)  # lossy: the reconstruction is not the stream


def test_bf16_weights_accumulate_in_float32_and_only_if_active_gates():
    sae = _sae(RELU, False, dtype=torch.bfloat16)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    f = encode(sae, x)
    assert f.dtype == torch.float32
    inactive = int((f[0] <= 0).nonzero()[0])
    kind = torch.zeros(1 + 1, F, dtype=torch.int8)
    kind[1, inactive] = SET
    value = torch.zeros(2, F)
    value[1, inactive] = 50.0
    only = torch.zeros(2, F, dtype=torch.int8)
    mode = torch.tensor([OFF, DELTA], dtype=torch.int8)
    index = torch.tensor([1, 1, 1, 1], dtype=torch.int32)
    moved = sae_clamp_naive(x, index, sae, mode, kind, value, only)
    only[1, inactive] = 1
    gated = sae_clamp_naive(x, index, sae, mode, kind, value, only)
    assert moved.dtype == torch.bfloat16 and not torch.equal(moved[0], x[0])
    assert torch.equal(gated[0], x[0].float().to(torch.bfloat16))  # the feature was off: nothing to clamp


@pytest.mark.parametrize("activation,full", [(RELU, False), (RELU, True), (JUMPRELU, False), (JUMPRELU, True),
                                             (TOPK, True)],  # TopK always stages the whole SAE: ranking needs it
                         ids=["relu-clamp-set", "relu-whole", "jumprelu-clamp-set", "jumprelu-whole", "topk-whole"])
def test_the_engine_pack_equals_the_reference(activation, full):
    """The worker's layout (a subset of clampable features staged, b_dec folded into the bias, rows
    written from the wire form) gives the reference's stream for each row's mode."""
    from vllm_steer.core.config import SaeModuleConfig
    from vllm_steer.core.sae_catalog import SaeEntry
    from vllm_steer.core.sae_files import SaeMeta, SaeWeights
    from vllm_steer.core.sae_paths import runtime_access
    from vllm_steer.core.sae_rows import ONLY_IF_ACTIVE, wire_entry
    from vllm_steer.kernels.sae_clamp.packed import apply_site_naive
    from vllm_steer.runtime.sae_tables import SaeTables, _pack

    sae = _sae(activation, b_dec_in=True)
    if full:  # the engine stages a full pack's weights in bfloat16: the reference with the same weights
        sae = dataclasses.replace(sae, w_enc=sae.w_enc.bfloat16().float(), w_dec=sae.w_dec.bfloat16().float())
    mode, kind, value, only = _tables(5, activation)
    clampable = sorted(set(np.nonzero(kind.any(axis=0))[0].tolist()) | {F - 1})
    name = {RELU: "relu", JUMPRELU: "jumprelu", TOPK: "topk"}[activation]
    meta = SaeMeta(d_model=D, d_sae=F, activation=name, k=K if activation == TOPK else 0, dtype="float32",
                   b_dec_in=True)
    w = SaeWeights(meta, sae.w_enc.numpy(), sae.b_enc.numpy(), sae.w_dec.numpy(), sae.b_dec.numpy(),
                   sae.threshold.numpy() if activation == JUMPRELU else None)
    entry = SaeEntry("s", SaeModuleConfig(path="unused", reconstruct=full), {("post_mlp", 1): meta},
                     tuple(clampable), {f: i for i, f in enumerate(clampable)}, "id")
    tables = SaeTables({}, {}, set(), 5, 16, torch.device("cpu"), runtime_access(None, 1))
    tables.packs[("post_mlp", 1)] = _pack(w, entry, 5, torch.device("cpu"))
    for r in range(1, 5):
        feats = np.nonzero(kind[r])[0]
        codes = kind[r, feats].astype(np.int32) | (only[r, feats].astype(np.int32) * ONLY_IF_ACTIVE)
        m = int(mode[r]) if full or mode[r] != RECONSTRUCT else DELTA
        mode[r] = m
        slots = np.asarray([entry.slot_of[f] for f in feats], dtype=np.int32)
        written = tables.write_row(r, [wire_entry("s", "post_mlp", 1, m, slots, codes, value[r, feats])] if m else [])
        # the metrics' upload bytes: the site's code and value rows (int32 + float32) and its mode word
        assert written == ((2 * tables.packs[("post_mlp", 1)][1].shape[1] + 1) * 4 if m else 0)
    cleared = tables.write_row(4, [])  # a row that held clamps: only its mode word is written
    assert cleared == (4 if mode[4] else 0)
    tables.write_row(4, [wire_entry("s", "post_mlp", 1, int(mode[4]), slots, codes, value[4, feats])] if mode[4] else [])
    x = torch.from_numpy(np.random.default_rng(9).normal(0, 1, size=(11, D)).astype(np.float32))
    index = torch.tensor([0, 1, 2, 3, 4, 1, 2, 0, 3, 1, 2], dtype=torch.int32)
    want = sae_clamp_naive(x, index, sae, torch.from_numpy(mode), torch.from_numpy(kind), torch.from_numpy(value),
                           torch.from_numpy(only))
    got = apply_site_naive(x, index.long(), tables.packs[("post_mlp", 1)], meta.k)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    off = (torch.from_numpy(mode)[index.long()] == OFF)
    assert torch.equal(got[off], x[off]) and bool((~off).any())


def test_transcoder_reference_and_its_engine_pack_edit_the_mlp_output_by_the_formula(tmp_path):
    """A transcoder's edit of the MLP output, ``(f' - f) @ W_dec`` with f from the MLP's input (the reference,
    ``transcoder_clamp_naive``), against numpy; then the worker's tables: a transcoder and a residual SAE at one site
    (post_attn.1) keep their own packs, one row writes both, the transcoder's pack gives the reference's delta and a
    row rewritten without it is OFF there."""
    from vllm_steer.core.config import SaeModuleConfig
    from vllm_steer.core.sae_catalog import SaeEntry
    from vllm_steer.core.sae_files import read_sae_meta
    from vllm_steer.core.sae_paths import runtime_access
    from vllm_steer.core.sae_rows import ONLY_IF_ACTIVE, wire_entry
    from vllm_steer.kernels.sae_clamp.naive import transcoder_clamp_naive
    from vllm_steer.kernels.sae_clamp.packed import clamp_delta_naive
    from vllm_steer.runtime.sae_tables import SaeTables
    from tests.sae_writers import random_sae, random_transcoder, write_sae_lens, write_sae_lens_transcoder

    w = random_transcoder(D, F, "jumprelu", seed=4)
    tc = Sae(*(torch.from_numpy(a) for a in (w.w_enc, w.b_enc, w.w_dec, w.b_dec)), JUMPRELU,
             torch.from_numpy(w.threshold))
    mode, kind, value, only = _tables(5, 11)
    mode[2] = DELTA  # a transcoder does not reconstruct
    x = np.random.default_rng(12).normal(0, 2, size=(11, D)).astype(np.float32)
    index = np.array([0, 1, 2, 3, 4, 1, 2, 0, 3, 1, 2], dtype=np.int32)
    got = transcoder_clamp_naive(torch.from_numpy(x), torch.from_numpy(index), tc, *(torch.from_numpy(a) for a in
                                                                                       (mode, kind, value, only)))
    pre = x.astype(np.float64) @ w.w_enc + w.b_enc
    f = np.maximum(pre, 0) * (pre > w.threshold)
    for t, r in enumerate(index):
        f_new = f[t].copy()
        for i in np.nonzero(kind[r])[0]:
            if only[r, i] and f[t, i] <= 0:
                continue
            f_new[i] = {SET: value[r, i], ADD: f[t, i] + value[r, i], SCALE: f[t, i] * value[r, i]}[int(kind[r, i])]
        want = (f_new - f[t]) @ w.w_dec if mode[r] != OFF else np.zeros(D)
        np.testing.assert_allclose(got[t].numpy(), want, rtol=1e-4, atol=1e-4)
    # the worker's tables
    site = ("post_attn", 1)
    tc_dir = write_sae_lens_transcoder(str(tmp_path / "tc"), w, 1)
    sae_dir = write_sae_lens(str(tmp_path / "sae"), random_sae(D, F, seed=5), hook_name="blocks.1.hook_resid_mid")
    entries = {name: SaeEntry(name, SaeModuleConfig(path=p), read_sae_meta(p), tuple(range(F)),
                              {i: i for i in range(F)}, name) for name, p in (("t", tc_dir), ("s", sae_dir))}
    assert entries["t"].transcoder and not entries["s"].transcoder
    tables = SaeTables(entries, {}, {site}, 5, D, torch.device("cpu"), runtime_access(None, 1))
    assert set(tables.packs) == set(tables.tc_packs) == {site}
    for r in range(1, 5):
        feats = np.nonzero(kind[r])[0].astype(np.int32)
        codes = kind[r, feats].astype(np.int32) | (only[r, feats].astype(np.int32) * ONLY_IF_ACTIVE)
        rows = [wire_entry("t", *site, int(mode[r]), feats, codes, value[r, feats])] if mode[r] else []
        tables.write_row(r, rows + [wire_entry("s", *site, DELTA, feats[:1], codes[:1], value[r, feats[:1]])])
    delta = clamp_delta_naive(torch.from_numpy(x), torch.from_numpy(index).long(), tables.tc_packs[site])
    torch.testing.assert_close(delta, got, rtol=1e-4, atol=1e-4)
    assert tables.packs[site][0][1:].tolist() == [DELTA] * 4  # the residual SAE's rows are its own
    tables.write_row(1, [])
    assert int(tables.tc_packs[site][0][1]) == OFF and int(tables.packs[site][0][1]) == OFF


def _gain_free_tables(tmp_path, hook_name: str, gain: np.ndarray):
    """A JumpReLU transcoder of layer 1 named by ``hook_name``, staged at start-up by the worker's tables with the
    pre-MLP norm's ``gain``: (weights as written, tables, the site)."""
    from vllm_steer.core.config import SaeModuleConfig
    from vllm_steer.core.sae_catalog import SaeEntry
    from vllm_steer.core.sae_files import read_sae_meta
    from vllm_steer.core.sae_paths import runtime_access
    from vllm_steer.runtime.sae_tables import SaeTables
    from tests.sae_writers import random_transcoder, write_sae_lens_transcoder

    site = ("post_attn", 1)
    w = random_transcoder(D, F, "jumprelu", seed=6)
    path = write_sae_lens_transcoder(str(tmp_path / "tc"), w, 1, hook_name=hook_name)
    entry = SaeEntry("gs", SaeModuleConfig(path=path), read_sae_meta(path), tuple(range(F)),
                     {i: i for i in range(F)}, "gs")
    gains = {site: gain}.get
    return w, SaeTables({"gs": entry}, {}, {site}, 5, D, torch.device("cpu"), runtime_access(None, 1), gains), site


def test_a_transcoder_of_ln2_hook_normalized_is_staged_with_the_norm_gain_folded_into_w_enc(tmp_path):
    """TransformerLens' ``ln2.hook_normalized`` is the pre-MLP norm's output before its gain g: the staged W_enc is
    diag(1/g) W_enc (float32), so the pack's edit of the norm's output y is the reference's edit encoded from y / g
    with the file's weights; ``mlp.hook_in`` (the MLP's input, gain included) is staged as written."""
    from vllm_steer.core.sae_rows import wire_entry
    from vllm_steer.kernels.sae_clamp.naive import transcoder_clamp_naive
    from vllm_steer.kernels.sae_clamp.packed import clamp_delta_naive

    gain = np.random.default_rng(13).normal(1.0, 0.5, size=D).astype(np.float32)
    w, tables, site = _gain_free_tables(tmp_path, "blocks.1.ln2.hook_normalized", gain)
    assert tables.tc_packs[site][3].numpy().T.tolist() == (w.w_enc / gain[:, None]).tolist()
    np.testing.assert_array_equal(tables.tc_packs[site][5].numpy(), w.b_enc)
    mode, kind, value, only = _tables(5, 14)
    mode[2] = DELTA
    for r in range(1, 5):
        feats = np.nonzero(kind[r])[0].astype(np.int32)
        tables.write_row(r, [wire_entry("gs", *site, int(mode[r]), feats, kind[r, feats].astype(np.int32),
                                        value[r, feats])] if mode[r] else [])
    u = np.random.default_rng(15).normal(0, 1, size=(9, D)).astype(np.float32)  # what Gemma Scope encodes
    y = u * gain  # the norm's output, what the kernels read
    index = torch.tensor([0, 1, 2, 3, 4, 1, 2, 3, 4])
    tc = Sae(*(torch.from_numpy(a) for a in (w.w_enc, w.b_enc, w.w_dec, w.b_dec)), JUMPRELU,
             torch.from_numpy(w.threshold))
    want = transcoder_clamp_naive(torch.from_numpy(u), index.int(), tc, *(torch.from_numpy(a) for a in
                                                                          (mode, kind, value, np.zeros_like(only))))
    got = clamp_delta_naive(torch.from_numpy(y), index, tables.tc_packs[site])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert want.abs().max() > 0.1
    w, tables, site = _gain_free_tables(tmp_path / "in", "blocks.1.mlp.hook_in", gain)
    assert tables.tc_packs[site][3].numpy().T.tolist() == w.w_enc.tolist()


def test_a_gain_free_transcoder_over_a_near_zero_gain_is_refused_naming_it_and_its_hook(tmp_path):
    """|g| < 1e-6 anywhere (or no norm gain at the site): the worker refuses the SAE, naming it and its site, rather
    than divide by ~0."""
    from vllm_steer.core.sae_files import SaeFileError

    gain = np.ones(D, dtype=np.float32)
    gain[5] = 4e-7
    with pytest.raises(SaeFileError, match=r"/tc: input: SAE 'gs' at post_attn\.1 reads the norm's "
                                           r"output without its gain; the norm's gain is 4e-07 at dimension 5"):
        _gain_free_tables(tmp_path, "blocks.1.ln2.hook_normalized", gain)
    with pytest.raises(SaeFileError, match=r"SAE 'gs' at post_attn\.1 .* no norm with a gain"):
        _gain_free_tables(tmp_path / "none", "blocks.1.ln2.hook_normalized", None)
