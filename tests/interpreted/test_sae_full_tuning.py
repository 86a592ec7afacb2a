"""The full SAE kernels' launch variants (``kernels/sae_clamp/full_triton.Tuning``: tiles, K split, stages, the
stream's hi / lo planes, ``_select``'s warps), which ``bench/sae_kernel_bench.py --topk-sweep`` times on a GPU,
against the plain-torch pack reference under Triton's interpreter (run in a subprocess by
``tests/test_steered_norm.py``; ``tests/test_kernels_compile.py`` compiles each for sm_90)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.interpreted.test_sae_full_select import TOL, _moved
from tests.sae_packs import full_pack, token_rows

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

D, F, N = 200, 1024, 13  # D 200: the K loop's last tile (and a split's) past D; F 1024: the search's 64 groups


def _tuning(**kw):
    from vllm_steer.kernels.sae_clamp.full_triton import Tuning

    return Tuning(**kw)


def _stream(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g) * 3, torch.randn(n, D, generator=g)


# (id, Tuning keywords): D 200 with 32-deep K tiles and no unroll splits K in 96 + 96 + 8
_VARIANTS = [
    ("bf32", dict(block_f=32)),
    ("bk128", dict(block_k=128, unroll=1)),
    ("stages2_warps1", dict(stages=2, warps=1)),
    ("split2", dict(split_k=2)),
    ("split3", dict(split_k=3, block_k=32, unroll=1)),
    ("hilo_split2", dict(hilo=True, split_k=2)),
    ("select_warps16", dict(select_warps=16)),
]


@pytest.mark.parametrize("name,kw", _VARIANTS, ids=[v[0] for v in _VARIANTS])
def test_encoder_variant_matches_reference(name, kw):
    """TopK k 8 (DELTA and RECONSTRUCT rows): the variant's stream after the site is the reference's."""
    pack = full_pack(D, F, 24, seed=51, topk=8)
    x, r = _stream(N, seed=52)
    got, want, on = _moved(x, r, token_rows(N), pack, 8, _tuning(**kw))
    assert on.sum() >= 6
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kw", [dict(split_k=2), dict(split_k=3, block_k=32, unroll=1)], ids=["split2", "split3"])
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


@pytest.mark.parametrize("kw,slot", [(dict(hilo=True), "a"), (dict(hilo=True, unroll=1), "b")],
                         ids=["hilo-a", "hilo_unroll1-b"])
def test_hilo_keeps_the_arithmetic(kw, slot):
    """The stream split into hi / lo planes once (``_hilo``): the same products in the same order as the default, so
    the same edit bit for bit; at slot A (x + residual read by token id) and slot B (the gathered stream after slot
    A's vectors)."""
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
