"""The clamp-only SAE path at prefill sizes (``kernels/sae_clamp/tiled_triton.py``: the clamps over token tiles before
the norm, which adds their edit) against the reference, under Triton's interpreter (see test_triton_kernels.py).

Every step mixes what a prefill step holds: decode tokens of several rows (one token each), two prompts of different
rows whose tiles are cut at multiples of T (the first prompt starts off a multiple), an unsteered prompt (row 0),
tokens of an OFF row and of a row without codes (both bit for bit the kernel without SAE), and a row clamping its
last slots only."""

from __future__ import annotations

import os

import pytest
import torch

from tests.interpreted.test_triton_kernels import _INTERPRETER_INDEX, _SAE_TOL, _vecs
from tests.sae_packs import IDLE_ROWS, clamp_pack, prefill_rows
from tests.test_steered_norm import _case
from vllm_steer.kernels.steered_rms_norm.naive import SAE_GATED, VECTORS_UNGATED, steered_norm_naive

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

N, D = 100, 80  # past the split walk's 64 tokens (the tiled path's threshold); D not a multiple of the 64-column steps
# (prefill_rows(100): the 37-token prompt of row 1 from token 6 is cut at tokens 16 and 32 by tiles of 16)


@pytest.fixture()
def norm(monkeypatch):
    import vllm_steer.kernels.steered_rms_norm.triton as kernel

    monkeypatch.setattr(kernel, "TILED", True)  # off by default until the GPU tests pass
    return kernel


def _check_idle_and_moved(got, plain, index):
    rows = index[:N].long()
    idle = torch.isin(rows, torch.tensor(IDLE_ROWS))
    assert torch.equal(got[0][idle], plain[0][idle]) and torch.equal(got[1][idle], plain[1][idle])
    assert not torch.allclose(got[1][~idle].float(), plain[1][~idle].float(), rtol=1e-2, atol=1e-2)


# 200 clamps of two slots: residuals up to ~170, float32 sums of 200 deltas ~10 in three orders. Against a float64
# reference (max abs): the tiled path 5.0e-5, the serial walk 7.4e-5, the float32 reference 6.6e-5.
_TOL_C200 = dict(rtol=1e-5, atol=1e-4)
_CASES = [("a", 1, "T16"), ("a", 64, "T16"), ("b", 64, "T16"), ("b", 200, "T16"), ("ab", 200, "T16"),
          ("ab", 64, "T32")]


@_INTERPRETER_INDEX
@pytest.mark.parametrize("sae,c,tile", _CASES, ids=[f"sae_{s}-C{c}-{t}" for s, c, t in _CASES])
def test_tiled_clamps_match_reference(norm, monkeypatch, sae, c, tile):
    """Slot A (JumpReLU), slot B (ReLU, encoded after slot A's clamps and vectors) or both, 1 / 64 (one full block of
    ids) / 200 clamped slots (four blocks, the last partial); tiles of 16 tokens, or 32 (the 37-token prompt from
    token 6 in tiles of 26 and 11)."""
    from vllm_steer.kernels.sae_clamp import tiled_triton

    if tile == "T32":
        monkeypatch.setattr(tiled_triton, "tile_tokens", lambda n: 32)
    x, r, (ta, tb), _ = _case(N, D, torch.float32, seed=200 + c)
    index = prefill_rows(N)
    w = torch.randn(D, generator=torch.Generator().manual_seed(201)) * 0.5
    pa = clamp_pack(D, c, seed=210 + c, jumprelu=True) if "a" in sae else []
    pb = clamp_pack(D, c, seed=220 + c, jumprelu=False) if "b" in sae else []
    vec = _vecs("ab", ta, tb)
    assert norm.tiled_of(N)
    got = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb)
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb)
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **(_TOL_C200 if c == 200 else _SAE_TOL[torch.float32]))
    _check_idle_and_moved(got, norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **vec), index)


@_INTERPRETER_INDEX
def test_tiled_clamps_bf16_without_residual(norm):
    """A bf16 model's stream, and a norm called without a residual (x alone is the stream)."""
    x, _, (ta, tb), _ = _case(N, D, torch.bfloat16, seed=230)
    index = prefill_rows(N)
    w = (torch.randn(D, generator=torch.Generator().manual_seed(231)) * 0.5).to(torch.bfloat16)
    pa, pb = clamp_pack(D, 37, seed=232, jumprelu=True), clamp_pack(D, 37, seed=233)
    vec = _vecs("a", ta, tb)
    got = norm.steered_norm_triton(x, None, w, 1e-5, 1.0, index, **vec, sae_a=pa, sae_b=pb)
    want = steered_norm_naive(x, None, w, 1e-5, 1.0, index, **vec, sae_a=pa, sae_b=pb)
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_SAE_TOL[torch.bfloat16])
    _check_idle_and_moved(got, norm.steered_norm_triton(x, None, w, 1e-5, 1.0, index, **vec), index)


@_INTERPRETER_INDEX
@pytest.mark.parametrize("variant", ["ab-proj", "b-alone"])
def test_tiled_clamps_with_conditions_and_projections(norm, variant):
    """An SAE norm of a server with conditions (and projections): per row the gate (read from the buffer) scales its
    clamps, its vectors, both or neither; slot B's stream has slot A's gated edit, projections and vectors (b-alone:
    nothing before slot B, its clamps encode x + residual); the gate buffer is only read."""
    from tests.interpreted.test_triton_kernels import _projections

    x, r, (ta, tb), _ = _case(N, D, torch.float32, seed=240)
    index = prefill_rows(N)
    w = torch.randn(D, generator=torch.Generator().manual_seed(241)) * 0.5
    pa, pb = clamp_pack(D, 37, seed=242, jumprelu=True), clamp_pack(D, 37, seed=243)
    cond_site = torch.tensor([-1, 5 | SAE_GATED, -1, 5 | SAE_GATED | VECTORS_UNGATED, 5, 5 | SAE_GATED],
                             dtype=torch.int32)
    params = torch.tensor([[0.0, 1.0, 0.0, 1.0]] + [[0.1, 2.0, 0.0, 0.0]] * 5, dtype=torch.float32)
    probe = torch.randn(6, D, generator=torch.Generator().manual_seed(244))
    gate0 = torch.rand(N + 5, generator=torch.Generator().manual_seed(245)) * 0.8 + 0.1
    feats = dict(**_vecs("ab", ta, tb), sae_a=pa, sae_b=pb, proj_a=_projections(6, D, 2, seed=246),
                 cond=(cond_site, params, probe, torch.tensor([20, 21], dtype=torch.int32)))
    if variant == "b-alone":
        feats = {k: v for k, v in feats.items() if k not in ("vec_a", "sae_a", "proj_a")}
    gate_t, gate_n = gate0.clone(), gate0.clone()
    got = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **feats, gate=gate_t)
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, **feats, gate=gate_n)
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_SAE_TOL[torch.float32])
    assert torch.equal(gate_t, gate0)


@_INTERPRETER_INDEX
def test_tiled_clamps_at_slot_a_before_a_full_slot_b(norm, monkeypatch):
    """A clamp-only slot A beside a full slot B (TopK): slot A's tiled edit feeds slot B's encoder (``full_slot``)
    and is added by the norm, as the reference does."""
    from tests.interpreted.test_triton_kernels import _FULL_TOL, _full_case, _op_args
    from vllm_steer.kernels.sae_clamp import full_triton
    from vllm_steer.kernels.steered_rms_norm import op

    monkeypatch.setattr(full_triton, "ROUND", 64)
    x, r, w, index, a = _full_case(N, "b", 8, seed=250)
    index[:] = prefill_rows(N)
    a["sae_a"] = clamp_pack(80, 37, seed=251, jumprelu=True)
    got = op.triton_path(*_op_args(x, r, w, index, a))
    want = steered_norm_naive(*_op_args(x, r, w, index, a))
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_FULL_TOL)


@_INTERPRETER_INDEX
@pytest.mark.parametrize("c", [64, 200])
def test_slot_edit_writes_each_on_token_its_rows_edit_only(monkeypatch, c):
    """``slot_edit`` alone: an on token's row is its own row's ``sum (f' - f) dec`` (``clamp_delta_naive``; zeros for
    the row without codes), and no other token's row is written (its scratch starts as NaN): a tile never reaches
    past its row's run."""
    from vllm_steer.kernels.sae_clamp import tiled_triton
    from vllm_steer.kernels.sae_clamp.packed import clamp_delta_naive
    from tests.sae_packs import ROW_BARE, ROW_OFF

    class _Torch:  # tiled_triton's torch, its scratch filled with NaN
        float32 = torch.float32
        empty = staticmethod(lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))

    monkeypatch.setattr(tiled_triton, "torch", _Torch)
    x, r, _, _ = _case(N, D, torch.float32, seed=260)
    index = prefill_rows(N)
    pack = clamp_pack(D, c, seed=261, jumprelu=True)
    edit = tiled_triton.slot_edit(x, r, index, pack)
    rows = index[:N].long()
    on = (rows != 0) & (rows != ROW_OFF)
    assert torch.isnan(edit[~on]).all() and not torch.isnan(edit[on]).any()
    want = clamp_delta_naive(x + r, rows, pack)
    torch.testing.assert_close(edit[on], want[on], **(_TOL_C200 if c == 200 else _SAE_TOL[torch.float32]))
    assert torch.equal(edit[rows == ROW_BARE], torch.zeros_like(edit[rows == ROW_BARE]))
