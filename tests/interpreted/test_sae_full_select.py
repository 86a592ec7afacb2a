"""The full SAE kernels' TopK search and decoder (``kernels/sae_clamp/full_triton.site_edit``, slot A) on their edge
cases, against the plain-torch pack reference, under Triton's interpreter (run in a subprocess by
``tests/test_steered_norm.py``): fewer positive pre-activations than k, k above the search's group count (its lower
bound unusable), k equal to it; a DELTA row's decode reads only the clamped features' W_dec rows; a RECONSTRUCT
row's decode leaves W_dec tiles whose coefficients are all 0 unread; the encoder's unrolled K loop computes what one
K tile a step does, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from tests.sae_packs import full_pack, token_rows

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

D = 48
TOL = dict(rtol=2e-4, atol=1e-3)  # as the op-level full tests: bf16 hi + lo truncated by the interpreter


def _stream(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g) * 3, torch.randn(n, D, generator=g)


def _moved(x, r, index, pack, topk, tuning=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kernel's stream after the site, the reference's, which tokens are on); ``tuning``: a launch variant."""
    from vllm_steer.kernels.sae_clamp.full_triton import DEFAULT, site_edit
    from vllm_steer.kernels.sae_clamp.packed import apply_site_naive

    n = x.shape[0]
    s = x + r
    rows = index[:n].long()
    on = pack[0][rows] != 0
    edit = site_edit(x, r, index, pack, topk, tuning=tuning or DEFAULT)
    return (s + edit)[on], apply_site_naive(s, rows, pack, topk)[on], on


# (d_sae, k, case): "few_positive": 3 features can be positive (the K-th largest relu(pre) is 0); "k_over_groups":
# every pre positive, each group of 4 led by one feature 6 above the rest, k 100 > the 64 groups (the smallest group
# maximum is above the k-th largest: no lower bound); "bounded": 64 groups
# of 64, each with a positive maximum, so the search starts inside [smallest group maximum, maximum]
_CASES = [(200, 8, "few_positive"), (256, 100, "k_over_groups"), (4096, 8, "bounded")]


# the chunked search has no group bounds, so "bounded" (d_sae 4096: 16 s under the interpreter) adds nothing there
_RUNS = [(*c, chunked) for c in _CASES for chunked in (False, True) if not (chunked and c[2] == "bounded")]


@pytest.mark.parametrize("f,k,case,chunked", _RUNS,
                         ids=[f"{c}-{'chunked' if ch else 'in_registers'}" for _, _, c, ch in _RUNS])
def test_topk_search_edge_cases_match_reference(f, k, case, chunked, monkeypatch):
    """``chunked``: d_sae above ``_SELECT_MAX`` (lowered to 64 here), the row read in chunks once per search step."""
    if chunked:
        from vllm_steer.kernels.sae_clamp import full_triton

        monkeypatch.setattr(full_triton, "_SELECT_MAX", 64)
        monkeypatch.setattr(full_triton, "_SELECT_CHUNK", 64)
    pack = full_pack(D, f, 24, seed=11, topk=k)
    if case == "few_positive":
        pack[9] = torch.full((f,), -50.0).index_put((torch.tensor([3, 70, 150]),), torch.tensor(2.0))
    if case == "k_over_groups":
        pack[9] = pack[9] + torch.where(torch.arange(f) % 4 == 0, 8.0, 2.0)
    pack[5] = pack[9][pack[7]]
    x, r = _stream(13, seed=12)
    index = token_rows(13)
    got, want, on = _moved(x, r, index, pack, k)
    assert on.any()
    torch.testing.assert_close(got, want, **TOL)
    from vllm_steer.kernels.sae_clamp.full_triton import arrival_counts
    from vllm_steer.kernels.sae_clamp.packed import _full_features

    assert not arrival_counts(x.device).any()  # the split decoder's last program a tile set its count back to 0

    pre = (x + r) @ pack[8].float() + pack[9]
    if case == "few_positive":  # not vacuous: some of the 3 features are on, fewer than k
        active = (_full_features(x + r, pack, k) > 0).sum(-1)
        assert bool((active > 0).any()) and int(active.max()) < k
    else:  # the groups' maxima are positive (their smallest is a key > 0)
        low = pre.view(13, 64, -1).amax(-1).amin(-1)
        assert bool((low > 0).all())
        if case == "k_over_groups":  # ... and above the k-th largest: the search must not start from it
            assert bool((low > pre.topk(k, dim=-1).values[:, -1]).all())


@pytest.mark.parametrize("k", [0, 8], ids=["jumprelu", "topk8"])
def test_delta_decode_reads_only_the_clamped_rows(k):
    """Every W_dec row but the clampable features' is NaN: a DELTA-only batch still matches the reference (which
    decodes from the float32 copies ``dec``), so no other row was multiplied in."""
    f = 200
    pack = full_pack(D, f, 24, seed=21, topk=k, modes=(0, 1, 0, 1, 1, 1))
    others = torch.ones(f, dtype=torch.bool)
    others[pack[7]] = False
    pack[11] = pack[11].masked_fill(others[:, None], float("nan"))
    x, r = _stream(9, seed=22)
    got, want, on = _moved(x, r, token_rows(9), pack, k)
    assert on.sum() >= 5 and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, **TOL)


def test_reconstruct_leaves_zero_coefficient_tiles_unread():
    """One RECONSTRUCT token, TopK 4 over 1024 features (4 clampable): the 64-feature W_dec tiles holding none of its
    active or clamped features are NaN and the edit is still the reference's (computed with the clean W_dec)."""
    from vllm_steer.kernels.sae_clamp.packed import _full_features

    f, k = 1024, 4
    pack = full_pack(D, f, 4, seed=31, topk=k, modes=(0, 2))
    x, r = _stream(1, seed=32)
    index = torch.ones(6, dtype=torch.int32)
    want = _moved(x, r, index, pack, k)[1]
    live = _full_features(x + r, pack, k)[0] != 0
    live[pack[7]] = True  # clamped features' coefficients may be set from 0
    dead = ~live.view(-1, 64).any(-1)
    assert 0 < int(dead.sum()) < f // 64
    pack[11] = pack[11].view(-1, 64, D).masked_fill(dead[:, None, None], float("nan")).view(f, D)
    got = _moved(x, r, index, pack, k)[0]
    torch.testing.assert_close(got, want, **TOL)


def test_encoder_unroll_keeps_the_arithmetic(monkeypatch):
    """Two K tiles a loop step (small grids) against one: the same edit bit for bit (D 200: the last step's second
    tile past D)."""
    from vllm_steer.kernels.sae_clamp import full_triton

    pack = full_pack(200, 200, 24, seed=41, topk=8)
    g = torch.Generator().manual_seed(42)
    x, r = torch.randn(7, 200, generator=g) * 3, torch.randn(7, 200, generator=g)
    index = token_rows(7)
    two = full_triton.site_edit(x, r, index, pack, 8)
    monkeypatch.setattr(full_triton, "_ENC_UNROLL", 1)
    one = full_triton.site_edit(x, r, index, pack, 8)
    on = pack[0][index[:7].long()] != 0
    assert on.any() and torch.equal(two[on], one[on])
