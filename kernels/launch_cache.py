"""Launch a Triton kernel without Triton's per-call binding: the compiled kernel, cached per specialization.

Steps above vLLM's largest CUDA-graph size run their compiled pieces without a graph, so every norm
is launched from Python while the engine loop waits. ``JITFunction.__getitem__(grid)(...)`` binds
and specializes every argument and looks its cache up on each call: measured on an H100
(``bench/RESULTS.md``, sixth session), ~22 µs of the steered norm's ~41 µs per call, against a GPU time of
~2 µs per norm at decode sizes. ``CachedLauncher`` keys the compiled kernel on what Triton
specializes on (each tensor's dtype and 16-byte alignment, each int's value 1 / multiple of 16 /
32-bit range, the constexprs and ``num_warps``), lets Triton compile and launch on a miss, and on a
hit calls the compiled kernel's launcher directly, as Triton's own ``run`` does after its lookup. A caller that
knows its arguments' layout passes its own flat key (``spec``: the steered norm's wrapper) instead of ``spec_of``'s
walk over every argument; what does not change between launches of a compiled kernel (its C launcher, function,
metadata, the driver's device and stream getters) is looked up once, when it is cached (``_direct``).
Launch hooks: Triton >= 3.5 keeps them in ``HookChain`` objects that its launcher calls on every
launch, empty or not, after building a launch-metadata dict; while both chains are empty they are
passed as ``None`` (nothing to call, no metadata), otherwise (a profiler's hooks) as Triton passes them.

Trailing constexprs a caller leaves out take their defaults here, as Triton's binding does: the compiled launcher
takes every parameter (s29: ``full_triton._encode``'s defaulted tuning constexprs, left out on the engine's
path, turned the direct path off for the whole process at a full SAE pack's first launch).

Any failure of the direct call (a Triton whose launcher has another signature) turns the direct
path off for the process and launches through Triton from then on. Under the interpreter
(``TRITON_INTERPRET=1``) nothing is cached.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

try:  # Triton >= 3.4
    from triton import knobs
    from triton.runtime.driver import driver
except ImportError:  # pragma: no cover - older Triton: always its own launch path
    knobs = driver = None

logger = logging.getLogger("vllm.steer")
_I32 = (-(2 ** 31), 2 ** 31 - 1)


def spec_of(args: tuple) -> tuple:
    """What Triton specializes the runtime arguments on: (dtype, 16-byte aligned) per tensor, a tuple argument (a
    feature's descriptor) element by element, (== 1, % 16 == 0, 32-bit) per int, the type of a float, anything else
    as it is. Dispatched on the exact type first (4.4 µs for the steered norm's 26 arguments on the CPU box, 7.7 with
    an isinstance chain; s30; the steered norm now passes its own ``spec``); a tensor subclass (a Parameter) falls to
    the isinstance."""
    out = []
    for a in args:
        t = type(a)
        if t is tuple:
            out.append(spec_of(a) if a else a)
        elif t is bool:
            out.append(a)
        elif t is int:
            out.append((a == 1, a % 16 == 0, _I32[0] <= a <= _I32[1]))
        elif t is float:
            out.append(float)
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, not a.data_ptr() & 15))
        else:
            out.append(a)
    return tuple(out)


class CachedLauncher:
    """``launcher(grid, args, constexprs, num_warps, num_stages=None)``: ``args`` are the kernel's leading (runtime)
    parameters in order, ``constexprs`` its trailing constexpr values in order; ``num_stages`` None: Triton's
    default."""

    direct = knobs is not None  # class-wide: one Triton per process

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.names = fn.arg_names
        defaults = tuple(p.default for p in getattr(fn, "params", ()))  # inspect.Parameter.empty: none
        # per count of parameters given: the defaults of the rest, where every one has one (the interpreter's
        # function keeps no ``params``: nothing is cached there, and Triton's binding fills them)
        self.tails = {given: defaults[given:] for given in range(len(self.names))
                      if len(defaults) == len(self.names) and inspect.Parameter.empty not in defaults[given:]}
        self.cache: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: tuple, num_warps: int,
                 num_stages: int | None = None, spec: tuple | None = None, launch_pdl: bool = False) -> None:
        """``spec``: the caller's own key of the runtime arguments' specialization, in place of ``spec_of(args)``
        (None: ``spec_of``): it must differ wherever ``spec_of(args)`` would (a dtype, a pointer's 16-byte alignment, an
        int's class); a finer one (raw int values) only costs a pass through Triton per new value. ``launch_pdl``:
        Triton's compile option (a programmatic dependent launch; the compiled launcher carries it)."""
        if (given := len(args) + len(constexprs)) < len(self.names):
            constexprs += self.tails.get(given, ())  # () where unknown: Triton's own path fills them
        key = (spec_of(args) if spec is None else spec, constexprs, num_warps, num_stages, launch_pdl)
        launch = self.cache.get(key) if CachedLauncher.direct else None
        if launch is not None:
            try:
                launch(grid, args + constexprs)
                return
            except (TypeError, AttributeError) as e:  # a launcher of another signature: use Triton's path
                self._off(e)
        named = dict(zip(self.names[len(args):], constexprs))
        stages = {} if num_stages is None else {"num_stages": num_stages}
        if launch_pdl:
            stages["launch_pdl"] = True
        kernel = self.fn[grid](*args, **named, num_warps=num_warps, **stages)
        if CachedLauncher.direct and kernel is not None and hasattr(kernel, "packed_metadata"):
            try:
                self.cache[key] = _direct(kernel.result() if hasattr(kernel, "result") else kernel)
            except (TypeError, AttributeError) as e:  # a compiled kernel of another shape
                self._off(e)

    def _off(self, e: Exception) -> None:
        CachedLauncher.direct = False
        self.cache.clear()
        logger.warning("vllm-steer: direct Triton launches are off (%s: %s)", type(e).__name__, e)


def _device_getter(get_current_device: Any) -> Any:
    """Triton's CUDA driver asks ``torch.cuda.current_device`` (a Python function with a lazy-init check, ~1 µs on
    the GPU host) on every launch; once a kernel has launched CUDA is initialized, and its C getter says the same."""
    if get_current_device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
        return torch._C._cuda_getDevice
    return get_current_device


def _direct(kernel: Any) -> Any:
    """``launch(grid, all_args)`` of a compiled kernel, as Triton's ``run`` does after its lookup, with what does not
    change between launches looked up once: the launcher, the function, its metadata, the driver's device and stream
    getters. Triton's ``CudaLauncher.__call__`` allocates its scratch and calls its C ``launch``; with no scratch
    (the steered norm's kernels) its C ``launch`` is called directly, one Python frame less."""
    run = kernel.run
    function, packed = kernel.function, kernel.packed_metadata
    active = driver.active
    device, stream_of = _device_getter(active.get_current_device), active.get_current_stream
    c_launch = getattr(run, "launch", None)
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        c_launch = None  # scratch to allocate: through CudaLauncher.__call__
    else:
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    hooks = knobs.runtime

    def launch(grid: tuple[int, ...], all_args: tuple) -> None:
        stream = stream_of(device())
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        # no hook: None (Triton < 3.5) or a HookChain with no calls
        if (enter is None or not getattr(enter, "calls", True)) and (
                leave is None or not getattr(leave, "calls", True)):
            enter = leave = meta = None
        else:
            meta = kernel.launch_metadata(grid, stream, *all_args)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        if c_launch is None:
            run(grid[0], g1, g2, stream, function, packed, meta, enter, leave, *all_args)
        else:
            c_launch(grid[0], g1, g2, stream, function, coop, pdl, None, None, packed, meta, enter, leave, *all_args)

    return launch
