"""The tree shows which process a module runs in, and the imports keep to it.

Read from the source with ``ast`` (module-level and function-level imports alike), so a late
``import`` inside a function cannot sneak a front-end dependency into the worker.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "vllm_steer"
KERNELS = ROOT / "kernels"

# package -> the vllm_steer packages it may import (besides itself)
ALLOWED = {
    "core": set(),
    "kernels": set(),
    "capture": {"core"},
    "frontend": {"core", "capture"},
    "engine": {"core"},
    "runtime": {"core", "capture", "kernels"},
    "server": {"core", "capture", "frontend", "patches"},
    "client": {"core"},
}
TOP_LEVEL_PACKAGES = {"core", "kernels", "capture", "frontend", "engine", "runtime", "server"}


def _package_of(path: Path) -> str:
    if KERNELS in path.parents:
        return "kernels"
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_packages(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "vllm_steer" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))


def test_every_package_keeps_to_its_imports():
    bad = []
    for path in _sources():
        pkg = _package_of(path)
        if pkg not in ALLOWED:
            continue  # wiring modules (plugin, patches, launcher, __init__) may import anything
        for target, line in _imported_packages(path):
            if target in TOP_LEVEL_PACKAGES | {"patches", "client", "plugin"} and target != pkg \
                    and target not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {pkg} imports vllm_steer.{target}")
    assert not bad, "\n".join(bad)


def test_each_process_package_says_what_runs_there():
    for pkg in TOP_LEVEL_PACKAGES - {"kernels"}:
        doc = ast.get_docstring(ast.parse((SRC / pkg / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"vllm_steer/{pkg}/__init__.py needs a docstring saying what runs there"


def test_every_module_has_a_docstring():
    missing = [str(p.relative_to(ROOT)) for p in _sources()
               if p.stat().st_size and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing


def test_the_layout_check_sees_a_violation(tmp_path):
    """The checker itself: an import the rules forbid is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from vllm_steer.frontend.spec import parse_spec\n")
    assert ("frontend", 2) in _imported_packages(bad)


def test_pyproject_lists_every_package():
    """setuptools installs only the packages pyproject.toml names: a new package missing there works in an
    editable install (the test venv) and is absent from the wheel (the GPU lane, users)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("vllm_steer", *p.parent.relative_to(SRC).parts)) for p in SRC.rglob("__init__.py")}
    found |= {".".join(("vllm_steer.kernels", *p.parent.relative_to(ROOT / "kernels").parts))
              for p in (ROOT / "kernels").rglob("__init__.py")}
    assert found - listed == set(), f"pyproject.toml's packages miss {sorted(found - listed)}"
