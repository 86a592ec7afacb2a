"""Private site folders of plugin wheels, for the servers that run another plugin build.

``hotwire`` (the peer plugin hotwire-vllm, --peer-wheel): the wheel is installed (no dependencies, no index, no byte-compiling)
into ``<workdir>/<site>``, once per wheel; the server gets that folder first on PYTHONPATH, so its
package (and the entry point of its dist-info) shadows any installed one in that server process only.
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


def install_wheel(wheel: str | Path, site: Path, flag: str = "wheel") -> Path:
    """pip install --target ``site`` ``wheel`` unless that exact wheel is already there.
    ``flag`` names the option the wheel came from (error messages)."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise FileNotFoundError(f"{flag} {wheel}: no such file")
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
    log(f"{flag}: {' '.join(cmd)}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"installing {wheel} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    marker.write_text(json.dumps(want))
    log(f"{flag}: {wheel.name} installed in {site}")
    return site


def dist_version(site: Path, dist: str) -> str | None:
    """Version of the ``dist`` dist-info (e.g. vllm_steer, hotwire_vllm) in ``site`` (None if absent)."""
    for d in sorted(Path(site).glob(f"{dist}-*.dist-info")):
        meta = d / "METADATA"
        if meta.exists():
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        return d.name[len(dist) + 1:-len(".dist-info")]
    return None
