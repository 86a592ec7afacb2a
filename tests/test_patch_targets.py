"""Every vLLM internal the plugin patches (``vllm_steer.patches.PATCHES``) still has the parameters
the patch was written for, so a vLLM upgrade fails here, naming the target and the version, instead
of silently unsteering. Read in a fresh process where no plugin has been loaded, so the originals
are inspected."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_steer.patches import GENERAL_APPLIERS, PATCHES, SERVER_APPLIERS

PROBE = """
import json
import vllm
from vllm_steer.patches import signature_problems
print(json.dumps({"version": vllm.__version__, "problems": signature_problems()}))
"""


def test_patched_vllm_internals_keep_their_signatures():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"VLLM_PLUGINS": "", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not found["problems"], f"vLLM {found['version']}:\n" + "\n".join(found["problems"])


def test_every_patch_has_an_owner_that_applies_it():
    """Each table row names a module whose applier is run by the plugin or the endpoint plugin."""
    applier_modules = {ref.split(":")[0] for ref in GENERAL_APPLIERS + SERVER_APPLIERS}
    owners = {p.owner for p in PATCHES}
    # the norm classes are subclassed at install time (runtime.install), reached through the runners
    assert owners - applier_modules <= {"vllm_steer.runtime.install"}, owners - applier_modules
    assert all(p.why and p.until for p in PATCHES)
