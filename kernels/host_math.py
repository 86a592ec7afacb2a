"""Integer helpers for the kernels' host-side launch code: ``triton.cdiv`` and ``triton.next_power_of_2`` are
constexpr functions in Triton 3.6, whose call from Python costs ~1.7 µs (s30, CPU box; a plain expression ~0.05),
paid on every eager launch (steps above vLLM's CUDA-graph sizes launch each norm from Python)."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
