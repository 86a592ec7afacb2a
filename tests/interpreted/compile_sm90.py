"""pytest plugin (``-p tests.interpreted.compile_sm90``): every Triton kernel the interpreted tests launch is compiled
for an H100 (sm_90: Triton's own ptxas, a CUDA driver stood in for) and never launched, so a kernel that would not
compile on the GPU lane fails here, before a GPU session's time is spent on it. The tests' own asserts then fail
(nothing ran): only what this plugin writes counts. ``VLLM_STEER_SM90_OUT`` names a folder: ``compiled.txt`` (a
kernel name per compile call), ``compiles.txt`` (a kernel name per compile: Triton's cache missed), ``pdl.txt`` (a kernel
name per programmatic dependent launch compiled with its wait) and ``errors.txt`` (one block per distinct failure, with
its traceback).

Run it in a process of its own, without ``TRITON_INTERPRET`` set (Triton decorates its library once, at import):
the plugin turns the interpreter off and then sets the variable for the tests' skip marks and full_triton's
UPCAST (reset to False here: the GPU's dot path is the one compiled)."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

OUT = Path(os.environ.get("VLLM_STEER_SM90_OUT", "."))
TARGET = GPUTarget("cuda", 90, 32)
SHARED_MAX = 232448  # an H100's shared memory per block (227 KiB): more fails at its first launch

knobs.runtime.interpret = False
os.environ["TRITON_INTERPRET"] = "1"  # the tests' skip marks read it; the knob keeps its set value


class _CompileOnlyDriver:
    """What ``JITFunction.run`` asks of a driver before it compiles (a launch would need a real one)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET


driver.set_active(_CompileOnlyDriver())
_run = JITFunction.run
_errors: set[str] = set()


def _compile_only(self, *args, grid, warmup, **kwargs):
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
        shared = getattr(getattr(kernel, "metadata", None), "shared", 0)
        if shared > SHARED_MAX:
            _error(f"{self.__name__}: needs {shared} bytes of shared memory, an H100 has {SHARED_MAX} "
                   f"(constexprs {kwargs})")
        if kwargs.get("launch_pdl"):  # a programmatic dependent launch: launched so, and it waits (griddepcontrol)
            if kernel.metadata.launch_pdl and "griddepcontrol.wait" in kernel.asm["ptx"]:
                with open(OUT / "pdl.txt", "a") as f:
                    f.write(self.__name__ + "\n")
            else:
                _error(f"{self.__name__}: launch_pdl asked, the kernel has no PDL launch or no griddepcontrol.wait")
        return kernel
    except Exception as e:  # noqa: BLE001 - every failure is the answer
        _error(f"{self.__name__}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        raise
    finally:
        with open(OUT / "compiled.txt", "a") as f:
            f.write(self.__name__ + "\n")


def _error(text: str) -> None:
    if text not in _errors:
        _errors.add(text)
        with open(OUT / "errors.txt", "a") as f:
            f.write(text + "\n----\n")


JITFunction.run = _compile_only


def _count_compile(**kwargs) -> None:
    """Triton's hook after each compile (a cache miss: vLLM's JIT monitor hooks the same): a kernel name per line."""
    with open(OUT / "compiles.txt", "a") as f:
        f.write(getattr(kwargs.get("fn"), "name", "?") + "\n")


knobs.runtime.jit_post_compile_hook = _count_compile


def pytest_collection_modifyitems(session, config, items):
    import vllm_steer.kernels.sae_clamp.full_triton as full_triton

    full_triton._UPCAST = False
