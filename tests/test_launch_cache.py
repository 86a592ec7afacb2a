"""kernels.launch_cache on CPU, with a stand-in for Triton's JIT function and compiled kernel: which
calls go through Triton, which launch the cached kernel, with which arguments, and the fallback.
(The real launches are checked on the GPU: tests/gpu/test_steered_norm_gpu.py.)"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from vllm_steer.kernels import launch_cache
from vllm_steer.kernels.launch_cache import CachedLauncher


class FakeCompiled:
    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail
        self.function, self.packed_metadata = "fn", "meta"

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
        if self.fail:
            raise TypeError("launcher takes other arguments")
        self.log.append(("direct", (g0, g1, g2), stream, args))


class FakeJit:
    arg_names = ["p_x", "stride", "eps", "D", "FLAG", "TUNE", "MODE"]
    params = [SimpleNamespace(default=inspect.Parameter.empty)] * 5 + [SimpleNamespace(default=False),
                                                                       SimpleNamespace(default=2)]

    def __init__(self, fail_direct: bool = False) -> None:
        self.log: list = []
        self.compiled = 0
        self.fail_direct = fail_direct

    def __getitem__(self, grid):
        def launch(*args, num_warps, **constexprs):
            self.log.append(("triton", grid, args, constexprs, num_warps))
            self.compiled += 1
            return FakeCompiled(self.log, self.fail_direct)
        return launch


@pytest.fixture(autouse=True)
def fake_driver(monkeypatch):
    dev = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 1234)
    monkeypatch.setattr(launch_cache, "driver", SimpleNamespace(active=dev))
    monkeypatch.setattr(launch_cache, "knobs", SimpleNamespace(runtime=SimpleNamespace(
        launch_enter_hook=None, launch_exit_hook=None)))
    monkeypatch.setattr(CachedLauncher, "direct", True)


def test_second_call_launches_the_cached_kernel_with_every_argument():
    jit = FakeJit()
    launch = CachedLauncher(jit)
    x = torch.zeros(64)
    launch((5,), (x, 64, 1e-5), (64, True), 8)
    launch((7, 2), (x, 64, 2e-5), (64, True), 8)
    assert [e[0] for e in jit.log] == ["triton", "direct"]
    assert jit.log[0][3] == {"D": 64, "FLAG": True, "TUNE": False, "MODE": 2} and jit.log[0][4] == 8
    assert jit.log[1] == ("direct", (7, 2, 1), 1234, (x, 64, 2e-5, 64, True, False, 2))


def test_left_out_constexprs_take_their_defaults_and_share_the_explicit_call_s_kernel():
    """The compiled launcher takes every parameter: defaulted trailing constexprs the caller leaves out are passed
    (s29: ``full_triton._encode`` on the engine's path turned the direct path off for the process)."""
    jit = FakeJit()
    launch = CachedLauncher(jit)
    x = torch.zeros(64)
    launch((1,), (x, 64, 1e-5), (64, True, False), 8)
    launch((1,), (x, 64, 1e-5), (64, True, False, 2), 8)
    launch((1,), (x, 64, 1e-5), (64, True, True), 8)
    assert [e[0] for e in jit.log] == ["triton", "direct", "triton"] and CachedLauncher.direct
    assert jit.log[1][3] == (x, 64, 1e-5, 64, True, False, 2) and jit.log[2][3]["MODE"] == 2


def test_parameters_without_known_defaults_are_left_to_triton():
    """A function whose parameters' defaults are unknown (the interpreter's keeps no ``params``) or missing: the call
    goes to Triton's binding with what was given."""
    jit = FakeJit()
    del_params = type("NoParams", (FakeJit,), {"params": property(lambda self: ())})()
    for fn in (jit, del_params):
        CachedLauncher(fn)((1,), (torch.zeros(64), 64, 1e-5), (64,), 8)
        assert fn.log[-1][0] == "triton" and fn.log[-1][3] == {"D": 64}


@pytest.mark.parametrize("change", ["misaligned", "dtype", "stride_not_16", "stride_one", "constexpr", "warps"])
def test_a_new_specialization_goes_through_triton(change):
    jit = FakeJit()
    launch = CachedLauncher(jit)
    buf = torch.zeros(80)
    base = ((buf[:64], 64, 1e-5), (64, True), 8)
    args, constexprs, warps = base
    if change == "misaligned":
        args = (buf[1:65],) + args[1:]  # 4 bytes in: not a multiple of 16
    elif change == "dtype":
        args = (torch.zeros(64, dtype=torch.float16),) + args[1:]
    elif change == "stride_not_16":
        args = (args[0], 65, args[2])
    elif change == "stride_one":
        args = (args[0], 1, args[2])
    elif change == "constexpr":
        constexprs = (64, False)
    else:
        warps = 4
    launch((1,), *base)
    launch((1,), args, constexprs, warps)
    launch((1,), args, constexprs, warps)
    assert [e[0] for e in jit.log] == ["triton", "triton", "direct"] and jit.compiled == 2


def test_values_that_keep_the_specialization_reuse_the_kernel():
    jit = FakeJit()
    launch = CachedLauncher(jit)
    a, b = torch.zeros(64), torch.zeros(128)  # both 16-byte aligned
    launch((1,), (a, 64, 1e-5), (64, True), 8)
    launch((3,), (b, 128, 0.5), (64, True), 8)
    assert [e[0] for e in jit.log] == ["triton", "direct"]


def test_a_launcher_of_another_signature_turns_the_direct_path_off():
    jit = FakeJit(fail_direct=True)
    launch = CachedLauncher(jit)
    x = torch.zeros(64)
    for _ in range(3):
        launch((1,), (x, 64, 1e-5), (64, True), 8)
    assert [e[0] for e in jit.log] == ["triton", "triton", "triton"]
    assert CachedLauncher.direct is False and not launch.cache


def test_nothing_is_cached_when_triton_returns_no_compiled_kernel():
    """The interpreter (TRITON_INTERPRET=1) returns no compiled kernel: every call goes through it."""
    calls = []

    class Interp(FakeJit):
        def __getitem__(self, grid):
            return lambda *a, num_warps, **k: calls.append(grid)

    launch = CachedLauncher(Interp())
    for _ in range(2):
        launch((1,), (torch.zeros(64), 64, 1e-5), (64, True), 8)
    assert calls == [(1,), (1,)] and not launch.cache


class Chain:  # Triton >= 3.5's HookChain: called by the launcher when it is not None
    def __init__(self, calls: list) -> None:
        self.calls = calls


@pytest.mark.parametrize("enter_calls, leave_calls, passed", [
    ([], [], False), (["profiler"], [], True), ([], ["profiler"], True)])
def test_hook_chains_reach_the_launcher_only_when_one_has_hooks(monkeypatch, enter_calls, leave_calls, passed):
    seen = []

    class Compiled(FakeCompiled):
        def launch_metadata(self, grid, stream, *args):
            return {"name": "k", "stream": stream}

        def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
            seen.append((meta, enter, leave))

    enter, leave = Chain(enter_calls), Chain(leave_calls)
    monkeypatch.setattr(launch_cache, "knobs", SimpleNamespace(runtime=SimpleNamespace(
        launch_enter_hook=enter, launch_exit_hook=leave)))
    launch_cache._direct(Compiled([]))((3,), (torch.zeros(4), 4))
    if passed:
        assert seen == [({"name": "k", "stream": 1234}, enter, leave)]
    else:
        assert seen == [(None, None, None)]


@pytest.fixture
def norm_launches(monkeypatch):
    """The steered norm's wrapper over a stand-in JIT of its kernel's parameters: each Triton launch ("compile")
    records ``spec_of`` of its runtime arguments and its constexprs; each direct launch records whether its own
    arguments have the specialization of the compiled kernel it reuses (the reference: ``spec_of``, Triton's rules)."""
    from vllm_steer.kernels.steered_rms_norm import triton as norm

    real, log = norm._KERNEL.fn, []
    n_runtime = real.arg_names.index("D")

    class Compiled(FakeCompiled):
        def __init__(self, spec) -> None:
            super().__init__(log)
            self.spec = spec

        def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
            log.append(("direct", self.spec == (launch_cache.spec_of(args[:n_runtime]), args[n_runtime:])))

    class Jit:
        arg_names, params = real.arg_names, real.params

        def __getitem__(self, grid):
            def launch(*args, num_warps, **constexprs):
                log.append(("triton", None))
                return Compiled((launch_cache.spec_of(args), tuple(constexprs.values())))
            return launch

    monkeypatch.setattr(norm, "_KERNEL", CachedLauncher(Jit()))
    return norm.steered_norm_triton, log


def _norm_call(variant: str = "base") -> tuple[tuple, dict]:
    """Fresh tensors for one steered-norm call of a plain site, with one thing changed by ``variant``."""
    n, d, rows = 4, 64, 8
    dtype, table_dtype = torch.float32, torch.float32
    if variant == "x_dtype":
        dtype = table_dtype = torch.float16
    elif variant == "table_dtype":
        table_dtype = torch.float16
    elif variant == "d":
        d = 80
    x = torch.randn(n, d, dtype=dtype)
    if variant == "x_stride_16":
        x = torch.randn(n, 2 * d, dtype=dtype)[:, :d]
    elif variant == "x_stride_odd":
        x = torch.randn(n, d + 8, dtype=dtype)[:, :d]
    table = torch.zeros(rows, d, dtype=table_dtype)
    if variant == "misaligned_table":
        table = torch.zeros(rows * d + 1, dtype=table_dtype)[1:].view(rows, d)
    flag = torch.ones(1, dtype=torch.uint8)
    if variant == "misaligned_flag":
        flag = torch.ones(2, dtype=torch.uint8)[1:]
    index = torch.zeros(16, dtype=torch.int32)
    args = (x, None if variant == "no_residual" else torch.randn(n, d, dtype=dtype), torch.ones(d, dtype=dtype),
            0 if variant == "int_eps" else 1e-5, 1.0 if variant == "offset" else 0.0, index)
    kw = {"vec_a": (table, flag), "vec_b": () if variant == "no_slot_b" else (torch.zeros(rows, d, dtype=dtype), flag)}
    if variant.startswith("capture"):
        kw.update(pool=torch.zeros(rows, d, dtype=dtype), plan_b=torch.full((16,), -1, dtype=torch.int32))
        if variant == "capture_ab":
            kw["plan_a"] = torch.full((16,), -1, dtype=torch.int32)
    if variant.startswith("proj"):  # a rarer feature (spec_of keys its descriptor): K 1 is a specialization of its own
        k = 1 if variant == "proj_k1" else 2
        kw["proj_a"] = (torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, k, d), torch.zeros(rows, k, 2))
    return args, kw


VARIANTS = ["x_dtype", "table_dtype", "d", "x_stride_16", "x_stride_odd", "misaligned_table", "misaligned_flag",
            "no_residual", "int_eps", "offset", "no_slot_b", "capture_b", "capture_ab", "proj_k1", "proj_k2"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_steered_norm_launches_a_changed_specialization_through_triton(norm_launches, variant):
    """The steered norm's own launch key (dtypes, raw ints, the OR of its addresses, flags): a call that changes
    what Triton specializes on (a dtype, D, a stride, an address' alignment, a feature) is launched through Triton,
    never by a kernel compiled for another; the same call again (fresh tensors) reuses its own."""
    launch, log = norm_launches
    first = {"proj_k1": "proj_k2", "proj_k2": "proj_k1"}.get(variant, "base")  # the proj variants: each other's
    for v in (first, variant, variant):
        args, kw = _norm_call(v)
        launch(*args, **kw)
    assert [kind for kind, _ in log] == ["triton", "triton", "direct"] and log[2][1] is True


def test_steered_norm_reuses_its_kernel_for_fresh_tensors_of_the_same_layout(norm_launches):
    launch, log = norm_launches
    for variant in ["base", "capture_b"] * 3:
        args, kw = _norm_call(variant)
        launch(*args, **kw)
    assert [kind for kind, _ in log] == ["triton", "triton"] + ["direct"] * 4
    assert all(ok for kind, ok in log if kind == "direct")


def test_a_compiled_kernel_without_a_launcher_turns_the_direct_path_off():
    """A kernel whose launcher cannot be looked up when it is cached (a driver without one: the sm_90 compile-only
    plugin's) leaves the call to Triton from then on, as a failed direct launch does."""
    class NoLauncher(FakeCompiled):
        @property
        def run(self):
            raise AttributeError("no launcher_cls")

    class Jit(FakeJit):
        def __getitem__(self, grid):
            def launch(*args, num_warps, **constexprs):
                self.log.append(("triton", grid))
                return NoLauncher(self.log)
            return launch

    jit = Jit()
    launch = CachedLauncher(jit)
    for _ in range(2):
        launch((1,), (torch.zeros(64), 64, 1e-5), (64, True), 8)
    assert [e[0] for e in jit.log] == ["triton", "triton"] and CachedLauncher.direct is False and not launch.cache
