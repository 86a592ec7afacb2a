"""GPU checks of the apply_steering Triton kernel against its plain-torch reference.

Runs only where CUDA is available (the lent H100/H200); elsewhere every test skips.

What is checked, for every (N, D, dtype):
- tokens whose row is 0 stay bit-identical (the kernel does not touch them);
- steered tokens equal the reference ``hidden + table[index].to(hidden.dtype)`` bit for bit in
  float32, and within a small tolerance in float16/bfloat16;
- with ``active == 0`` nothing is written, whatever the index and table hold.
Both sides do one addition in the hidden dtype, correctly rounded (Torch computes the half-type
add in float32 and rounds once more; with 24 >= 2p + 2 mantissa bits for p = 11 and p = 8 that
double rounding is innocuous), so the half types are exact too: ``test_half_types_bit_exact``
asserts that separately.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from vllm_steer.kernels.apply_steering.naive import apply_steering_naive  # noqa: E402
from vllm_steer.kernels.apply_steering.triton import apply_steering_triton  # noqa: E402

NS = (1, 7, 256, 2048, 8192)
DS = (64, 2048, 4096, 4099)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUM_ROWS = 9  # row 0 + 8 configs
TOL = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}

CASES = [
    pytest.param(n, d, name, id=f"N{n}-D{d}-{name}") for n in NS for d in DS for name in DTYPES
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A same-size integer view, so equality is bit equality (-0.0 != 0.0, NaN == same NaN)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _inputs(n: int, d: int, dtype: torch.dtype, seed: int, extra_index: int = 37):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    table = torch.randn(NUM_ROWS, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    table[0].zero_()
    # index is a persistent buffer longer than N; entries past N are garbage the kernel must not read
    index = torch.randint(0, NUM_ROWS, (n + extra_index,), generator=g, device="cuda", dtype=torch.int32)
    index[: n : 3] = 0  # at least a third of the tokens are unsteered (row 0)
    if n > 1:
        index[1] = NUM_ROWS - 1  # and at least one steered token, on the last row
    return hidden, table, index


def _active(v: int) -> torch.Tensor:
    return torch.full((1,), v, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("n,d,dtype_name", CASES)
def test_triton_matches_naive(n: int, d: int, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    hidden, table, index = _inputs(n, d, dtype, seed=n * 7919 + d)
    orig = hidden.clone()
    ref = hidden.clone()
    out = hidden.clone()

    apply_steering_naive(ref, table, index, _active(1))
    apply_steering_triton(out, table, index, _active(1))
    torch.cuda.synchronize()

    idle = index[:n] == 0
    # row-0 tokens: untouched, bit for bit
    assert torch.equal(_bits(out[idle]), _bits(orig[idle]))
    if dtype == torch.float32:
        assert torch.equal(_bits(out), _bits(ref)), "float32 must match the reference bit for bit"
    else:
        torch.testing.assert_close(out, ref, **TOL[dtype])
    steered = ~idle
    if steered.any():  # the steered tokens did change
        assert not torch.equal(out[steered], orig[steered])

    # active == 0: nothing is written, even though index and table are non-zero
    quiet = hidden.clone()
    apply_steering_triton(quiet, table, index, _active(0))
    torch.cuda.synchronize()
    assert torch.equal(_bits(quiet), _bits(orig))


@pytest.mark.parametrize(
    "n,d,dtype_name",
    [pytest.param(n, d, name, id=f"N{n}-D{d}-{name}") for n in (7, 2048) for d in (2048, 4099)
     for name in ("float16", "bfloat16")],
)
def test_half_types_bit_exact(n: int, d: int, dtype_name: str) -> None:
    """One correctly rounded add on both sides: the half types match bit for bit as well."""
    dtype = DTYPES[dtype_name]
    hidden, table, index = _inputs(n, d, dtype, seed=17 + n + d)
    ref, out = hidden.clone(), hidden.clone()
    apply_steering_naive(ref, table, index, _active(1))
    apply_steering_triton(out, table, index, _active(1))
    torch.cuda.synchronize()
    mismatched = int((_bits(out) != _bits(ref)).sum())
    assert mismatched == 0, f"{mismatched} of {out.numel()} elements differ from the reference"


def test_float32_table_into_bfloat16_hidden() -> None:
    """A table in another dtype is cast to the hidden dtype before the add, on both sides."""
    hidden, _, index = _inputs(300, 1024, torch.bfloat16, seed=5)
    table = torch.randn(NUM_ROWS, 1024, device="cuda", dtype=torch.float32)
    table[0].zero_()
    ref, out = hidden.clone(), hidden.clone()
    apply_steering_naive(ref, table, index, _active(1))
    apply_steering_triton(out, table, index, _active(1))
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(ref))


def test_strided_rows() -> None:
    """Rows of hidden that are a column slice of a wider buffer (stride(0) > D)."""
    base = torch.randn(500, 2048 + 64, device="cuda")
    hidden = base[:, :2048]
    _, table, index = _inputs(500, 2048, torch.float32, seed=9)
    before_tail = base[:, 2048:].clone()
    ref = hidden.clone()
    apply_steering_naive(ref, table, index, _active(1))
    apply_steering_triton(hidden, table, index, _active(1))
    torch.cuda.synchronize()
    assert torch.equal(hidden, ref)
    assert torch.equal(base[:, 2048:], before_tail)  # nothing written past D


def test_empty_batch() -> None:
    hidden = torch.empty(0, 128, device="cuda")
    table = torch.randn(NUM_ROWS, 128, device="cuda")
    index = torch.ones(16, dtype=torch.int32, device="cuda")
    apply_steering_triton(hidden, table, index, _active(1))
    torch.cuda.synchronize()


# ---------------------------------------------------------------- the registered op


@pytest.fixture(scope="module")
def registered_op():
    pytest.importorskip("vllm")
    from vllm_steer.kernels.apply_steering import op

    op.register()
    op.register()  # idempotent
    return torch.ops.vllm_steer.apply_steering_


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_registered_op(registered_op, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    hidden, table, index = _inputs(513, 4096, dtype, seed=3)
    ref, out = hidden.clone(), hidden.clone()
    apply_steering_naive(ref, table, index, _active(1))
    registered_op(out, table, index, _active(1))
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(ref))
    quiet = hidden.clone()
    registered_op(quiet, table, index, _active(0))
    torch.cuda.synchronize()
    assert torch.equal(_bits(quiet), _bits(hidden))


def test_registered_op_in_cuda_graph(registered_op) -> None:
    """Captured while idle, replayed after the buffers change in place: the replay steers.

    This is how vLLM uses it: the graph is captured once, then the runtime rewrites the index,
    the table rows and the active flag in place before each replay."""
    n, d = 64, 1024
    table = torch.zeros(NUM_ROWS, d, device="cuda")
    index = torch.zeros(n + 8, dtype=torch.int32, device="cuda")
    active = _active(0)
    static_in = torch.randn(n, d, device="cuda")
    work = torch.empty_like(static_in)

    def step():
        work.copy_(static_in)
        registered_op(work, table, index, active)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (Triton compiles here, outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work, static_in)  # idle: untouched

    table[3].normal_()
    table[5].normal_()
    index[:n] = torch.tensor([0, 3, 5, 0] * (n // 4), dtype=torch.int32, device="cuda")
    active.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    ref = static_in.clone()
    apply_steering_naive(ref, table, index, active)
    assert torch.equal(work, ref)

    active.fill_(0)  # flag down again: the replay leaves the input as is
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work, static_in)


def test_registered_op_under_torch_compile(registered_op) -> None:
    """Inductor keeps the opaque op (a zero table is not folded away) and mutates in place."""
    n, d = 40, 256
    table = torch.zeros(NUM_ROWS, d, device="cuda")
    index = torch.zeros(n, dtype=torch.int32, device="cuda")
    active = _active(0)

    def f(x):
        y = x * 2.0
        registered_op(y, table, index, active)
        return y + 1.0

    cf = torch.compile(f, fullgraph=True)
    x = torch.randn(n, d, device="cuda")
    torch.testing.assert_close(cf(x), x * 2.0 + 1.0, rtol=0, atol=0)
    table[2].fill_(0.5)
    index[::2] = 2
    active.fill_(1)
    expected = x * 2.0
    apply_steering_naive(expected, table, index, active)
    torch.testing.assert_close(cf(x), expected + 1.0, rtol=0, atol=0)
