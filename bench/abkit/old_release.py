"""The previous release of the plugin, for the ``steer_old`` server.

Its wheel is installed (no dependencies, no index, no byte-compiling) into ``<workdir>/old_site``,
once per wheel; the server gets that folder first on PYTHONPATH, so its ``vllm_steer`` (and the
entry point of its dist-info) shadows the installed one in that server process only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from .common import log


def _stamp(wheel: Path) -> dict:
    st = wheel.stat()
    return {"wheel": str(wheel.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}


def install_old_wheel(wheel: str | Path, workdir: Path) -> Path:
    """pip install --target <workdir>/old_site <wheel> unless that exact wheel is already there."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise FileNotFoundError(f"--old-wheel {wheel}: no such file")
    site = workdir / "old_site"
    marker = site / ".installed_from.json"
    want = _stamp(wheel)
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == want:
                return site
        except ValueError:
            pass
    if site.exists():
        shutil.rmtree(site)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
           "--target", str(site), str(wheel)]
    log(f"old release: {' '.join(cmd)}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"installing {wheel} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    marker.write_text(json.dumps(want))
    log(f"old release: vllm_steer {old_version(site)} installed in {site}")
    return site


def old_version(site: Path) -> str | None:
    """Version of the vllm_steer dist-info in ``site`` (None if not installed)."""
    for d in sorted(Path(site).glob("vllm_steer-*.dist-info")):
        meta = d / "METADATA"
        if meta.exists():
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        return d.name[len("vllm_steer-"):-len(".dist-info")]
    return None
