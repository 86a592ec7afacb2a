"""The full SAE kernels' launch variants (``kernels/sae_clamp/full_triton.Tuning``: the encoder's tiles, K split,
pipelining and W_enc layout; the TopK search by radix digits), which ``bench/sae_kernel_bench.py --topk-sweep`` times
on a GPU, against the plain-torch pack reference under Triton's interpreter (run in a subprocess by
``tests/test_steered_norm.py``; ``tests/test_kernels_compile.py`` compiles each for sm_90). The radix search must
find the bitwise search's threshold: the same edit bit for bit, ties and fewer positive keys than k included."""

from __future__ import annotations

import os

import pytest
import torch

from tests.interpreted.test_sae_full_select import _CASES, TOL, _moved
from tests.sae_packs import full_pack, token_rows

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

D, F, N = 200, 1024, 13  # D 200: the K loop's last tile (and a split's) past D; F 1024: the search's 64 groups


def _tuning(**kw):
    from vllm_steer.kernels.sae_clamp.full_triton import Tuning

    return Tuning(**kw)


def _k_contiguous(pack: list[torch.Tensor]) -> list[torch.Tensor]:
    """The pack with W_enc a [D, F] view of a [F, D] copy (the W_T read)."""
    return pack[:8] + [pack[8].T.contiguous().T] + pack[9:]


def _stream(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g) * 3, torch.randn(n, D, generator=g)


# (id, Tuning keywords, W_enc read along K): D 200 with 32-deep K tiles and no unroll splits K in 96 + 96 + 8
_VARIANTS = [
    ("bf32", dict(block_f=32), False),
    ("bk128", dict(block_k=128, unroll=1), False),
    ("loop_stages3", dict(loop_stages=3, stages=2), False),
    ("split2", dict(split_k=2), False),
    ("split3", dict(split_k=3, block_k=32, unroll=1), False),
    ("split3_atomic", dict(split_k=3, block_k=32, unroll=1, atomic=True), False),
    ("wt", {}, True),
    ("wt_bf32_bk128", dict(block_f=32, block_k=128, unroll=1), True),
    ("split2_radix8", dict(split_k=2, radix=8), False),
    ("prefetch_split3", dict(prefetch=True, unroll=1, split_k=3, block_k=32), False),
]


@pytest.mark.parametrize("name,kw,wt", _VARIANTS, ids=[v[0] for v in _VARIANTS])
def test_encoder_variant_matches_reference(name, kw, wt):
    """TopK k 8 (DELTA and RECONSTRUCT rows): the variant's stream after the site is the reference's."""
    pack = full_pack(D, F, 24, seed=51, topk=8)
    x, r = _stream(N, seed=52)
    got, want, on = _moved(x, r, token_rows(N), _k_contiguous(pack) if wt else pack, 8, _tuning(**kw))
    assert on.sum() >= 6
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kw", [dict(split_k=2), dict(split_k=3, block_k=32, unroll=1, atomic=True)],
                         ids=["split2", "split3_atomic"])
def test_split_encoder_keeps_the_bias_and_thresholds(kw):
    """JumpReLU (thresholds, RECONSTRUCT rows over pre): the split partials and b_enc summed once."""
    pack = full_pack(D, 1000, 24, seed=53, topk=0)
    x, r = _stream(N, seed=54)
    got, want, on = _moved(x, r, token_rows(N), pack, 0, _tuning(**kw))
    assert on.sum() >= 6
    torch.testing.assert_close(got, want, **TOL)


def test_split_sum_in_the_chunked_select(monkeypatch):
    """d_sae past ``_SELECT_MAX`` (here lowered to 1024: chunks of 1024): ``_select`` sums the split partials chunk by
    chunk before its search re-reads pre."""
    from vllm_steer.kernels.sae_clamp import full_triton

    monkeypatch.setattr(full_triton, "_SELECT_MAX", 1024)
    monkeypatch.setattr(full_triton, "_SELECT_CHUNK", 1024)
    pack = full_pack(D, 3000, 24, seed=55, topk=8)
    x, r = _stream(N, seed=56)
    got, want, on = _moved(x, r, token_rows(N), pack, 8, _tuning(split_k=2))
    assert on.sum() >= 6
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("bits", [8])
@pytest.mark.parametrize("f,k,case", _CASES + [(4096, 64, "ties")], ids=[c for *_, c in _CASES] + ["ties"])
def test_radix_search_finds_the_bitwise_threshold(f, k, case, bits):
    """The radix search against the bitwise one on the search's edge cases (fewer positive keys than k; k above the
    group count; bounded), and ``ties``: 100 features share one pre (their W_enc columns 0, one bias) across the
    k-th largest, kept whole by both (torch.topk would keep exactly k): the same edit bit for bit."""
    from vllm_steer.kernels.sae_clamp.full_triton import site_edit

    pack = full_pack(D, f, 24, seed=11, topk=k)
    if case == "few_positive":
        pack[9] = torch.full((f,), -50.0).index_put((torch.tensor([3, 70, 150]),), torch.tensor(2.0))
    if case == "k_over_groups":
        pack[9] = pack[9] + torch.where(torch.arange(f) % 4 == 0, 8.0, 2.0)
    x, r = _stream(N, seed=12)
    if case == "ties":  # the tied pre: token 0's 40th largest of the others, so its k-th largest is tied 100 times
        tied = torch.arange(f)[5::40][:100]
        pack[8] = pack[8].clone().index_fill(1, tied, 0.0)
        pre = (x + r) @ pack[8].float() + pack[9]
        v = float(pre[0].index_fill(0, tied, -1e9).topk(40).values[-1])
        pack[9] = pack[9].clone().index_fill(0, tied, v)
        pre = (x + r) @ pack[8].float() + pack[9]
        assert float(pre[0].topk(k).values[-1]) == v and int((pre[0] > v).sum()) < k - 1
    pack[3], pack[5] = pack[8][:, pack[7]].T.float().contiguous(), pack[9][pack[7]]
    index = token_rows(N)
    on = pack[0][index[:N].long()] != 0
    want = site_edit(x, r, index, pack, k)
    got = site_edit(x, r, index, pack, k, tuning=_tuning(radix=bits))
    assert on.any() and torch.equal(got[on], want[on])


@pytest.mark.parametrize("kw,slot", [(dict(hilo=True), "a"), (dict(hilo=True, unroll=1), "b"),
                                     (dict(prefetch=True, unroll=1), "a"), (dict(prefetch=True, unroll=1), "b")],
                         ids=["hilo-a", "hilo_unroll1-b", "prefetch-a", "prefetch-b"])
def test_encoder_stream_variants_keep_the_arithmetic(kw, slot):
    """The stream split into hi / lo planes once (``_hilo``) or prefetched a tile ahead: the same products in the same
    order as the default, so the same edit bit for bit; at slot A (x + residual read by token id) and slot B (the
    gathered stream after slot A's vectors)."""
    from vllm_steer.kernels.sae_clamp.full_triton import site_edit

    pack = full_pack(D, 1000, 24, seed=57, topk=8)
    x, r = _stream(N, seed=58)
    index = token_rows(N)
    prefix = None
    if slot == "b":
        table = torch.randn(6, D, generator=torch.Generator().manual_seed(59))
        prefix = {"vec": (table, torch.ones(6, dtype=torch.int32), table.stride(0))}
    want = site_edit(x, r, index, pack, 8, prefix)
    got = site_edit(x, r, index, pack, 8, prefix, tuning=_tuning(**kw))
    on = pack[0][index[:N].long()] != 0
    assert on.any() and torch.equal(got[on], want[on])
