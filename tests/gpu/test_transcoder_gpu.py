"""GPU checks of the steered norm's transcoder feature (``tc``: a transcoder's clamp-only pack at the norm that
makes the MLP's input; runs only where CUDA is available).

- Triton vs the plain-torch reference (``steered_norm_naive(..., tc=)``) for (N, D, dtype, a residual SAE at the
  same norm or not, serial or split walk): within float32 rounding, tokens whose transcoder pre-activation sits
  within MARGIN of its threshold (or of 0) left out;
- the normalized output is the no-transcoder kernel's bit for bit (the transcoder edits the MLP's output, not its
  input), and the residual of a token of row 0, of an OFF row or of a row without codes too;
- the registered op routes a transcoder pack to Triton; inside a CUDA graph captured while every row was OFF, the
  transcoder's rows changed in place afterwards take effect at replay;
- a TopK transcoder (sparsify's: a full pack, ``op.triton_path``: its edit by the tensor-core kernels of
  ``full_triton`` from the norm's output their gather recomputes, added to the residual by the norm's ``FULL_TC``)
  against the reference, after slot A's vector, a clamp-only or a full residual SAE at slot A, a condition gate:
  tokens whose TopK boundary (the k-th vs the k+1-th pre-activation) or a clamped feature's 0 sits within MARGIN
  left out; bit for bit without it on idle rows and an idle batch; in a CUDA graph, rows changed after capture.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("full_fp32_matmuls")]

from tests.gpu.norm_inputs import full_fp32_matmuls, norm_inputs  # noqa: E402,F401
from tests.sae_packs import IDLE_ROWS, R, clamp_pack, full_pack, token_rows  # noqa: E402
from vllm_steer.kernels.steered_rms_norm import op  # noqa: E402
from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
EPS = 1e-5
# |pre - threshold| (or |pre|, the only_if_active gate) below this: rounding may flip f (bf16: the output the
# reference encodes may differ from the kernel's by an ulp, its norm summing in another order)
MARGIN = {torch.float32: 1e-3, torch.bfloat16: 1e-2}



def _triton(*args, **kw):
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    return steered_norm_triton(*args, **kw)


def _case(n: int, d: int, dtype: torch.dtype, seed: int, sae: bool):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, _ = norm_inputs(g, n, d, dtype, R)
    w = w + 1.0  # the output's elements ~N(0, 1): the transcoder's pre-activations O(1)
    tc = clamp_pack(d, 37, seed=seed + 1, jumprelu=True, device="cuda", hidden_scale=1.0)
    kw = {"vec_a": (ta, torch.ones(1, dtype=torch.uint8, device="cuda")),
          "sae_a": clamp_pack(d, 37, seed=seed + 2, device="cuda") if sae else []}
    return x, r, w, token_rows(n, "cuda"), tc, kw


def _ambiguous(out: torch.Tensor, index: torch.Tensor, tc: list, margin: float) -> torch.Tensor:
    """[N] bool: tokens with a clamped transcoder feature whose pre-activation (from the output) is within MARGIN
    of its threshold or of 0 (``margin``)."""
    mode, code, _, enc, _, bias, thr = tc[:7]
    rows = index[: out.shape[0]].long()
    pre = out.float() @ enc.T + bias
    near = ((pre - thr).abs() < margin) | (pre.abs() < margin)
    return ((code[rows] != 0) & near).any(dim=1) & (mode[rows] != 0)


@pytest.mark.parametrize("split", [1, None], ids=["serial", "split"])
@pytest.mark.parametrize("sae", [False, True], ids=["tc", "sae+tc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, d", [(1, 576), (16, 2048), (200, 4096)])
def test_transcoder_kernel_matches_reference(n, d, dtype, sae, split):
    x, r, w, index, tc, kw = _case(n, d, dtype, seed=n + d, sae=sae)
    got = _triton(x, r, w, EPS, 0.0, index, split=split, tc=tc, **kw)
    without = _triton(x, r, w, EPS, 0.0, index, split=split, **kw)
    want = steered_norm_naive(x, r, w, EPS, 0.0, index, tc=tc, **kw)
    assert torch.equal(got[0], without[0])
    keep = ~_ambiguous(got[0], index, tc, MARGIN[dtype])
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    torch.testing.assert_close(got[1][keep], want[1][keep], **TOL[dtype])
    rows = index[:n].long()
    idle = torch.isin(rows, torch.tensor(IDLE_ROWS, device="cuda"))
    assert torch.equal(got[1][idle], without[1][idle])


def test_op_in_cuda_graph_follows_transcoder_rows_changed_after_capture():
    op.register()
    n, d, dtype = 24, 4096, torch.bfloat16
    x, r, w, index, tc, kw = _case(n, d, dtype, seed=5, sae=True)
    steered = [t.clone() for t in tc[:3]]
    for t in tc[:3]:
        t.zero_()

    def call():
        return torch.ops.vllm_steer.steered_norm(x, r, w, EPS, 0.0, index, list(kw["vec_a"]), [], kw["sae_a"], [],
                                                 0, 0, [], None, None, None, None, [], [], tc)

    call()  # JIT outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = call()
    graph.replay()
    without = _triton(x, r, w, EPS, 0.0, index, **kw)
    assert torch.equal(out, without[0]) and torch.equal(res, without[1])
    for t, v in zip(tc[:3], steered):  # the engine writes rows in place (SaeTables.write_row)
        t.copy_(v)
    graph.replay()
    eager = _triton(x, r, w, EPS, 0.0, index, tc=tc, **kw)
    assert torch.equal(out, eager[0]) and torch.equal(res, eager[1])
    assert not torch.equal(res, without[1])


TC_MODES = (0, 1, 0, 1, 1, 1)  # a transcoder clamps only: OFF / DELTA rows
TC_K = 32
FULL_TOL = dict(rtol=2e-4, atol=2e-3)


def _full_case(n: int, d: int, f: int, dtype: torch.dtype, seed: int, slot_a: str):
    """x, residual, weight, index, the TopK transcoder's full pack and the op's slot-A arguments (``slot_a``: "vec",
    "sae" (clamp-only), "full" (a TopK residual SAE), "cond" (rows 1 and 5 gate SAE clamps))."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r, w, ta, _ = norm_inputs(g, n, d, dtype, R)
    w = w + 1.0  # the output's elements ~N(0, 1): the transcoder's pre-activations O(1)
    tc = full_pack(d, f, 64, seed=seed + 1, topk=TC_K, device="cuda", hidden_scale=1.0, modes=TC_MODES)
    sae = {"sae": lambda: clamp_pack(d, 37, seed=seed + 2, device="cuda"),
           "full": lambda: full_pack(d, 4096, 64, seed=seed + 3, topk=16, device="cuda")}.get(slot_a, lambda: [])()
    cond, gate = [], None
    if slot_a == "cond":
        from vllm_steer.kernels.steered_rms_norm.naive import SAE_GATED, VECTORS_UNGATED

        cond = [torch.tensor([-1, 5 | SAE_GATED, -1, -1, 5, 5 | SAE_GATED | VECTORS_UNGATED], dtype=torch.int32,
                             device="cuda"),
                torch.tensor([[0.0, 1.0, 0.0, 1.0]] + [[0.1, 2.0, 0.0, 0.0]] * 5, device="cuda"),
                torch.randn(R, d, device="cuda", generator=g), torch.tensor([20, -2], dtype=torch.int32, device="cuda")]
        gate = torch.rand(n + 5, device="cuda", generator=g) * 0.8 + 0.1
    a = dict(vec_a=[ta, torch.ones(1, dtype=torch.uint8, device="cuda")], sae_a=sae, topk_a=16 if slot_a == "full"
             else 0, cond=cond, gate=gate)
    return x, r, w, token_rows(n, "cuda"), tc, a


def _op_args(x, r, w, index, a: dict, tc: list, k: int) -> tuple:
    return (x, r, w, EPS, 0.0, index, a["vec_a"], [], a["sae_a"], [], a["topk_a"], 0, a["cond"], a["gate"], None,
            None, None, [], [], tc, k)


def _topk_ambiguous(out: torch.Tensor, index: torch.Tensor, tc: list, k: int, margin: float) -> torch.Tensor:
    """[N] bool: on tokens whose k-th and k+1-th pre-activations (from the output) are within ``margin`` (rounding may
    swap which feature is kept), or with a clamped feature's pre within ``margin`` of 0."""
    rows = index[: out.shape[0]].long()
    pre = out.float() @ tc[8].float() + tc[9]
    top = pre.topk(k + 1, dim=-1).values
    close = (top[:, k - 1] - top[:, k]).abs() < margin
    near0 = ((tc[1][rows] != 0) & (pre[:, tc[7]].abs() < margin)).any(dim=1)
    return (close | near0) & (tc[0][rows] != 0)


@pytest.mark.parametrize("slot_a", ["vec", "sae", "full", "cond"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, d, f", [(1, 2048, 16384), (16, 4096, 32768), (300, 4096, 16384)])
def test_full_transcoder_matches_reference(n, d, f, dtype, slot_a):
    x, r, w, index, tc, a = _full_case(n, d, f, dtype, seed=n + d, slot_a=slot_a)
    got = op.triton_path(*_op_args(x, r, w, index, a, tc, TC_K))
    without = op.triton_path(*_op_args(x, r, w, index, a, [], 0))
    want = steered_norm_naive(*_op_args(x, r, w, index, a, tc, TC_K))
    assert torch.equal(got[0], without[0])  # the MLP's input is untouched
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    keep = ~_topk_ambiguous(got[0], index, tc, TC_K, MARGIN[dtype])
    torch.testing.assert_close(got[1][keep], want[1][keep], **(FULL_TOL if dtype == torch.float32 else TOL[dtype]))
    rows = index[:n].long()
    idle = torch.isin(rows, torch.tensor(IDLE_ROWS, device="cuda"))
    assert torch.equal(got[1][idle], without[1][idle])
    if (~idle).any():
        assert not torch.allclose(got[1][~idle].float(), without[1][~idle].float(), rtol=1e-2, atol=1e-2)


def test_full_transcoder_idle_batch_is_the_kernel_without_it():
    x, r, w, index, tc, a = _full_case(64, 4096, 16384, torch.bfloat16, seed=7, slot_a="vec")
    index[:] = torch.where(index % 2 == 0, 0, 2).to(torch.int32)  # rows 0 and 2 (OFF, with codes)
    got = op.triton_path(*_op_args(x, r, w, index, a, tc, TC_K))
    without = op.triton_path(*_op_args(x, r, w, index, a, [], 0))
    assert torch.equal(got[0], without[0]) and torch.equal(got[1], without[1])


def test_op_in_cuda_graph_follows_full_transcoder_rows_changed_after_capture():
    op.register()
    x, r, w, index, tc, a = _full_case(24, 4096, 16384, torch.bfloat16, seed=9, slot_a="vec")
    steered = [t.clone() for t in tc[:3]]
    for t in tc[:3]:
        t.zero_()

    def call():
        return torch.ops.vllm_steer.steered_norm(*_op_args(x, r, w, index, a, tc, TC_K))

    call()  # JIT outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = call()
    graph.replay()
    without = op.triton_path(*_op_args(x, r, w, index, a, [], 0))
    assert torch.equal(out, without[0]) and torch.equal(res, without[1])
    for t, v in zip(tc[:3], steered):  # the engine writes rows in place (SaeTables.write_row)
        t.copy_(v)
    graph.replay()
    eager = op.triton_path(*_op_args(x, r, w, index, a, tc, TC_K))
    assert torch.equal(out, eager[0]) and torch.equal(res, eager[1])
    assert not torch.equal(res, without[1])
