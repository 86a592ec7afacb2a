"""Which files a runtime SAE registration may read (core/sae_paths.py, issue 30), without a server: the
policy itself, the API process's check (``runtime_entry``, what POST /v1/steering/sae and
``register_sae`` call before the engine is asked) and the worker's (``SaeTables.load_runtime``). Every
refusal for a path outside ``steer.sae_root`` (missing, escaping, not a regular file) is one message."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from tests.sae_writers import random_sae, write_gemma_scope, write_json, write_sae_lens
from vllm_steer.core.config import SaeModuleConfig, SteerConfig, parse_steer_config, SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import Slot, runtime_entry
from vllm_steer.core.sae_files import SaeFileError, read_sae_meta
from vllm_steer.core.sae_paths import DENIED, NO_ROOT, SaePathError, runtime_access
from vllm_steer.runtime.sae_tables import SaeTables
from vllm_steer.server.errors import error_body

D, F, LAYERS = 16, 32, 4
SITE, SLOTS = "post_mlp.1", {("post_mlp", 1): Slot(8)}


@pytest.fixture
def tree(tmp_path):
    """``root/`` (the sae_root) holding a Gemma Scope SAE and a sae-lens one, ``outside/`` beside it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    w = random_sae(D, F, "jumprelu", seed=1)
    write_gemma_scope(str(root / "gs"), w)
    write_gemma_scope(str(outside / "gs"), w)
    write_sae_lens(str(root / "lens"), random_sae(D, F, "relu", seed=2), hook_name="blocks.1.hook_resid_post")
    return root, outside


def _register(path: str, root, max_bytes: int = 1 << 30, site: str | None = SITE):
    cfg = SteerConfig.model_validate({"sae_root": None if root is None else str(root), "max_sae_bytes": max_bytes,
                                      "sae_slots": {SITE: 8}})
    c = SaeModuleConfig(path=path, site=site, features=(0, 1, 2, 3))
    return runtime_entry("rt", c, cfg, D, LAYERS, SLOTS, 7)


def _denied(path: str, root) -> str:
    with pytest.raises(SaePathError) as e:
        _register(path, root)
    assert error_body(403, str(e.value), "path")["error"]["type"] == "PermissionDeniedError"
    return str(e.value)


def test_a_file_inside_the_root_registers(tree):
    root, _ = tree
    assert set(_register(str(root / "gs"), root).sites) == {("post_mlp", 1)}
    assert set(_register(str(root / "gs" / "params.npz"), root).sites) == {("post_mlp", 1)}
    assert set(_register(str(root / "lens"), root, site=None).sites) == {("post_mlp", 1)}
    # '..' that stays inside the root is fine: the resolved path counts
    assert _register(str(root / "lens" / ".." / "gs"), root).sites


def test_every_path_outside_the_root_gets_one_answer(tree, tmp_path):
    root, outside = tree
    os.symlink(outside / "gs", root / "link")  # a symlink inside the root pointing outside
    os.mkfifo(root / "fifo")
    (root / "empty").mkdir()
    paths = [str(outside / "gs"), str(outside / "gs" / "params.npz"), str(root / "link"),
             str(root / "link" / "params.npz"), str(root / ".." / "outside" / "gs"), str(root / "missing"),
             str(root / "missing" / "params.npz"), "/dev/zero", str(root / "fifo"), "/etc/passwd",
             str(root / "gs" / "params.npz" / "x")]
    answers = {p: _denied(p, root) for p in paths}
    assert set(answers.values()) == {DENIED}, answers
    assert "steer.sae_root" in DENIED and str(root) not in DENIED


def test_an_inner_file_leaving_the_root_is_refused(tree):
    """A sae-lens folder inside the root whose cfg.json is a symlink to a file outside it."""
    root, outside = tree
    write_sae_lens(str(outside / "lens"), random_sae(D, F, "relu", seed=2), hook_name="blocks.1.hook_resid_post")
    os.makedirs(root / "mixed")
    os.symlink(outside / "lens" / "cfg.json", root / "mixed" / "cfg.json")
    os.link(root / "lens" / "sae_weights.safetensors", root / "mixed" / "sae_weights.safetensors")
    assert _denied(str(root / "mixed"), root) == DENIED
    assert read_sae_meta(str(root / "mixed"))  # the start-up reader (steer.sae) is not restricted
    # the same with a link to nothing: the answer never tells whether a file outside the root exists
    os.makedirs(root / "dangling")
    os.symlink(outside / "lens" / "no-such-cfg.json", root / "dangling" / "cfg.json")
    os.link(root / "lens" / "sae_weights.safetensors", root / "dangling" / "sae_weights.safetensors")
    assert _denied(str(root / "dangling"), root) == DENIED
    os.makedirs(root / "gs_dangling")
    os.symlink(outside / "no-such-params.npz", root / "gs_dangling" / "params.npz")
    assert _denied(str(root / "gs_dangling"), root) == _denied(str(root / "link"), root) == DENIED


def test_without_a_root_registration_by_path_is_off(tree):
    root, _ = tree
    message = _denied(str(root / "gs"), None)
    assert message == NO_ROOT and "steer.sae_root" in message


def test_a_file_over_the_cap_is_refused_before_it_is_read(tree, monkeypatch):
    root, _ = tree
    size = os.path.getsize(root / "gs" / "params.npz")
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: pytest.fail("a file over the cap was opened"))
    with pytest.raises(SteeringSpecError) as e:
        _register(str(root / "gs"), root, max_bytes=size - 1)
    assert e.value.field == "path" and f"over steer.max_sae_bytes ({size - 1})" in str(e.value)
    assert "gs/params.npz: file:" in str(e.value) and str(root) not in str(e.value)  # named relative to the root
    monkeypatch.undo()
    assert _register(str(root / "gs"), root, max_bytes=size).sites


def test_file_bytes_never_reach_the_message(tree):
    root, _ = tree
    secret = "SECRET-" + "x" * 200
    cfg = root / "lens" / "cfg.json"
    cfg.write_bytes(b'{"d_in": 16, "oops ' + secret.encode() + b"\xff")
    with pytest.raises(SteeringSpecError) as e:
        _register(str(root / "lens"), root, site=None)
    assert "SECRET" not in str(e.value) and "lens/cfg.json: file: not valid" in str(e.value)
    write_json(str(cfg), {"architecture": secret})
    with pytest.raises(SteeringSpecError) as e:
        _register(str(root / "lens"), root, site=None)
    assert "architecture" in str(e.value) and "x" * 41 not in str(e.value)


def test_a_header_length_beyond_the_file_is_refused_before_it_is_read(tree):
    root, _ = tree
    weights = root / "lens" / "sae_weights.safetensors"
    weights.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SteeringSpecError, match=r"sae_weights\.safetensors: header: .*oversized"):
        _register(str(root / "lens"), root, site=None)


def test_the_worker_checks_again(tree):
    """The worker's load goes through the same policy (defense in depth: the API process is not trusted)."""
    root, outside = tree
    tables = SaeTables({}, SLOTS, set(SLOTS), 4, D, torch.device("cpu"), runtime_access((str(root),), 1 << 30))
    for path in (str(outside / "gs"), "/dev/zero", str(root / "nope")):
        with pytest.raises(SaePathError, match="steer.sae_root"):
            tables.load_runtime(path, None, SITE, (0, 1), [("post_mlp", 1)])
    assert tables.load_runtime(str(root / "gs"), None, SITE, (0, 1), [("post_mlp", 1)]) == [("post_mlp", 1)]
    closed = SaeTables({}, SLOTS, set(SLOTS), 4, D, torch.device("cpu"), runtime_access(None, 1 << 30))
    with pytest.raises(SaePathError, match="off on this server"):
        closed.load_runtime(str(root / "gs"), None, SITE, (0, 1), [("post_mlp", 1)])
    # vLLM re-raises a worker's error as another type: the refusal is recognised in its text
    assert isinstance(SaePathError.within(RuntimeError(f"Worker failed: {DENIED}")), SaePathError)
    assert SaePathError.within(RuntimeError("other")) is None


def test_config_keys():
    cfg = parse_steer_config({"steer": {"sae_root": "/srv/saes"}})
    assert cfg.sae_root == ("/srv/saes",) and cfg.max_sae_bytes == 4 << 30
    assert parse_steer_config({"steer": {"sae_root": ["/a", "/b"]}}).sae_root == ("/a", "/b")
    for bad, key in (({"sae_root": "rel/dir"}, "sae_root"), ({"sae_root": []}, "sae_root"),
                     ({"sae_root": 5}, "sae_root"), ({"max_sae_bytes": 0}, "max_sae_bytes")):
        with pytest.raises(SteerConfigError, match=rf"steer\.{key}"):
            parse_steer_config({"steer": bad})


def test_the_refusal_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(SaePathError(NO_ROOT)))
    assert isinstance(e, SaePathError) and str(e) == NO_ROOT
    assert isinstance(pickle.loads(pickle.dumps(SaeFileError("/x", "file", "m"))), SaeFileError)
