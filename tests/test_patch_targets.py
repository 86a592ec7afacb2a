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
import importlib, inspect, json, sys
import vllm
out = {"__version__": vllm.__version__}
for target in json.loads(sys.argv[1]):
    mod, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        out[target] = list(inspect.signature(obj).parameters) if callable(obj) and not isinstance(obj, type) else []
    except Exception as e:
        out[target] = f"missing: {type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_patched_vllm_internals_keep_their_signatures():
    targets = [p.target for p in PATCHES]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(targets)],
                          capture_output=True, text=True, timeout=300, env={"VLLM_PLUGINS": "", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    version = found.pop("__version__")
    bad = [f"{p.target} (vLLM {version}): expected leading parameters {list(p.params)}, found {found[p.target]}"
           for p in PATCHES
           if isinstance(found[p.target], str) or found[p.target][: len(p.params)] != list(p.params)]
    assert not bad, "\n".join(bad)


def test_every_patch_has_an_owner_that_applies_it():
    """Each table row names a module whose applier is run by the plugin or the endpoint plugin."""
    applier_modules = {ref.split(":")[0] for ref in GENERAL_APPLIERS + SERVER_APPLIERS}
    owners = {p.owner for p in PATCHES}
    # the norm classes are subclassed at install time (runtime.install), reached through the runners
    assert owners - applier_modules <= {"vllm_steer.runtime.install"}, owners - applier_modules
    assert all(p.why and p.until for p in PATCHES)
