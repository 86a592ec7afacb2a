"""The wheel ships every package of the source tree, the kernels included (as vllm_steer.kernels)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_package_is_in_the_wheel():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT / "src").parts) for p in (ROOT / "src").rglob("__init__.py")
    } | {
        ".".join(("vllm_steer", "kernels", *p.parent.relative_to(ROOT / "kernels").parts)) for p in (ROOT / "kernels").rglob("__init__.py")
    }
    assert on_disk == listed
    assert cfg["package-dir"]["vllm_steer.kernels"] == "kernels"
