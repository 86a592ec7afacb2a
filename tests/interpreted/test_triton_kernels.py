"""The Triton kernels (the steered norm with each of its features, capture_rows, step_index) against their plain-torch
references, run by Triton's CPU interpreter. Only meaningful with TRITON_INTERPRET=1 set before Triton is imported:
``tests/test_steered_norm.py`` runs this directory in such a process (``./dev test`` ignores it)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from tests.test_steered_norm import DTYPES, NORMS, _case, _off, _on, vllm_norm  # noqa: F401 (fixture)
from vllm_steer.kernels.capture_rows import naive as capture_naive
from vllm_steer.kernels.steered_rms_norm.naive import PROJ_GATED, SAE_GATED, VECTORS_UNGATED, steered_norm_naive
from tests.sae_packs import IDLE_ROWS, clamp_pack, full_pack, token_rows

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def interpreted():
    import vllm_steer.kernels.capture_rows.triton as cap
    import vllm_steer.kernels.steered_rms_norm.triton as kernel

    return kernel, cap


def _vecs(tables: str, ta: torch.Tensor, tb: torch.Tensor) -> dict:
    """The vector descriptors of the slots named in ``tables`` ("a", "b", "ab", "none"), each table active."""
    return {f"vec_{slot}": (t, _on()) for slot, t in (("a", ta), ("b", tb)) if slot in tables}


# The interpreter rounds float32 -> bfloat16 by truncation (numpy has no bf16), a GPU to nearest:
# bf16 gets one unit in the last place; float32 sums in another order.
_TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


# The SAE clamps sum their dot products in another order than the reference's matmuls (the split walk in
# yet another: up to 100 clamps of deltas ~10 here, so float32 differs by ~1e-5 absolute).
_SAE_TOL = {torch.float32: dict(rtol=1e-5, atol=3e-5), torch.bfloat16: _TOL[torch.bfloat16]}
# The interpreter hands a runtime int argument (the clamp-set size C, a loop bound) over as a 1-element
# array and converts it with int(), which NumPy >= 1.25 deprecates: Triton's warning, not the kernel's.
_INTERPRETER_INDEX = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("tables", ["none", "a", "b", "ab"])
def test_triton_kernel_matches_reference(interpreted, vllm_norm, kind, dtype_name, tables):
    norm, _ = interpreted
    dtype = DTYPES[dtype_name]
    m, offset = vllm_norm(kind, 80, dtype, seed=9)  # D not a power of two: masked lanes
    x, r, (ta, tb), index = _case(7, 80, dtype, seed=10)
    vec = _vecs(tables, ta, tb)
    got = norm.steered_norm_triton(x, r, m.weight.data, 1e-5, offset, index, **vec)
    want = steered_norm_naive(x, r, m.weight.data, 1e-5, offset, index, **vec)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **_TOL[dtype])


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("tables", ["a", "b", "ab"])
def test_triton_conditional_kernel_matches_reference(interpreted, vllm_norm, dtype_name, tables):
    """Rows gated at slot A, at slot B, earlier (the gate buffer's value), soft and hard, and rows
    without a condition, in one batch: outputs, new residual and the gate buffer as the reference."""
    norm, _ = interpreted
    dtype = DTYPES[dtype_name]
    m, offset = vllm_norm(NORMS[0], 80, dtype, seed=9)
    x, r, (ta, tb), index = _case(9, 80, dtype, seed=12)
    rows = int(index.max()) + 1
    g = torch.Generator().manual_seed(13)
    site_ids = torch.tensor([20, 21], dtype=torch.int32)
    # rows in use: 1 (no condition), 2 (gated at A, or at B without A), 3 (its gate computed at A, its
    # vectors not gated: applies_to sae), 4 (gated earlier; at B with both); SAE_GATED changes nothing here
    cond_site = torch.tensor([-1, -1, 20 if "a" in tables else 21, 20 | VECTORS_UNGATED,
                              21 | SAE_GATED if tables == "ab" else 5] + [20] * rows, dtype=torch.int32)[:rows]
    params = torch.tensor([[0.1, 2.0, float(i % 2), 0.0] for i in range(rows)], dtype=torch.float32)
    params[0, 3] = 1.0  # a live row has a condition (0: the plain adds, checked below)
    probe = torch.randn(rows, 80, generator=g) / 8
    gate0 = torch.rand(16, generator=g)
    vec = _vecs(tables, ta, tb)
    cond = (cond_site, params, probe, site_ids)
    gate_t, gate_r = gate0.clone(), gate0.clone()
    got = norm.steered_norm_triton(x, r, m.weight.data, 1e-5, offset, index, **vec, cond=cond, gate=gate_t)
    want = steered_norm_naive(x, r, m.weight.data, 1e-5, offset, index, **vec, cond=cond, gate=gate_r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **_TOL[dtype])
    torch.testing.assert_close(gate_t, gate_r, rtol=1e-5, atol=1e-5)
    assert not torch.equal(gate_r[:9], gate0[:9])  # some gate was computed here
    params[0, 3] = 0.0
    gate_0 = gate0.clone()
    idle = norm.steered_norm_triton(x, r, m.weight.data, 1e-5, offset, index, **vec, cond=cond, gate=gate_0)
    plain = norm.steered_norm_triton(x, r, m.weight.data, 1e-5, offset, index, **vec)
    assert torch.equal(idle[0], plain[0]) and torch.equal(idle[1], plain[1]) and torch.equal(gate_0, gate0)


@_INTERPRETER_INDEX
@pytest.mark.parametrize("split", [1, None], ids=["serial", "split"])
def test_triton_conditional_sae_kernel_matches_reference(interpreted, split):
    """An SAE norm of a server with conditions: per row, the gate (from the buffer: no probe is at an SAE
    norm) scales its clamps, its vectors, both or neither, as its site word says; rows without a condition
    are the SAE kernel's, bit for bit; the gate buffer is only read."""
    norm, _ = interpreted
    n, d = 12, 80
    x, r, (ta, tb), _ = _case(n, d, torch.float32, seed=50)
    index = token_rows(n)
    w = torch.randn(d, generator=torch.Generator().manual_seed(51)) * 0.5
    pa, pb = clamp_pack(d, 37, seed=52, jumprelu=True), clamp_pack(d, 37, seed=53, jumprelu=False)
    vec = _vecs("ab", ta, tb)
    earlier = 5  # every condition's probe site: before this norm's slots (20, 21)
    # rows: 0 none, 1 clamps and vectors gated, 2 none (SAE OFF), 3 clamps only (no codes), 4 vectors only,
    # 5 clamps only
    cond_site = torch.tensor([-1, earlier | SAE_GATED, -1, earlier | SAE_GATED | VECTORS_UNGATED, earlier,
                              earlier | SAE_GATED | VECTORS_UNGATED], dtype=torch.int32)
    params = torch.tensor([[0.0, 1.0, 0.0, 1.0]] + [[0.1, 2.0, 0.0, 0.0]] * 5, dtype=torch.float32)
    probe = torch.randn(6, d, generator=torch.Generator().manual_seed(54))
    gate0 = torch.rand(n + 5, generator=torch.Generator().manual_seed(55)) * 0.8 + 0.1
    gate_t, gate_r = gate0.clone(), gate0.clone()
    cond = (cond_site, params, probe, torch.tensor([20, 21], dtype=torch.int32))
    got = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb, cond=cond, gate=gate_t,
                                   split=split)
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb, cond=cond, gate=gate_r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **_SAE_TOL[torch.float32])
    assert torch.equal(gate_t, gate0) and torch.equal(gate_r, gate0)
    rows = index[:n].long()
    plain = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb, split=split)
    ungated = torch.isin(rows, torch.tensor([0, 2]))
    assert torch.equal(got[1][ungated], plain[1][ungated]) and torch.equal(got[0][ungated], plain[0][ungated])
    gated = torch.isin(rows, torch.tensor([1, 4, 5]))  # the gate (in 0.1..0.9) moved them
    assert not torch.allclose(got[1][gated], plain[1][gated], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", ["vectors", "sae"])
def test_a_programmatic_dependent_launch_matches_the_reference(interpreted, kind):
    """``pdl=True`` (VLLM_STEER_NORM_PDL): under the interpreter the plain launch (it cannot run griddepcontrol); in
    ``compile_sm90``'s run this launch compiles the kernel with its wait and ``launch_pdl`` for an H100."""
    norm, _ = interpreted
    x, r, (ta, tb), index = _case(7, 80, torch.bfloat16, seed=12)
    w = torch.ones(80, dtype=torch.bfloat16)
    extra = {"sae_a": clamp_pack(80, 5, seed=13, jumprelu=True), "split": 1} if kind == "sae" else {}
    got = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **_vecs("ab", ta, tb), **extra, pdl=True)
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, **_vecs("ab", ta, tb),
                              **{k: v for k, v in extra.items() if k != "split"})
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_SAE_TOL[torch.bfloat16])


def test_triton_idle_flag_skips_the_table(interpreted):
    norm, _ = interpreted
    x, r, (ta, _), index = _case(4, 32, torch.float32, seed=11)
    w = torch.ones(32)
    idle = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, vec_a=(ta, _off()))
    plain = steered_norm_naive(x, r, w, 1e-5, 0.0, torch.zeros_like(index))
    for a, b in zip(idle, plain):
        torch.testing.assert_close(a, b, **_TOL[torch.float32])


def _sae_case(interpreted, dtype_name, sae, tables, c, split):
    """The SAE kernel against the reference; ``split``: programs per token (None: the launcher's
    choice, 8 at these 12 tokens)."""
    norm, _ = interpreted
    dtype = DTYPES[dtype_name]
    n, d = 12, 80  # D not a power of two: masked lanes
    x, r, (ta, tb), _ = _case(n, d, dtype, seed=20 + c)
    index = token_rows(n)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(21)) * 0.5).to(dtype)
    offset = 1.0 if c == 37 else 0.0  # GemmaRMSNorm's weight for one of the two
    pa = clamp_pack(d, c, seed=30 + c, jumprelu=True) if "a" in sae else []
    pb = clamp_pack(d, c, seed=40 + c, jumprelu=False) if "b" in sae else []
    vec = _vecs(tables, ta, tb)
    got = norm.steered_norm_triton(x, r, w, 1e-5, offset, index, **vec, sae_a=pa, sae_b=pb, split=split)
    want = steered_norm_naive(x, r, w, 1e-5, offset, index, **vec, sae_a=pa, sae_b=pb)
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_SAE_TOL[dtype])
    if split != 1:  # the split walk leaves its counts at zero for the next launch (a replayed graph's too)
        assert not norm.split_buffers(x.device, d)[1].any()
    # the clamps moved the stream (the case is not vacuous) ...
    plain = norm.steered_norm_triton(x, r, w, 1e-5, offset, index, **vec)
    rows = index[:n].long()
    idle = torch.isin(rows, torch.tensor(IDLE_ROWS))
    assert not torch.allclose(got[1][~idle].float(), plain[1][~idle].float(), rtol=1e-2, atol=1e-2)
    # ... and tokens of row 0, of an OFF row, or of a row with no codes are the no-SAE kernel's, bit for bit
    assert torch.equal(got[0][idle], plain[0][idle]) and torch.equal(got[1][idle], plain[1][idle])


@_INTERPRETER_INDEX
@pytest.mark.parametrize("c", [1, 37], ids=["C1", "C37"])  # 37: not a power of two, two blocks of codes
@pytest.mark.parametrize("tables", ["none", "ab"])
@pytest.mark.parametrize("sae", ["a", "b", "ab"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_triton_sae_kernel_matches_reference(interpreted, dtype_name, sae, tables, c):
    _sae_case(interpreted, dtype_name, sae, tables, c, None)


@_INTERPRETER_INDEX
@pytest.mark.parametrize("split", [1, 3], ids=["serial", "split3"])  # one program per token; blocks shared unevenly
@pytest.mark.parametrize("sae", ["a", "b", "ab"])
def test_triton_sae_serial_and_split_walks_match_reference(interpreted, sae, split):
    _sae_case(interpreted, "float32", sae, "ab", 100, split)  # 100 clamps: four blocks of codes


@_INTERPRETER_INDEX
def test_triton_sae_kernel_each_clamp_kind(interpreted):
    """One feature, one token per (kind, only_if_active), on an active and an inactive feature: the
    stream moves by exactly (f' - f) * dec."""
    norm, _ = interpreted
    d = 80
    pack = clamp_pack(d, 1, seed=5, jumprelu=False)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, d, generator=g) * 3
    enc, bias = pack[3][0], pack[5][0]
    x[0] += enc * (4.0 - float(x[0] @ enc + bias)) / float(enc @ enc)  # pre = 4: active
    x[1] += enc * (-2.0 - float(x[1] @ enc + bias)) / float(enc @ enc)  # pre = -2: inactive
    codes = [k | (4 * o) for k in range(4) for o in (0, 1)]
    pack[0] = torch.ones(len(codes) + 1, dtype=torch.int32)
    pack[0][0] = 0
    pack[1] = torch.tensor([[0]] + [[k] for k in codes], dtype=torch.int32)
    pack[2] = torch.full((len(codes) + 1, 1), 3.0)
    w = torch.ones(d)
    for t in range(2):
        xs = x[t : t + 1].expand(len(codes), d).contiguous()
        index = torch.arange(1, len(codes) + 1, dtype=torch.int32)
        got = norm.steered_norm_triton(xs, None, w, 1e-5, 0.0, index, sae_a=pack)
        want = steered_norm_naive(xs, None, w, 1e-5, 0.0, index, sae_a=pack)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        f = max(float(x[t] @ enc + bias), 0.0)
        for i, code in enumerate(codes):
            kind, only = code & 3, code >> 2
            new = {0: f, 1: 3.0, 2: f + 3.0, 3: f * 3.0}[kind]
            if only and f <= 0:
                new = f
            torch.testing.assert_close(got[1][i], x[t] + (new - f) * pack[4][0], rtol=1e-5, atol=1e-5)


def test_triton_sae_kernel_refuses_full_packs(interpreted):
    norm, _ = interpreted
    x, r, _, index = _case(2, 16, torch.float32, seed=7)
    full = clamp_pack(16, 2, seed=8) + [torch.zeros(16, 4), torch.zeros(4), torch.zeros(4), torch.zeros(4, 16),
                                        torch.zeros(16)]
    with pytest.raises(ValueError, match="clamp-only"):
        norm.steered_norm_triton(x, r, torch.ones(16), 1e-5, 0.0, index, sae_a=full)


# Full packs (TopK, reconstruct): the encoder and decoder run as bf16 tensor-core dots against the bf16 weights
# the reference also uses (in float32), the float32 stream split into bf16 hi + lo (the interpreter truncates:
# ~2^-16 relative per operand, a GPU rounds: ~2^-17), float32 sums in another order; a reconstructed row is
# ``s + (recon - s)`` (one more rounding of a value ~20 here). So 2e-4 relative, 1e-3 absolute on the stream.
_FULL_TOL = dict(rtol=2e-4, atol=1e-3)
_FULL_IDLE = (0, 2, 3)  # row 0, an OFF row with codes, a DELTA row without codes: bit for bit the kernel without


def _full_case(n: int, slots: str, topk: int, seed: int, dtype=torch.float32, f: int = 200, cond=None):
    """x, residual, weight, index and the op's arguments (as the engine passes them) of a norm whose ``slots``
    have full packs (d 80, d_sae ``f``: not a multiple of the kernels' 64-feature tiles; 40 clampable)."""
    d = 80
    x, r, (ta, tb), _ = _case(n, d, dtype, seed=seed)
    index = token_rows(n)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(seed + 1)) * 0.5).to(dtype)
    packs = {k: full_pack(d, f, 40, seed=seed + 2 + i, topk=topk) if k in slots else [] for i, k in enumerate("ab")}
    args = dict(vec_a=[ta, _on()], vec_b=[tb, _on()], sae_a=packs["a"], sae_b=packs["b"], topk_a=topk if "a" in slots
                else 0, topk_b=topk if "b" in slots else 0, cond=list(cond[0]) if cond else [],
                gate=cond[1] if cond else None)
    return x, r, w, index, args


def _op_args(x, r, w, index, a: dict) -> tuple:
    return (x, r, w, 1e-5, 0.0, index, a["vec_a"], a["vec_b"], a["sae_a"], a["sae_b"], a["topk_a"], a["topk_b"],
            a["cond"], a["gate"], None, None, None, [], [], [])


# + N 300 at slot B (three rounds of 128, gathered); "chunked": d_sae past the in-register limit (the search reads chunks of 64)
_FULL_CASES = [(k, slots, n) for k in (0, 8) for slots in ("a", "b", "ab") for n in (1, 13)] + [(8, "b", 300)]
_FULL_CASES += [(k, "chunked", 5) for k in (0, 8)]
# "whole": the decoder in one split (it writes the edit itself; else splits of d_sae summed by _reduce)
_FULL_CASES += [(k, "whole", 13) for k in (0, 8)]


@_INTERPRETER_INDEX
@pytest.mark.parametrize("topk,slots,n", _FULL_CASES, ids=[f"k{k}-{s}-N{n}" for k, s, n in _FULL_CASES])
def test_full_sae_slots_match_reference(interpreted, monkeypatch, topk, slots, n):
    """The op's CUDA path (``op.triton_path``: full slots' edits by the tensor-core kernels, then the norm) against
    the reference, every row kind in the batch (OFF, DELTA with every clamp kind, DELTA bare, RECONSTRUCT), slot B
    encoded after slot A's vectors (and slot A's full edit); N = 300 in three rounds of 128 (the last partial); the
    TopK search over chunks of pre read from memory (d_sae 200 in chunks of 64, the last partial); the decoder split
    over d_sae (partial sums, ``_reduce``) and in one piece."""
    from vllm_steer.kernels.sae_clamp import full_triton
    from vllm_steer.kernels.steered_rms_norm import op

    monkeypatch.setattr(full_triton, "ROUND", 128)
    if slots == "chunked":
        monkeypatch.setattr(full_triton, "_SELECT_MAX", 64)
        monkeypatch.setattr(full_triton, "_SELECT_CHUNK", 64)
        slots = "ab"
    if slots == "whole":
        monkeypatch.setattr(full_triton, "_SPLIT_MAX", 1)
        slots = "ab"
    norm, _ = interpreted
    x, r, w, index, a = _full_case(n, slots, topk, seed=60 + n)
    got = op.triton_path(*_op_args(x, r, w, index, a))
    want = steered_norm_naive(*_op_args(x, r, w, index, a))
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_FULL_TOL)
    plain = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, vec_a=a["vec_a"], vec_b=a["vec_b"])
    rows = index[:n].long()
    idle = torch.isin(rows, torch.tensor(_FULL_IDLE))
    assert torch.equal(got[0][idle], plain[0][idle]) and torch.equal(got[1][idle], plain[1][idle])
    if (~idle).any():  # not vacuous: the SAE moved the on tokens
        assert not torch.allclose(got[1][~idle], plain[1][~idle], rtol=1e-2, atol=1e-2)


@_INTERPRETER_INDEX
def test_full_sae_bf16_stream_matches_reference(interpreted):
    """A bf16 model: the outputs round to bf16 (one unit in the last place, as every bf16 kernel test)."""
    from vllm_steer.kernels.steered_rms_norm import op

    x, r, w, index, a = _full_case(13, "ab", 8, seed=90, dtype=torch.bfloat16)
    got = op.triton_path(*_op_args(x, r, w, index, a))
    want = steered_norm_naive(*_op_args(x, r, w, index, a))
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_TOL[torch.bfloat16])


@_INTERPRETER_INDEX
def test_full_sae_gated_rows_match_reference(interpreted):
    """With conditions: the gate (read from the buffer) scales a gated row's full edit, at slot A and in slot B's
    encoder input (slot A's gated vectors), as the reference does."""
    from vllm_steer.kernels.steered_rms_norm import op

    n = 12
    earlier = 5
    cond_site = torch.tensor([-1, earlier | SAE_GATED, -1, earlier, earlier | SAE_GATED | VECTORS_UNGATED, -1],
                             dtype=torch.int32)
    params = torch.tensor([[0.0, 1.0, 0.0, 1.0]] + [[0.1, 2.0, 0.0, 0.0]] * 5, dtype=torch.float32)
    probe = torch.randn(6, 80, generator=torch.Generator().manual_seed(94))
    gate = torch.rand(n + 5, generator=torch.Generator().manual_seed(95)) * 0.8 + 0.1
    cond = ((cond_site, params, probe, torch.tensor([20, 21], dtype=torch.int32)), gate)
    x, r, w, index, a = _full_case(n, "ab", 8, seed=93, cond=cond)
    got = op.triton_path(*_op_args(x, r, w, index, a))
    want = steered_norm_naive(*_op_args(x, r, w, index, a))
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, **_FULL_TOL)


@_INTERPRETER_INDEX
@pytest.mark.parametrize("topk", [0, 8], ids=["jumprelu", "topk8"])
def test_full_sae_idle_batch_writes_nothing(interpreted, monkeypatch, topk):
    """No token's row is on (rows 0 and OFF only): the outputs are the kernel's without SAE, bit for bit, and the
    full kernels leave every scratch buffer as they found it but the on-token count (written 0)."""
    from vllm_steer.kernels.sae_clamp import full_triton
    from vllm_steer.kernels.steered_rms_norm import op

    made = []

    def sentinel_empty(*shape, dtype, device):
        t = torch.full(shape, 7, dtype=dtype, device=device)
        made.append(t)
        return t

    class _Torch:  # full_triton's torch, its scratch allocations filled with a sentinel
        empty = staticmethod(sentinel_empty)
        float32, int32 = torch.float32, torch.int32

    monkeypatch.setattr(full_triton, "torch", _Torch)
    x, r, w, index, a = _full_case(20, "ab", topk, seed=97)
    index[:] = torch.where(index % 2 == 0, 0, 2).to(torch.int32)  # rows 0 and 2 (OFF, with codes)
    got = op.triton_path(*_op_args(x, r, w, index, a))
    plain = interpreted[0].steered_norm_triton(x, r, w, 1e-5, 0.0, index, vec_a=a["vec_a"], vec_b=a["vec_b"])
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    counts = [t for t in made if t.shape == (1,)]
    assert len(counts) == 2 and all(int(t) == 0 for t in counts)  # one per full slot
    assert len(made) == 14 and all(bool((t == 7).all()) for t in made if t.shape != (1,))  # 7 per slot: + partials


def test_capture_rows_triton_matches_reference(interpreted):
    _, cap = interpreted
    x = _case(9, 40, torch.float32, seed=12)[0]
    plan = torch.full((14,), -1, dtype=torch.int32)
    plan[[1, 4, 5, 8]] = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    want = torch.full((5, 40), float("nan"))
    got = want.clone()
    capture_naive.capture_rows_naive(want, x, plan)
    cap.capture_rows_triton(got, x, plan)
    torch.testing.assert_close(got, want, equal_nan=True, **_TOL[torch.float32])
    assert torch.isnan(got[4]).all()  # rows no token was planned for are untouched
    torch.testing.assert_close(got[0], x[4], rtol=0, atol=0)


@_INTERPRETER_INDEX
def test_capture_reduce_segment_add_matches_per_slot_sums(interpreted):
    """Segments of 1, 6 and 3 rows (not multiples of the kernel's 4-row step), sources out of order, D 40 under a
    64-wide block: each named slot gains its rows' float32 sum, the rows no segment names keep their values."""
    from vllm_steer.kernels.capture_reduce.naive import segment_add_naive
    from vllm_steer.kernels.capture_reduce.triton import segment_add_triton

    pool = _case(12, 40, torch.bfloat16, seed=13)[0]
    src = torch.tensor([7, 0, 11, 3, 3, 9, 1, 5, 2, 10, -1, -1])  # past off[n_seg]: never read
    slot, off = torch.tensor([4, 0, 2, 99]), torch.tensor([0, 1, 7, 10, 12])
    acc = torch.randn(6, 40)
    got, naive = acc.clone(), acc.clone()
    segment_add_triton(got, pool, src, slot, off, 3)
    segment_add_naive(naive, pool, src, slot, off, 3)
    want = acc.clone()
    for s, a, b in ((4, 0, 1), (0, 1, 7), (2, 7, 10)):
        want[s] += pool[src[a:b]].float().sum(0)
    torch.testing.assert_close(got, want, **_SAE_TOL[torch.float32])
    torch.testing.assert_close(naive, want, **_SAE_TOL[torch.float32])
    assert torch.equal(got[[1, 3, 5]], acc[[1, 3, 5]])


def test_plan_runs_write_and_reset_match_reference():
    """The capture plan's runs (a run of 1, runs longer than the kernel's 512-cell block, a zero-length run, runs out
    of order, cells in two sites' rows): written, each cell ``rows[i] + j``, by the kernel and the reference alike;
    then reset to -1 by the same runs; the cells no run names keep their values throughout."""
    from vllm_steer.kernels.plan_runs.naive import write_runs_naive
    from vllm_steer.kernels.plan_runs.triton import write_runs_triton

    width = 1300
    flat = [2 * width + 5, 0, width + 3, 700, 2 * width + 40]
    rows = [9000, 7, 100, 2000, 5]
    lens = [1, 600, 1100, 0, 530]
    runs = torch.tensor(flat + rows + lens + [-1] * 6)  # past 3n: never read
    start = torch.randint(-1, 50, (3 * width,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    want = start.clone()
    for f, r, n in zip(flat, rows, lens):
        want[f : f + n] = torch.arange(r, r + n, dtype=torch.int32)
    for write in (write_runs_triton, write_runs_naive):
        plan = start.clone()
        write(plan, runs, 5)
        assert torch.equal(plan, want), write.__name__
        write(plan, runs, 5, reset=True)
        named = torch.zeros(3 * width, dtype=torch.bool)
        for f, n in zip(flat, lens):
            named[f : f + n] = True
        assert (plan[named] == -1).all() and torch.equal(plan[~named], start[~named]), write.__name__


@_INTERPRETER_INDEX
@pytest.mark.parametrize("captured", ["a", "b", "ab"])
@pytest.mark.parametrize("variant", ["plain", "plain-late", "cond", "sae", "sae-split", "cond-sae"])
def test_capture_in_the_norm_matches_reference(interpreted, variant, captured):
    """The steered norm with capture folded in (every variant: plain (EARLY, the default, and the late path),
    conditional, SAE serial and split, both): outputs, the new residual, the gate and every pool row as the
    reference; slot B's row is the stream after slot A's clamps and gated rows; unplanned tokens and unplanned pool
    rows are untouched; the outputs equal the same norm without capture."""
    norm, _ = interpreted
    n, d = 12, 80
    x, r, (ta, tb), _ = _case(n, d, torch.float32, seed=60)
    index = token_rows(n)
    w = torch.randn(d, generator=torch.Generator().manual_seed(61)) * 0.5
    sae = variant.startswith("sae") or variant == "cond-sae"
    pa = clamp_pack(d, 37, seed=62, jumprelu=True) if sae else []
    pb = clamp_pack(d, 37, seed=63, jumprelu=False) if sae else []
    vec = _vecs("ab", ta, tb)
    cond = gate0 = None
    if variant.startswith("cond"):
        # rows: 0 none, 1 gated at A (an SAE norm: gated earlier, clamps too), 2 none, 3 gated earlier with
        # its vectors ungated, 4 gated at A, 5 gated earlier (rows from token_rows: every row has tokens)
        at_a = 5 if sae else 20  # no probe at an SAE norm
        cond_site = torch.tensor([-1, at_a | SAE_GATED, -1, 5 | VECTORS_UNGATED, at_a, 5], dtype=torch.int32)
        params = torch.tensor([[0.1, 2.0, float(i % 2), 0.0] for i in range(6)], dtype=torch.float32)
        params[0, 3] = 1.0
        probe = torch.randn(6, d, generator=torch.Generator().manual_seed(64)) / 8
        gate0 = torch.rand(n + 5, generator=torch.Generator().manual_seed(65)) * 0.8 + 0.1
        cond = (cond_site, params, probe, torch.tensor([20, 21], dtype=torch.int32))
    plans = {}
    for k, slot in enumerate("ab"):
        plan = torch.full((n + 5,), -1, dtype=torch.int32)
        if slot in captured:
            plan[[1 + k, 4, 6 + k, 9, 11]] = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32) + k
        plans[slot] = plan if slot in captured else None
    split = 3 if variant == "sae-split" else 1
    early = variant != "plain-late"

    def gated() -> dict:  # the condition with a fresh copy of the gate buffer (each call writes it)
        return {} if cond is None else {"cond": cond, "gate": gate0.clone()}

    runs = {}
    for who in ("triton", "naive"):
        pool = torch.full((11, d), float("nan"))
        feats = dict(**vec, sae_a=pa, sae_b=pb, **gated(), pool=pool, plan_a=plans["a"], plan_b=plans["b"])
        if who == "triton":
            got = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **feats, split=split, early=early)
        else:
            got = steered_norm_naive(x, r, w, 1e-5, 0.0, index, **feats)
        runs[who] = (got, pool, feats.get("gate"))
    (got_t, pool_t, gate_t), (got_n, pool_n, gate_n) = runs["triton"], runs["naive"]
    for a, b in zip(got_t, got_n):
        torch.testing.assert_close(a, b, **_SAE_TOL[torch.float32])
    torch.testing.assert_close(pool_t, pool_n, equal_nan=True, **_SAE_TOL[torch.float32])
    if cond is not None:
        torch.testing.assert_close(gate_t, gate_n, rtol=1e-5, atol=1e-5)
    written = sorted({int(v) for p in plans.values() if p is not None for v in p if v >= 0})
    assert not torch.isnan(pool_t[written]).any() and torch.isnan(pool_t[[i for i in range(11) if i not in written]]).all()
    # slot A's row is the pristine stream; without SAE A or a gate, slot B's is pristine + A's row
    if plans["a"] is not None:
        torch.testing.assert_close(pool_t[2], x[4] + r[4], rtol=1e-6, atol=1e-6)
    if plans["b"] is not None and variant.startswith("plain"):
        torch.testing.assert_close(pool_t[3], x[4] + r[4] + ta[index[4].long()], rtol=1e-6, atol=1e-6)
    # the same norm without capture: the same outputs (split is 1 but for sae-split; no SAE: pa, pb empty)
    alone = norm.steered_norm_triton(x, r, w, 1e-5, 0.0, index, **vec, sae_a=pa, sae_b=pb, **gated(), split=split,
                                     early=early)
    assert torch.equal(alone[0], got_t[0]) and torch.equal(alone[1], got_t[1])


@_INTERPRETER_INDEX
def test_capture_kernels_take_one_compile_for_every_step():
    """``write_runs`` for every count of runs (1, 2, 16, 17: Triton specializes an int on == 1 and % 16 unless told
    not to) and ``segment_add`` with its index slices at any offset of one buffer, as ``ReduceRegion`` passes them (an
    odd count of segments leaves ``off`` 8 bytes off 16): one compiled kernel each (per ``RESET``), so the launch at
    start-up compiles what every step runs and none compiles during inference (``test_kernels_compile`` counts this
    run's compiles on sm_90). The results match the references."""
    from vllm_steer.kernels.capture_reduce.naive import segment_add_naive
    from vllm_steer.kernels.capture_reduce.triton import segment_add_triton
    from vllm_steer.kernels.plan_runs.naive import write_runs_naive
    from vllm_steer.kernels.plan_runs.triton import write_runs_triton

    plans = []  # every launch first, the checks after (the sm_90 compile run launches nothing: its checks fail)
    for n in (1, 2, 16, 17):
        runs = torch.tensor([3 * i for i in range(n)] + [10 * i for i in range(n)] + [2] * n)  # cells, rows, lengths
        for reset in (False, True):
            got = torch.full((3 * n + 4,), 5, dtype=torch.int32)
            want = got.clone()
            write_runs_triton(got, runs, n, reset)
            write_runs_naive(want, runs, n, reset)
            plans.append((got, want))
    pool = _case(12, 40, torch.bfloat16, seed=13)[0]
    src = torch.tensor([7, 0, 11, 3, 3, 9, 1, 5, 2, 10])
    sums = []
    for at in range(4):  # the segments' slots, then their bounds, at offset ``at`` of one index buffer
        idx = torch.tensor([0] * at + [4, 0, 2] + [0, 1, 7, 10])
        acc = torch.randn(6, 40, generator=torch.Generator().manual_seed(at))
        got, want = acc.clone(), acc.clone()
        segment_add_triton(got, pool, src, idx[at:], idx[at + 3 :], 3)
        segment_add_naive(want, pool, src, idx[at:], idx[at + 3 :], 3)
        sums.append((got, want))
    assert all(torch.equal(got, want) for got, want in plans)
    for got, want in sums:
        torch.testing.assert_close(got, want, **_SAE_TOL[torch.float32])


@pytest.mark.parametrize("seed", range(6))
def test_step_index_kernel_matches_reference(seed):
    import vllm_steer.kernels.step_index.triton as kernel
    from tests.test_step_index import random_step
    from vllm_steer.kernels.step_index.naive import step_index_naive

    num_reqs, slots, qsl, positions, slot_rows = random_step(seed, max_slots=24)
    args = [torch.from_numpy(a) for a in (slots, qsl, positions, slot_rows)]
    n = int(qsl[num_reqs])
    if seed == 0:  # one prefill chunk longer than a program's block
        args[1] = torch.tensor([0, 600], dtype=torch.int32)
        args[2] = torch.arange(600, dtype=torch.int64)
        num_reqs, n = 1, 600
    got, want = (torch.full((n + 50,), 9, dtype=torch.int32) for _ in range(2))
    kernel.step_index_triton(got, *args, num_reqs, n + 30)
    step_index_naive(want, *args, num_reqs, n + 30)
    assert torch.equal(got, want)


def _proj_case(seed: int) -> tuple:
    """(n, d, x, r, table a, table b, index, weight) of the projection kernel tests: 12 tokens, d 80, float32."""
    n, d = 12, 80
    x, r, (ta, tb), _ = _case(n, d, torch.float32, seed=seed)
    w = torch.randn(d, generator=torch.Generator().manual_seed(seed + 1)) * 0.5
    return n, d, x, r, ta, tb, token_rows(n), w


def _projections(rows: int, d: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(count, dirs, bounds) for ``rows`` rows: row 0 none, odd rows ablate their directions, even rows cap
    them into [-0.5, 0.5]; row r < rows - 1 has min(r, k) live directions (unit vectors); the last row has none
    left but stale directions in its table (a row reused without projections: the count alone decides)."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(rows, k, d, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    count = torch.tensor([min(r, k) for r in range(rows - 1)] + [0], dtype=torch.int32)
    dirs[0] = 0
    bounds = torch.zeros(rows, k, 2)
    bounds[0::2, :, 0], bounds[0::2, :, 1] = -0.5, 0.5
    return count, dirs, bounds


@_INTERPRETER_INDEX
@pytest.mark.parametrize("variant", ["plain", "cond", "cond-proj-gated", "cond-sae-proj-gated", "sae", "sae-split"])
def test_triton_projection_kernel_matches_reference(interpreted, variant):
    """Directional projections (ablate, cap) as a feature of the norm, with vectors, conditions (rows whose
    condition gates their projections: ``s + g * (projected(s) - s)``, at a probe site and after it, and at an
    SAE norm, which only reads the gate) or SAE clamps at the same site: outputs as the reference; a token of
    an ablating row with one direction and no later add at that slot leaves a stream with no component along
    it; row 0 is the plain norm, bit for bit."""
    kernel, _ = interpreted
    n, d, x, r, ta, tb, index, w = _proj_case(seed=70)
    pa, pb = _projections(6, d, 2, seed=72), _projections(6, d, 3, seed=73)
    extra = {}
    if variant.startswith("cond"):
        cond_site = torch.tensor([-1, 20, -1, 5 | VECTORS_UNGATED, 21, 5], dtype=torch.int32)
        if "proj-gated" in variant:  # rows 1 (probe at slot A), 3 (probe earlier, vectors ungated), 4 (probe at B)
            cond_site[[1, 3, 4]] |= PROJ_GATED
        params = torch.tensor([[0.1, 2.0, float(i % 2), 0.0] for i in range(6)], dtype=torch.float32)
        params[0, 3] = 1.0
        probe = torch.randn(6, d, generator=torch.Generator().manual_seed(74)) / 8
        site_ids = [30, 31] if "sae" in variant else [20, 21]  # no probe at an SAE norm (the front end's rule)
        extra = {"cond": (cond_site, params, probe, torch.tensor(site_ids, dtype=torch.int32))}
        if "sae" in variant:
            extra |= {"sae_a": clamp_pack(d, 37, seed=75, jumprelu=True), "sae_b": clamp_pack(d, 37, seed=76)}
    elif variant.startswith("sae"):
        extra = {"sae_a": clamp_pack(d, 37, seed=75, jumprelu=True), "sae_b": clamp_pack(d, 37, seed=76)}
    split = {"split": 3} if variant == "sae-split" else {}
    gate0 = torch.rand(n + 5, generator=torch.Generator().manual_seed(77)) * 0.8 + 0.1
    vec = ((ta, _on()), (tb, _on()))
    gate_t, gate_n = gate0.clone(), gate0.clone()
    got = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, *vec, **extra, gate=gate_t, proj_a=pa, proj_b=pb,
                                     **split)
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, *vec, **extra, gate=gate_n, proj_a=pa, proj_b=pb)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **_SAE_TOL[torch.float32])
    torch.testing.assert_close(gate_t, gate_n, rtol=1e-5, atol=1e-5)
    if "proj-gated" in variant:  # the gate scales the projections' move: not the ungated projection's result
        ungated = (extra["cond"][0] & ~PROJ_GATED, *extra["cond"][1:])
        free = steered_norm_naive(x, r, w, 1e-5, 0.0, index, *vec, **(extra | {"cond": ungated}),
                                  gate=gate0.clone(), proj_a=pa, proj_b=pb)
        moved = (index[:n] == 1) | (index[:n] == 3) | (index[:n] == 4)
        assert not torch.allclose(got[1][moved], free[1][moved], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(got[1][~moved], free[1][~moved], **_SAE_TOL[torch.float32])
    plain = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, *vec, **extra, gate=gate0.clone(), **split)
    rows = index[:n].long()
    assert torch.equal(got[1][rows == 0], plain[1][rows == 0]) and torch.equal(got[0][rows == 0], plain[0][rows == 0])
    assert not torch.allclose(got[1][rows != 0], plain[1][rows != 0], rtol=1e-3, atol=1e-3)  # they moved
    if variant == "plain":  # slot B only, one ablated direction (row 1): nothing along it before B's add
        only_b = steered_norm_naive(x, r, w, 1e-5, 0.0, index, vec_b=(torch.zeros_like(tb), _on()),
                                    proj_b=_projections(6, d, 1, seed=78))
        t1 = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, vec_b=(torch.zeros_like(tb), _on()),
                                        proj_b=_projections(6, d, 1, seed=78))
        v = _projections(6, d, 1, seed=78)[1][1, 0]
        along = t1[1][rows == 1] @ v
        torch.testing.assert_close(along, torch.zeros_like(along), rtol=0, atol=1e-5)
        torch.testing.assert_close(t1[1], only_b[1], **_SAE_TOL[torch.float32])


@_INTERPRETER_INDEX
@pytest.mark.parametrize("variant", ["plain", "cond", "sae"])
def test_triton_projections_skip_a_site_marked_idle(interpreted, variant):
    """A site whose idle mark is set (``count[0] = -1``: no live row projects there, runtime/projection_tables.py)
    projects no token, whatever its row's count: the kernel is the one without projections, bit for bit, as the
    reference; the mark cleared (0), the same tables project again (the marks of the two slots are independent)."""
    kernel, _ = interpreted
    n, d, x, r, ta, tb, index, w = _proj_case(seed=90)
    pa, pb = _projections(6, d, 2, seed=92), _projections(6, d, 1, seed=93)
    extra = {}
    if variant == "cond":  # rows 1 and 4 gate their projections (the gated path's call)
        cond_site = torch.tensor([-1, 20 | PROJ_GATED, -1, 5, 21 | PROJ_GATED, 5], dtype=torch.int32)
        params = torch.tensor([[0.1, 2.0, 0.0, 0.0]] * 6, dtype=torch.float32)
        params[0, 3] = 1.0
        probe = torch.randn(6, d, generator=torch.Generator().manual_seed(94)) / 8
        extra = {"cond": (cond_site, params, probe, torch.tensor([20, 21], dtype=torch.int32))}
    elif variant == "sae":
        extra = {"sae_a": clamp_pack(d, 37, seed=95, jumprelu=True)}
    vec = ((ta, _on()), (tb, _on()))
    gate0 = torch.rand(n + 5, generator=torch.Generator().manual_seed(96)) * 0.8 + 0.1
    idle_a = (torch.cat([torch.tensor([-1], dtype=torch.int32), pa[0][1:]]), *pa[1:])
    assert int(pa[0][0]) == 0 and (pa[0][1:] > 0).any()  # the helper's tables: site live, rows projecting

    def both(proj_a, proj_b):
        out = []
        for fn in (kernel.steered_norm_triton, steered_norm_naive):
            extra_g = dict(extra, gate=gate0.clone()) if extra.get("cond") else extra
            out.append(fn(x, r, w, 1e-5, 0.0, index, *vec, **extra_g, proj_a=proj_a, proj_b=proj_b))
        return out

    (none_t, none_n), (idle_t, idle_n), (live_t, live_n) = both((), ()), both(idle_a, ()), both(pa, ())
    assert all(torch.equal(a, b) for a, b in zip(idle_t, none_t))  # idle: the kernel without projections
    assert all(torch.equal(a, b) for a, b in zip(idle_n, none_n))
    for a, b in zip(live_t, live_n):
        torch.testing.assert_close(a, b, **_SAE_TOL[torch.float32])
    steered = index[:n] != 0
    assert not torch.allclose(live_t[1][steered], none_t[1][steered], rtol=1e-3, atol=1e-3)
    (mixed_t, mixed_n), (full_t, _) = both(idle_a, pb), both((), pb)  # A idle, B live: only B projects
    for a, b, c in zip(mixed_t, mixed_n, full_t):
        torch.testing.assert_close(a, b, **_SAE_TOL[torch.float32])
        assert torch.equal(a, c)


@_INTERPRETER_INDEX
@pytest.mark.parametrize("variant", ["tc", "tc-serial", "tc-bf16", "sae-tc", "sae-tc-split", "cond-tc", "cond-sae-tc"])
def test_triton_transcoder_kernel_matches_reference(interpreted, variant):
    """A transcoder at the norm that makes the MLP's input: encoded from the norm's output as stored, its clamps'
    delta moves only the residual (the output is the kernel's without it, bit for bit); beside a residual SAE at
    the same norm (slot A: its clamps move the stream before the norm, the transcoder reads the result), its walk
    serial, split (alone: 8 programs per token; after a split SAE walk: by the program that finishes the token), and
    gated by a condition. Tokens of row 0, of an OFF row or of a row with no codes come back as
    without the transcoder, bit for bit."""
    from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    dtype = torch.bfloat16 if variant == "tc-bf16" else torch.float32
    n, d = 12, 80
    x, r, (ta, _), _ = _case(n, d, dtype, seed=70)
    index = token_rows(n)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(71)) * 0.5 + 1.0).to(dtype)
    tc = clamp_pack(d, 37, seed=72, jumprelu=True, hidden_scale=1.0)  # the output's elements are ~N(0, 1)
    sae = clamp_pack(d, 37, seed=73, jumprelu=False) if "sae" in variant else []
    kw = {"vec_a": (ta, _on()), "sae_a": sae}
    if "cond" in variant:  # rows 1 and 5: their condition gates SAE clamps (the transcoder's too)
        cond_site = torch.tensor([-1, 5 | SAE_GATED, -1, -1, 5, 5 | SAE_GATED | VECTORS_UNGATED], dtype=torch.int32)
        params = torch.tensor([[0.0, 1.0, 0.0, 1.0]] + [[0.1, 2.0, 0.0, 0.0]] * 5, dtype=torch.float32)
        probe = torch.randn(6, d, generator=torch.Generator().manual_seed(74))
        gate = torch.rand(n + 5, generator=torch.Generator().manual_seed(75)) * 0.8 + 0.1
        kw.update(cond=(cond_site, params, probe, torch.tensor([20, -2], dtype=torch.int32)), gate=gate)
    split = {"sae-tc-split": 3, "sae-tc": 1, "tc-serial": 1}.get(variant)
    got = steered_norm_triton(x, r, w, 1e-5, 0.0, index, split=split, tc=tc, **kw)
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, tc=tc, **kw)
    tol = _SAE_TOL[dtype]
    # bf16: the interpreter rounds the output by truncation, the reference to nearest; a feature whose pre sits at
    # its threshold may then flip, so the residual is checked against the delta of the output the kernel stored
    for a, b in zip(got, want) if dtype == torch.float32 else ((got[0], want[0]),):
        torch.testing.assert_close(a, b, **tol)
    without = steered_norm_triton(x, r, w, 1e-5, 0.0, index, split=split, **kw)
    assert torch.equal(got[0], without[0])  # the transcoder edits the MLP's output, not its input
    rows = index[:n].long()
    idle = torch.isin(rows, torch.tensor(IDLE_ROWS))
    assert torch.equal(got[1][idle], without[1][idle])
    assert not torch.allclose(got[1][~idle].float(), without[1][~idle].float(), rtol=1e-2, atol=1e-2)
    if split != 1:  # a split walk leaves its counts at zero for the next launch
        from vllm_steer.kernels.steered_rms_norm.triton import split_buffers

        assert not split_buffers(x.device, d)[1].any()
    # the delta is the clamps' edit of features encoded from the stored output: (f' - f) @ dec, per token
    from vllm_steer.kernels.sae_clamp.packed import clamp_delta_naive

    delta = clamp_delta_naive(without[0].float(), rows, tc)
    if "cond" not in variant:  # bf16: the reference rounds the stream before adding (the kernel after): 2 ulps
        err = (got[1].float() - (without[1].float() + delta)).abs()
        ulps = 2.0 ** -7 * (got[1].float().abs() + without[1].float().abs()) if dtype != torch.float32 else 0.0
        assert bool((err <= ulps + tol["atol"]).all()), float((err - ulps).max())


_TC_FULL_MODES = (0, 1, 0, 1, 1, 1)  # a transcoder clamps only: OFF / DELTA rows (full_pack's rows otherwise)
_TC_FULL = ["tc", "tc-offset", "tc-bf16", "sae-tc", "full-sae-tc", "cond-tc", "tc-N300"]


@_INTERPRETER_INDEX
@pytest.mark.parametrize("variant", _TC_FULL)
def test_full_transcoder_matches_reference(interpreted, monkeypatch, variant):
    """A TopK transcoder (sparsify's: a full pack at the norm that makes the MLP's input) on the op's CUDA path
    (``op.triton_path``: its edit encoded by the tensor-core kernels from the norm's output, which their gather
    recomputes, then added to the residual by the norm) against the reference: after slot A's vector, after a
    clamp-only or a full residual SAE at slot A, gated by a condition, GemmaRMSNorm's offset weight, a bf16 stream,
    N 300 in three rounds. The output is the norm's without the transcoder, bit for bit (it edits the MLP's output,
    not its input); tokens of row 0, an OFF row or a row without codes keep the residual bit for bit."""
    from vllm_steer.kernels.sae_clamp import full_triton
    from vllm_steer.kernels.steered_rms_norm import op

    monkeypatch.setattr(full_triton, "ROUND", 128)
    norm, _ = interpreted
    dtype = torch.bfloat16 if variant == "tc-bf16" else torch.float32
    n, d = (300 if variant == "tc-N300" else 12), 80
    offset = 1.0 if variant == "tc-offset" else 0.0
    x, r, (ta, _), _ = _case(n, d, dtype, seed=110)
    index = token_rows(n)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(111)) * 0.5 + (0.0 if offset else 1.0)).to(dtype)
    tc = full_pack(d, 200, 40, seed=112, topk=8, hidden_scale=1.0, modes=_TC_FULL_MODES)
    sae = {"sae-tc": clamp_pack(d, 37, seed=113, jumprelu=False),
           "full-sae-tc": full_pack(d, 150, 30, seed=114, topk=6)}.get(variant, [])
    cond, gate = [], None
    if variant == "cond-tc":  # rows 1 and 5: their condition gates SAE clamps (the transcoder's too)
        cond = [torch.tensor([-1, 5 | SAE_GATED, -1, -1, 5, 5 | SAE_GATED | VECTORS_UNGATED], dtype=torch.int32),
                torch.tensor([[0.0, 1.0, 0.0, 1.0]] + [[0.1, 2.0, 0.0, 0.0]] * 5, dtype=torch.float32),
                torch.randn(6, d, generator=torch.Generator().manual_seed(115)),
                torch.tensor([20, -2], dtype=torch.int32)]
        gate = torch.rand(n + 5, generator=torch.Generator().manual_seed(116)) * 0.8 + 0.1
    topk_a = 6 if variant == "full-sae-tc" else 0

    def args(tc_pack, k):
        return (x, r, w, 1e-5, offset, index, [ta, _on()], [], sae, [], topk_a, 0, cond, gate, None, None, None, [],
                [], tc_pack, k)

    got = op.triton_path(*args(tc, 8))
    want = steered_norm_naive(*args(tc, 8))
    without = op.triton_path(*args([], 0))
    assert torch.equal(got[0], without[0])  # the transcoder edits the MLP's output, not its input
    torch.testing.assert_close(got[0], want[0], **(_TOL[dtype] if dtype != torch.float32 else _FULL_TOL))
    if dtype == torch.float32:
        torch.testing.assert_close(got[1], want[1], **_FULL_TOL)
    rows = index[:n].long()
    idle = torch.isin(rows, torch.tensor(IDLE_ROWS))
    assert torch.equal(got[1][idle], without[1][idle])
    assert not torch.allclose(got[1][~idle].float(), without[1][~idle].float(), rtol=1e-2, atol=1e-2)
    # the residual moved by the clamps' edit of TopK features encoded from the stored output: (f' - f) @ W_dec
    from vllm_steer.kernels.sae_clamp.packed import clamp_delta_naive

    delta = clamp_delta_naive(without[0].float(), rows, tc, 8)
    if cond:
        g = torch.where(torch.tensor([False, True, False, False, False, True])[rows], gate[:n], 1.0)
        delta = delta * g[:, None]
    err = (got[1].float() - (without[1].float() + delta)).abs()
    ulps = 2.0 ** -7 * (got[1].float().abs() + without[1].float().abs()) if dtype != torch.float32 else 0.0
    assert bool((err <= ulps + _FULL_TOL["atol"]).all()), float((err - ulps).max())


def _one_direction_tables(d: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[tuple, tuple]:
    """Slot A's and slot B's projections with K = 1 (a ``max_projections`` 1 server's input norm): row 0 none, row 1
    ablates at A, row 2 at B, row 3 at both, row 4 caps at A into [-0.5, 0.5], row 5 none (a stale direction, count
    0); directions stored in ``dtype`` (float32, or the model's: ``runtime.projection_tables.dirs_dtype``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for at in ((1, 3, 4), (2, 3)):
        dirs = torch.randn(6, 1, d, generator=g)
        dirs = (dirs / dirs.norm(dim=-1, keepdim=True)).to(dtype)
        count = torch.tensor([1 if r in at else 0 for r in range(6)], dtype=torch.int32)
        bounds = torch.zeros(6, 1, 2)
        bounds[4, 0] = torch.tensor([-0.5, 0.5])
        out.append((count, dirs, bounds))
    return out[0], out[1]


@_INTERPRETER_INDEX
@pytest.mark.parametrize("dirs_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", ["ab", "a", "b"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
def test_triton_projection_paths_match_reference(interpreted, early, slots, dtype_name, dirs_name):
    """Both plain-site paths (``EARLY``, the default: every slot's loads before the first branch; ``early=False``: the
    late path) give the reference's outputs for tokens projecting at A, at B, at both, capped, of row 0 and of a stale
    row, with directions in float32 and in bf16 (``runtime.projection_tables.DIRS`` "model"); row 0's tokens, a stale
    row's and a site marked idle are the late kernel without projections, bit for bit; and a token's stream after an
    ablation at its last slot has no component along the direction (bf16 directions: only their rounding's)."""
    kernel, _ = interpreted
    dtype = DTYPES[dtype_name]
    n, d = 14, 80
    x, r, (ta, tb), _ = _case(n, d, dtype, seed=120)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(121)) * 0.5 + 1.0).to(dtype)
    index = (torch.arange(n + 5) % 6).to(torch.int32)
    pa, pb = _one_direction_tables(d, seed=122, dtype=DTYPES[dirs_name])
    proj = {"proj_a": pa} if slots == "a" else {"proj_b": pb} if slots == "b" else {"proj_a": pa, "proj_b": pb}
    vec = ((ta, _on()), (tb, _on()))
    got = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, *vec, **proj, early=early)
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, *vec, **proj)
    tol = _SAE_TOL[dtype] if dtype == torch.float32 else _TOL[dtype]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    plain = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, *vec, early=False)
    rows = index[:n]
    for a, b in zip(got, plain):
        assert torch.equal(a[rows == 0], b[rows == 0]) and torch.equal(a[rows == 5], b[rows == 5])
    idle = {k: (torch.cat([torch.tensor([-1], dtype=torch.int32), c[1:]]), *rest) for k, (c, *rest) in proj.items()}
    assert all(torch.equal(a, b) for a, b in
               zip(kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, *vec, **idle, early=early), plain))
    if slots == "b" and dtype == torch.float32:  # only B, no vector after it: nothing left along B's direction
        zb = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, vec_b=(torch.zeros_like(tb), _on()), proj_b=pb,
                                        early=early)[1]
        v = _one_direction_tables(d, seed=122)[1][1][2, 0]  # the float32 unit direction (bf16's rounded from it)
        along, before = zb[rows == 2] @ v, (x + r)[:n][rows == 2] @ v
        # bf16 directions: what is left is the rounding's (|w|^2 != 1, the angle to v): 1e-3 of the component at
        # D 80 (the engine's D 4096: the angle's ~1e-3 alone), not the component itself
        limit = 1e-5 if dirs_name == "float32" else 4e-3 * float(before.abs().max())
        assert float(along.abs().max()) <= limit and float(before.abs().min()) > 0.1


@_INTERPRETER_INDEX
def test_triton_early_without_projections_is_the_late_kernel(interpreted):
    """A site with vectors and no projections (what every non-projecting norm runs: ``kernels_bench``'s ``steered_*``
    rows against ``steered_*_late``): EARLY (the default) is the late kernel bit for bit; launched here so
    tests/test_kernels_compile.py compiles both specializations for sm_90 too (the projection cases do not reach
    them)."""
    kernel, _ = interpreted
    n, d = 14, 80
    x, r, (ta, tb), _ = _case(n, d, torch.bfloat16, seed=140)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(141)) * 0.5 + 1.0).to(torch.bfloat16)
    index = (torch.arange(n + 5) % 6).to(torch.int32)
    vec = ((ta, _on()), (tb, _on()))
    got = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, *vec, early=True)
    plain = kernel.steered_norm_triton(x, r, w, 1e-5, 0.0, index, *vec, early=False)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))


@_INTERPRETER_INDEX
@pytest.mark.parametrize("tables, captured, residual", [("ab", "ab", True), ("a", "b", True), ("b", "", False),
                                                        ("", "a", True)])
def test_plain_op_kernel_matches_reference(interpreted, tables, captured, residual):
    """``steered_norm_plain``'s CUDA impl (``op.plain_triton``: a slot's table and flag, None for none; the plans and
    pool) against the reference with the same features: outputs, new residual and every pool row."""
    from vllm_steer.kernels.steered_rms_norm import op

    n, d = 9, 80
    x, r, (ta, tb), index = _case(n, d, torch.float32, seed=70)
    w = torch.randn(d, generator=torch.Generator().manual_seed(71)) * 0.5
    r = r if residual else None
    plans = {slot: None for slot in "ab"}
    for k, slot in enumerate(captured):
        plans[slot] = torch.full((n + 5,), -1, dtype=torch.int32)
        plans[slot][[1, 4 + k, 8]] = torch.tensor([0, 2, 4], dtype=torch.int32) + k
    pools = [torch.full((6, d), float("nan")) if captured else None for _ in range(2)]
    tab = {slot: (t, _on()) if slot in tables else (None, None) for slot, t in (("a", ta), ("b", tb))}
    got = op.plain_triton(x, r, w, 1e-5, 0.0, index, *tab["a"], *tab["b"], plans["a"], plans["b"], pools[0])
    want = steered_norm_naive(x, r, w, 1e-5, 0.0, index, **_vecs(tables or "none", ta, tb), plan_a=plans["a"],
                              plan_b=plans["b"], pool=pools[1])
    for g, h in zip(got, want):
        torch.testing.assert_close(g, h, **_TOL[torch.float32])
    if captured:
        torch.testing.assert_close(pools[0], pools[1], equal_nan=True, **_TOL[torch.float32])
        written = sorted({j + k for j in (0, 2, 4) for k in range(len(captured))})
        assert not torch.isnan(pools[0][written]).any()
        assert torch.isnan(pools[0][[i for i in range(6) if i not in written]]).all()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
@pytest.mark.parametrize("static", [True, False], ids=["static_per_tensor", "dynamic_per_token"])
def test_triton_fp8_output_matches_reference(interpreted, vllm_norm, dtype_name, static):
    """QUANT: the steered norm writing its output as FP8 (runtime.fp8_fusion's steered_norm_plain_fp8) equals the
    reference norm then vLLM's own QuantFP8 (native, as a compiled stock engine runs it): the same scales, fp8 codes
    at most one step apart where the interpreter's bf16 truncation moves the rounded output (see _TOL)."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    norm, _ = interpreted
    dtype = DTYPES[dtype_name]
    m, offset = vllm_norm("RMSNorm", 80, dtype, seed=21)
    x, r, (ta, tb), index = _case(9, 80, dtype, seed=22)
    vec = _vecs("ab", ta, tb)
    scale = torch.tensor([0.02], dtype=torch.float32) if static else None
    q, s, stream = norm.steered_norm_fp8_triton(x, r, m.weight.data, 1e-5, offset, index, **vec, quant_scale=scale)
    out, want_stream = steered_norm_naive(x, r, m.weight.data, 1e-5, offset, index, **vec)
    quant = QuantFP8(static=static, group_shape=GroupShape.PER_TENSOR if static else GroupShape.PER_TOKEN)
    # the native path by name: what a compiled stock engine runs (Inductor's ops); which method `quant(...)` dispatches
    # to depends on the vLLM config current when QuantFP8 is built (forward_cpu in a CI process)
    want_q, want_s = quant.forward_native(out, scale)
    torch.testing.assert_close(stream, want_stream, **_TOL[dtype])
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape
    if static:
        assert s.numel() == 0
    else:
        torch.testing.assert_close(s, want_s, **_TOL[dtype])
    # One fp8 step apart at most (e4m3: 3 mantissa bits, relative 2^-3; 2^-9 the subnormal step), except the
    # interpreter's own float32 -> e4m3 cast, which loses the carry when rounding up reaches a power of two (7.9 ->
    # 4.0, not 8.0; a GPU's cvt rounds it to 8.0): there the code is a power of two whose double is within a step.
    got, want = q.float(), want_q.float()
    near = (got - want).abs() <= want.abs() * 2 ** -3 + 2 ** -9
    pow2 = got.abs() == torch.exp2(torch.log2(got.abs().clamp(min=2 ** -9)).round())
    carry = pow2 & ((2 * got - want).abs() <= want.abs() * 2 ** -3)
    assert (near | carry).all()
    assert carry.float().mean() < 0.05 and near.float().mean() > 0.9


def _group_scales(n: int, d: int, group: int, layout: str) -> torch.Tensor:
    """A [n, d // group] float32 scale buffer as vLLM's ``per_token_group_quant_fp8`` allocates it (fp8_utils.py):
    row-major, column-major (a permuted [G, n]) or TMA-aligned (strides (1, n rounded up to 4)), NaN-poisoned."""
    from vllm.utils.deep_gemm import get_tma_aligned_size

    g = d // group
    if layout == "row":
        s = torch.empty(n, g)
    elif layout == "col":
        s = torch.empty(g, n).permute(1, 0)
    else:
        s = torch.empty_strided((n, g), (1, get_tma_aligned_size(n, 4)))
    return s.fill_(float("nan"))


def _fp8_near(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes one fp8 step apart at most, codes off by the interpreter's lost carry): see the test above."""
    got, want = got.float(), want.float()
    near = (got - want).abs() <= want.abs() * 2 ** -3 + 2 ** -9
    pow2 = got.abs() == torch.exp2(torch.log2(got.abs().clamp(min=2 ** -9)).round())
    return near, pow2 & ((2 * got - want).abs() <= want.abs() * 2 ** -3)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scales", "ue8m0"])
@pytest.mark.parametrize("layout", ["row", "col", "tma"])
@pytest.mark.parametrize("d,group", [(384, 128), (320, 64)], ids=["D384-G128", "D320-G64"])
def test_triton_fp8_group_output_matches_vllm_group_quant(interpreted, vllm_norm, d, group, layout, ue8m0):
    """QUANT 3 (block-FP8 linears: a scale per token and group of columns, written in the layout the linear reads)
    equals vLLM's own group quant (``QuantFP8._quantize_group_native``, the plain-torch form of
    ``_C.per_token_group_fp8_quant``) of the same kernel's unquantized output: scales bit for bit, codes bit for bit
    through the interpreter's own e4m3 cast; dequantized, the steered rows are the reference norm's output within
    fp8's step. D not a power of two: a masked group past D, whose scales must not be written (NaN-poisoned)."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    norm, _ = interpreted
    m, offset = vllm_norm("RMSNorm", d, torch.bfloat16, seed=31)
    x, r, (ta, tb), index = _case(9, d, torch.bfloat16, seed=32)
    vec = _vecs("ab", ta, tb)
    scales = _group_scales(9, d, group, layout)
    strides = scales.stride()
    q, s, stream = norm.steered_norm_fp8_triton(x, r, m.weight.data, 1e-5, offset, index, **vec, group_scale=scales,
                                                group_size=group, group_eps=1e-10, ue8m0=ue8m0)
    assert s.numel() == 0 and scales.stride() == strides and not torch.isnan(scales).any()
    out_k, stream_k = norm.steered_norm_triton(x, r, m.weight.data, 1e-5, offset, index, **vec)
    assert torch.equal(stream, stream_k)
    quant = QuantFP8(static=False, group_shape=GroupShape(1, group), column_major_scales=layout != "row",
                     use_ue8m0=ue8m0)
    want_q, want_s = quant.forward_native(out_k)
    assert torch.equal(scales, want_s)
    # the quotient vLLM's native form casts, cast by the interpreter as our kernel's is: the same codes bit for bit
    quotient = (out_k.float().view(9, d // group, group) / want_s.contiguous()[:, :, None]).clamp(-448.0, 448.0)
    assert torch.equal(q.view(torch.uint8), _interpreted_e4m3(quotient.view(9, d)).view(torch.uint8))
    # against torch's cast: one step apart at most, or the lost carry (the interpreter also rounds ties away from zero
    # and truncates some subnormals, where a GPU's cvt.rn rounds to nearest even)
    near, carry = _fp8_near(q, want_q)
    exact = q.view(torch.uint8) == want_q.view(torch.uint8)
    assert (near | carry).all() and carry.float().mean() < 0.05 and exact.float().mean() > 0.9
    # steering applied: dequantized, every row is the reference norm's output (within e4m3's relative step, its
    # subnormal step 2^-9 times the scale, and the interpreter's bf16 truncation; the lost carries left out), and the
    # steered rows are far from the unsteered norm's
    out, _ = steered_norm_naive(x, r, m.weight.data, 1e-5, offset, index, **vec)
    plain, _ = steered_norm_naive(x, r, m.weight.data, 1e-5, offset, torch.zeros_like(index), **vec)
    deq = (q.float().view(9, d // group, group) * scales[:, :, None]).view(9, d)
    err = (deq - out.float()).abs() - out.float().abs() * 2 ** -3 - scales.repeat_interleave(group, dim=1) * 2 ** -9
    assert (err[~carry] <= 0).all()
    steered = index[:9] != 0
    assert steered.sum() >= 4 and ((deq - plain.float()).abs().amax(dim=-1)[steered] > 0.5).all()


@triton.jit
def _e4m3_kernel(p_x, p_q, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p_q + o, tl.load(p_x + o, mask=o < n).to(p_q.dtype.element_ty), mask=o < n)


def _interpreted_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn by the interpreter's cast (the one the kernel's store does under it)."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _e4m3_kernel[(1,)](x.contiguous().view(-1), q.view(-1), x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return q



def test_triton_fp8_group_zero_group_follows_the_cuda_op(interpreted, vllm_norm):
    """A group of zeros (x + residual zero there, unsteered): the scale is ``eps / 448`` as vLLM's CUDA op computes it
    (its plain-torch baseline, tests/fp8_group_ref.py), not the native form's clamp at 1 / (448 · 512); codes zero.
    The other groups: scales bit for bit, codes as above."""
    from tests.fp8_group_ref import group_quant_baseline

    norm, _ = interpreted
    d, group = 256, 128
    m, offset = vllm_norm("RMSNorm", d, torch.bfloat16, seed=41)
    x, r, (ta, tb), index = _case(4, d, torch.bfloat16, seed=42)
    index[1] = 0
    x[1, :group] = 0
    r[1, :group] = 0
    scales = _group_scales(4, d, group, "col")
    q, _, _ = norm.steered_norm_fp8_triton(x, r, m.weight.data, 1e-5, offset, index, **_vecs("ab", ta, tb),
                                           group_scale=scales, group_size=group, group_eps=1e-10)
    out_k, _ = norm.steered_norm_triton(x, r, m.weight.data, 1e-5, offset, index, **_vecs("ab", ta, tb))
    want_q, want_s = torch.empty_like(q), _group_scales(4, d, group, "col")
    group_quant_baseline()(out_k, want_q, want_s, group, 1e-10, -448.0, 448.0, False, True, False)
    assert scales[1, 0].item() == pytest.approx(1e-10 / 448, rel=1e-6)
    assert torch.equal(scales, want_s)
    assert (q[1, :group].float() == 0).all()
    near, carry = _fp8_near(q, want_q)
    assert (near | carry).all()
