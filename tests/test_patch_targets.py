"""Every vLLM internal the plugin patches (``vllm_steer.patches.PATCHES``) still has the parameters
the patch was written for, and every one it reads or calls (``USES``) is still there, so a vLLM
upgrade fails here, naming the internal and the version, instead of silently unsteering. Read in a
fresh process where no plugin has been loaded, so the originals are inspected."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from vllm_steer.patches import GENERAL_APPLIERS, PATCHES, SERVER_APPLIERS, USES, Use, use_problems

PROBE = """
import json
import vllm
from vllm_steer.patches import signature_problems, use_problems
print(json.dumps({"version": vllm.__version__, "problems": signature_problems(), "uses": use_problems()}))
"""


def test_vllm_internals_keep_their_signatures_and_members():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"VLLM_PLUGINS": "", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = found["problems"] + found["uses"]
    assert not problems, f"vLLM {found['version']}:\n" + "\n".join(problems)


def test_every_patch_has_an_owner_that_applies_it():
    """Each table row names a module whose applier is run by the plugin or the endpoint plugin."""
    applier_modules = {ref.split(":")[0] for ref in GENERAL_APPLIERS + SERVER_APPLIERS}
    owners = {p.owner for p in PATCHES}
    # the norm classes are subclassed at install time (runtime.install), reached through the runners
    assert owners - applier_modules <= {"vllm_steer.runtime.install"}, owners - applier_modules
    assert all(p.why and p.until for p in PATCHES)


def test_every_use_is_mentioned_by_its_owner():
    """The USES table cannot drift from the code: each owner module exists and names its member
    (every alternative of an any_of)."""
    from vllm_steer.runtime.families import SUPPORTED_LAYER_CLASSES

    assert all(u.kind in ("method", "attribute", "any_of") and u.why for u in USES)
    assert set(SUPPORTED_LAYER_CLASSES) <= {u.target.partition(":")[2] for u in USES}, "a family has no row"
    for u in USES:
        spec = importlib.util.find_spec(u.owner)
        assert spec is not None and spec.origin, f"{u.owner} (owner of {u.target} {u.member}) does not exist"
        source = Path(spec.origin).read_text()
        for member in u.member.split("|"):
            assert re.search(rf"\b{re.escape(member)}\b", source), f"{u.owner} never mentions {member} ({u.target})"


def test_use_problems_reports_what_is_missing():
    owner = "vllm_steer.engine.scheduler"
    fake = (
        Use("vllm.v1.request:Request", "no_such_member_x", "attribute", owner, "test"),
        Use("vllm.v1.core.sched.scheduler:Scheduler", "no_such_queue_a|no_such_queue_b", "any_of", owner, "test"),
        Use("vllm.v1.core.sched.request_queue:RequestQueue", "no_such_method_x", "method", owner, "test"),
        Use("vllm.v1.core.sched.request_queue:RequestQueue", "prepend_request", "method", owner, "test",
            ("self", "not_the_request")),
        Use("vllm.no_such_module:Request", "request_id", "attribute", owner, "test"),
    )
    found = use_problems(fake)
    assert len(found) == len(fake), found
    for u, line in zip(fake, found):
        assert u.target in line and u.member in line, line
    assert "none of them exists" in found[1] and "'not_the_request'" in found[3] and "missing" in found[4]
    # and the real alternatives, a real method with its parameters, pass
    assert not use_problems((
        Use("vllm.v1.core.sched.scheduler:Scheduler", "no_such_queue|waiting", "any_of", owner, "test"),
        Use("vllm.v1.core.sched.request_queue:RequestQueue", "prepend_request", "method", owner, "test",
            ("self", "request")),
    ))
