"""The filesystem consumer alone: publish is atomic (a killed writer leaves only .tmp files, which
the reader never shows), many concurrent requests each get their own complete files."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from vllm_steer.capture import filesystem as fsmod
from vllm_steer.capture.filesystem import CaptureWriteError, FilesystemConsumer, load_request


def _published(fut):
    """What the capture host does with ``on_request_finished``'s Future: wait until the request is published."""
    return fut.result(timeout=60) if fut is not None else None


def test_concurrent_requests_each_round_trip(tmp_path):
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=3, max_open=4)  # LRU smaller than live files
    rng = np.random.default_rng(0)
    expected = {}

    def run(i):
        rid = f"req-{i}"
        for step in range(5):
            for layer, hook in ((0, "pre_attn"), (1, "post_mlp")):
                rows = rng.standard_normal((2, 16)).astype(np.float32) + i
                expected.setdefault((rid, layer, hook), []).append(rows)
                fs.on_rows(rid, layer, hook, np.array([2 * step, 2 * step + 1]), rows, {})
        _published(fs.on_request_finished(rid, {"external_id": f"ext-{i}", "prompt_len": 3}))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i in range(12):
        got = load_request(str(tmp_path), f"ext-{i}")  # found by external id too
        for (layer, hook), (positions, rows) in got.items():
            np.testing.assert_array_equal(positions, np.arange(10))
            np.testing.assert_array_equal(rows, np.concatenate(expected[(f"req-{i}", layer, hook)]))
    assert not list(tmp_path.rglob("*.tmp"))


KILLED = """
import os, sys, time
import numpy as np
from vllm_steer.capture.filesystem import FilesystemConsumer
fs = FilesystemConsumer("fs", root=sys.argv[1], threads=1)
fs.on_rows("victim", 0, "pre_attn", np.arange(4), np.ones((4, 65536), np.float32), {})  # 1 MiB: written at once
deadline = time.monotonic() + 60
while not any(n.endswith(".bin.tmp") for _, _, names in os.walk(sys.argv[1]) for n in names):
    assert time.monotonic() < deadline, "the writer thread never wrote the .tmp file"
    time.sleep(0.01)
os._exit(9)  # killed before the request finished
"""


def test_a_killed_process_leaves_no_visible_partial_shard(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert list(tmp_path.rglob("*.bin.tmp"))  # the partial data exists, but only as .tmp
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("request.json"))
    with pytest.raises(FileNotFoundError, match="not published"):
        load_request(str(tmp_path), "victim")


# ---- full disk (issue 37 item 6b) -------------------------------------------------------------------

def _rows(n, d=16, seed=0):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


class _FullDisk:
    """``_write_all`` for the filesystem module: writes to row files (``.bin.tmp``; with ``only``, those whose
    path contains it) raise ENOSPC while ``full`` is set (small JSON files still fit, as on a disk that is
    nearly full)."""

    def __init__(self, only: str = ""):
        self.full, self.only, self.real = False, only, fsmod._write_all

    def __call__(self, fd, chunks):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if self.full and path.endswith(".bin.tmp") and self.only in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(fd, chunks)


def _status(root, rid):
    return json.loads((root / "default" / rid / "request.json").read_text())


def test_a_write_error_fails_only_its_request_and_later_ones_are_written(tmp_path, monkeypatch):
    """Injected ENOSPC: the request it hits is published as failed (error in request.json, no .tmp
    left, counted); the writer thread lives on and the next request is written once space returns."""
    disk = _FullDisk()
    monkeypatch.setattr(fsmod, "_write_all", disk)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    disk.full = True
    fs.on_rows("a", 0, "post_mlp", np.arange(4), _rows(4), {})
    fs.on_rows("a", 0, "post_mlp", np.arange(4, 8), _rows(4), {})  # skipped: the request already failed
    _published(fs.on_request_finished("a", {"prompt_len": 3}))  # returns once published: the writer did not die
    st = _status(tmp_path, "a")
    assert st["status"] == "failed" and "No space left" in st["error"], st
    with pytest.raises(CaptureWriteError, match="No space left"):
        load_request(str(tmp_path), "a")
    assert not list(tmp_path.rglob("*.tmp"))
    disk.full = False
    rows = _rows(6, seed=1)
    fs.on_rows("b", 1, "pre_attn", np.arange(6), rows, {})
    _published(fs.on_request_finished("b", {"prompt_len": 6}))
    assert _status(tmp_path, "b")["status"] == "complete"
    np.testing.assert_array_equal(load_request(str(tmp_path), "b")[(1, "pre_attn")][1], rows)
    assert fs.stats() == {"write_errors": 1, "dropped_writes": 0, "failed_requests": 1, "publish_timeouts": 0}
    fs.close()


def test_pipeline_stages_publish_one_request_json_when_the_last_stage_is_in(tmp_path, monkeypatch):
    """Two stages' instances (each its own sites): each writes ``stage-K.json``; ``request.json`` appears
    only with the last one, for the whole request (both stages' sites, merged status, ``stages``); a
    stage whose writes failed fails the request, naming that stage."""
    disk = _FullDisk()
    monkeypatch.setattr(fsmod, "_write_all", disk)
    stages = [FilesystemConsumer("fs", root=str(tmp_path), threads=1) for _ in range(2)]
    rows = _rows(3)

    def finish(stage, rid):
        _published(stages[stage].on_request_finished(rid, {"prompt_len": 3, "stage": stage, "stages": 2, "dropped": {},
                                                "dropped_rows": 0}))

    stages[1].on_rows("r", 1, "pre_attn", np.arange(3), rows, {})
    finish(1, "r")
    d = tmp_path / "default" / "r"
    assert (d / "stage-1.json").exists() and not (d / "request.json").exists()
    with pytest.raises(FileNotFoundError, match="not published"):
        load_request(str(tmp_path), "r")
    stages[0].on_rows("r", 0, "pre_attn", np.arange(3), rows + 1, {})
    finish(0, "r")
    info = _status(tmp_path, "r")
    assert {k: info[k] for k in ("status", "stages", "prompt_len", "dropped_rows")} == {
        "status": "complete", "stages": ["complete", "complete"], "prompt_len": 3, "dropped_rows": 0}
    assert "stage" not in info
    got = load_request(str(tmp_path), "r")
    np.testing.assert_array_equal(got[(0, "pre_attn")][1], rows + 1)
    np.testing.assert_array_equal(got[(1, "pre_attn")][1], rows)
    stages[0].on_rows("f", 0, "pre_attn", np.arange(3), rows, {})
    finish(0, "f")
    disk.full = True
    stages[1].on_rows("f", 1, "pre_attn", np.arange(3), rows, {})
    finish(1, "f")
    info = _status(tmp_path, "f")
    assert info["status"] == "failed" and info["stages"] == ["complete", "failed"], info
    assert info["error"].startswith("stage 1: OSError") and "No space left" in info["error"]
    with pytest.raises(CaptureWriteError, match="stage 1"):
        load_request(str(tmp_path), "f")
    for fs in stages:
        fs.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (we are root here and in CI), or None where the sandbox refuses the mount."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        yield None, proc.stderr.strip()
        return
    try:
        yield mnt, None
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_real_full_disk_fails_the_request_and_writing_resumes_when_space_returns(small_disk, monkeypatch, tmp_path):
    """A real full filesystem (a 1 MiB tmpfs filled by a filler file): the capture fails and is
    counted, no .tmp stays; once the filler is removed the next request is written. Where mounting is
    refused it falls back to the injected ENOSPC and says so."""
    mnt, refused = small_disk
    disk = None
    if mnt is None:
        warnings.warn(f"mount -t tmpfs refused ({refused}): full disk injected instead")
        mnt, disk = tmp_path, _FullDisk()
        monkeypatch.setattr(fsmod, "_write_all", disk)
        disk.full = True
    else:
        filler = mnt / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    fs = FilesystemConsumer("fs", root=str(mnt), threads=2, max_open=1)
    for step in range(4):
        fs.on_rows("a", 0, "post_mlp", np.arange(step * 64, (step + 1) * 64), _rows(64, 256, step), {})
    _published(fs.on_request_finished("a", {"prompt_len": 64}))
    with pytest.raises((FileNotFoundError, CaptureWriteError)):  # request.json itself may not fit
        load_request(str(mnt), "a")
    assert not list(mnt.rglob("*.tmp"))
    assert fs.stats()["write_errors"] >= 1 and fs.stats()["failed_requests"] == 1
    if disk is not None:
        disk.full = False
    else:
        filler.unlink()
    rows = _rows(64, 256, 9)
    fs.on_rows("b", 0, "post_mlp", np.arange(64), rows, {})
    _published(fs.on_request_finished("b", {"prompt_len": 64}))
    np.testing.assert_array_equal(load_request(str(mnt), "b")[(0, "post_mlp")][1], rows)
    fs.close()


def test_queued_rows_are_bounded_and_a_late_publication_is_counted(tmp_path, monkeypatch):
    """A stuck writer: rows past max_queued_mb are dropped (counted, named in request.json, which
    says partial); on_request_finished returns at once with a Future the writer completes when it has
    published; a publication later than publish_timeout_s after the finish is counted."""
    gate = _held_appends(monkeypatch)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1, max_queued_mb=1000 / 2**20, publish_timeout_s=0.1,
                            max_wait_s=0.2)
    kept = []
    for step in range(4):  # 16 rows x 16 floats = 1024 bytes each: the first fits, the rest do not
        rows = _rows(16, seed=step)
        fs.on_rows("r", 2, "post_attn", np.arange(step * 16, (step + 1) * 16), rows, {})
        kept.append(rows)
    fut = fs.on_request_finished("r", {"prompt_len": 8, "dropped": {"post_attn.2": [99]}, "dropped_rows": 1})
    with pytest.raises(TimeoutError):  # the writer is stuck: not published yet
        fut.result(timeout=0.3)
    assert fs.stats()["publish_timeouts"] == 0 and fs.stats()["dropped_writes"] == 3
    assert not (tmp_path / "default" / "r" / "request.json").exists()
    gate.set()
    assert fut.result(timeout=30) is None and (tmp_path / "default" / "r" / "request.json").exists()
    assert fs.stats()["publish_timeouts"] == 1  # published 0.3 s after the finish: over publish_timeout_s
    fs.close()
    st = _status(tmp_path, "r")
    assert st["status"] == "partial" and st["dropped"] == {"post_attn.2": list(range(16, 64)) + [99]}
    assert st["dropped_rows"] == 49
    positions, rows = load_request(str(tmp_path), "r")[(2, "post_attn")]
    np.testing.assert_array_equal(positions, np.arange(16))
    np.testing.assert_array_equal(rows, kept[0])


def test_a_step_waits_for_slow_writers_instead_of_dropping(tmp_path, monkeypatch):
    """Writers slower than the rows but moving: a step that finds the queue full waits for room (up to
    ``max_wait_s``), so nothing is dropped and every row is in its file, in order."""
    real_append = fsmod._Writer.append

    def slow_append(self, *args):
        time.sleep(0.05)
        real_append(self, *args)

    monkeypatch.setattr(fsmod._Writer, "append", slow_append)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1, max_queued_mb=2048 / 2**20, max_wait_s=10)
    kept = [_rows(16, seed=step) for step in range(8)]  # 1024 bytes a step: two fit in the queue
    for step, rows in enumerate(kept):
        fs.on_rows("r", 2, "post_attn", np.arange(step * 16, (step + 1) * 16), rows, {})
    _published(fs.on_request_finished("r", {"prompt_len": 8}))
    fs.close()
    assert fs.stats()["dropped_writes"] == 0 and _status(tmp_path, "r")["status"] == "complete"
    positions, rows = load_request(str(tmp_path), "r")[(2, "post_attn")]
    np.testing.assert_array_equal(positions, np.arange(128))
    np.testing.assert_array_equal(rows, np.concatenate(kept))


def test_gathered_steps_give_back_exactly_the_bytes_they_took(tmp_path):
    """Many small steps gathered into one flush (regrouped per file by the writers): once written, the queue's
    byte count is back to zero, so the bound keeps bounding."""
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=2, max_queued_mb=1)
    for step in range(40):  # 40 steps x 3 files x 2 rows x 64 B: far below a flush, so one multi-step flush
        for rid, layer in (("a", 0), ("a", 1), ("b", 0)):
            fs.on_rows(rid, layer, "post_mlp", np.arange(2 * step, 2 * step + 2), _rows(2, seed=step), {})
    assert fs._budget.used == 40 * 3 * 2 * 64
    for rid in ("a", "b"):
        _published(fs.on_request_finished(rid, {"prompt_len": 4}))
    assert fs._budget.used == 0
    assert load_request(str(tmp_path), "a")[(1, "post_mlp")][0].tolist() == list(range(80))
    fs.close()


# ---- format "sae_lens" (issue 37 item 5) --------------------------------------------------------------

def _sae_capture(root, context=4, shard_mb=None):
    """Three requests at two sites, published, then closed; returns {hook_name: packed rows}."""
    d = 8
    shard_mb = shard_mb if shard_mb is not None else 3 * context * d * 4 / 2**20  # 3 windows a shard
    fs = FilesystemConsumer("fs", root=str(root), threads=2, format="sae_lens", context_size=context, shard_mb=shard_mb)
    packed = {"blocks.1.hook_resid_post": [], "blocks.0.hook_resid_pre": []}
    for i, n in enumerate((7, 12, 9)):
        rows = _rows(n, d, seed=i)
        other = _rows(n, d, seed=10 + i)
        fs.on_rows(f"r{i}", 1, "post_mlp", np.arange(n - 3), rows[: n - 3], {})
        fs.on_rows(f"r{i}", 1, "post_mlp", np.arange(n - 3, n), rows[n - 3 :], {})
        fs.on_rows(f"r{i}", 0, "pre_attn", np.arange(n), other, {})
        _published(fs.on_request_finished(f"r{i}", {"prompt_len": n}))  # published in this order
        packed["blocks.1.hook_resid_post"].append(rows)
        packed["blocks.0.hook_resid_pre"].append(other)
        assert _status(root, f"r{i}")["status"] == "complete"
    fs.close()
    return {k: np.concatenate(v) for k, v in packed.items()}


def test_sae_lens_format_has_the_layout_sae_lens_reads(tmp_path):
    """The layout read from sae-lens 6.x's source: ``sae_lens/cache_activations_runner.py``
    (``CacheActivationsRunner.__init__``: features ``{hook_name: Array2D(shape=(context_size, d_in),
    dtype)}``, ``token_ids`` optional; ``_consolidate_shards``: ``dataset_info.json``, ``state.json``
    whose ``_data_files`` name the arrow files) and ``sae_lens/training/activations_store.py``
    (``load_cached_activation_dataset``: ``datasets.load_from_disk``, the column named ``hook_name``
    with feature shape ``(context_size, d_in)``; ``_load_buffer_from_cached``: rows are context
    windows; 6.5x's ``_load_raw_llm_batch_from_cached`` the same). Checked with pyarrow and numpy alone (what CI has), windows = tokens packed in publish order."""
    import pyarrow as pa

    context = 4
    packed = _sae_capture(tmp_path, context)
    for name, tokens in packed.items():
        d = tmp_path / "default" / "sae_lens" / name
        info = json.loads((d / "dataset_info.json").read_text())
        assert info["features"] == {name: {"shape": [context, 8], "dtype": "float32", "_type": "Array2D"}}
        state = json.loads((d / "state.json").read_text())
        files = [f["filename"] for f in state["_data_files"]]
        assert len(files) == 3 and all((d / f).exists() for f in files)  # 28 tokens: 3 + 3 + 1 windows
        windows = len(tokens) // context
        expect = tokens[: windows * context].reshape(windows, context, 8)
        table = pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(d / f))).read_all() for f in files])
        assert table.column_names == [name]
        assert table.schema.field(name).metadata == {  # datasets' Array2DExtensionType, as save_to_disk writes it
            b"ARROW:extension:name": b"datasets.features.features.Array2DExtensionType",
            b"ARROW:extension:metadata": json.dumps([[context, 8], "float32"]).encode()}
        assert json.loads(table.schema.metadata[b"huggingface"])["info"]["features"] == info["features"]
        np.testing.assert_array_equal(np.array(table.column(name).to_pylist(), np.float32), expect)
        # numpy alone, the two lines of examples/capture_sae_lens.py
        s = json.loads((d / "index.json").read_text())["shards"][0]
        acts = np.memmap(d / s["file"], np.float32, "r", s["offset"], (s["windows"], context, 8))
        np.testing.assert_array_equal(acts, expect[:3])
        assert json.loads((d / "index.json").read_text())["dropped_tail_tokens"] == len(tokens) % context
    req = _status(tmp_path, "r1")["sae_lens"]["post_mlp.1"]
    assert req == {"hook_name": "blocks.1.hook_resid_post", "first_token": 7, "tokens": 12}


def test_sae_lens_format_loads_with_sae_lens(tmp_path):
    """sae-lens's own reader (ActivationsStore.load_cached_activation_dataset and
    _load_raw_llm_batch_from_cached, 6.1x's _load_buffer_from_cached; called on a stand-in for the
    store: they read only these attributes)
    returns the captured windows. Needs sae-lens installed (not in the CI lock: its dependency tree
    is large); here it ran with sae-lens 6.54.12."""
    pytest.importorskip("sae_lens")
    import torch
    from types import SimpleNamespace

    from sae_lens.training.activations_store import ActivationsStore

    context = 4
    packed = _sae_capture(tmp_path, context)
    name = "blocks.1.hook_resid_post"
    store = SimpleNamespace(cached_activations_path=str(tmp_path / "default" / "sae_lens" / name), hook_name=name,
                            context_size=context, d_in=8, device=torch.device("cpu"), dtype=torch.float32)
    store.cached_activation_dataset = ActivationsStore.load_cached_activation_dataset(store)
    assert len(store.cached_activation_dataset) == 7
    if hasattr(ActivationsStore, "_load_raw_llm_batch_from_cached"):  # sae-lens 6.5x
        store.store_batch_size_prompts = 5
        acts, token_ids = ActivationsStore._load_raw_llm_batch_from_cached(store, raise_on_epoch_end=True)
    else:  # sae-lens 6.1x
        acts, token_ids = ActivationsStore._load_buffer_from_cached(store, 5, context, 8, raise_on_epoch_end=True)
    assert token_ids is None
    np.testing.assert_array_equal(acts.numpy(), packed[name][: 5 * context])


def test_write_errors_reach_the_metrics(tmp_path, monkeypatch):
    """The consumer's counters (its ``stats()``, which the capture host sends to the worker: tested in
    test_capture_lanes) become engine totals (metrics_rpc.worker_values) and Prometheus counters (apply_engine)."""
    from prometheus_client import REGISTRY

    from vllm_steer.engine.metrics_rpc import worker_values
    from vllm_steer.server.metrics import apply_engine

    disk = _FullDisk()
    monkeypatch.setattr(fsmod, "_write_all", disk)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    disk.full = True
    fs.on_rows("a", 0, "post_mlp", np.arange(2), _rows(2), {})
    _published(fs.on_request_finished("a", {"prompt_len": 2}))
    status = {"rows": 2, "consumer_errors": 0, **fs.stats()}
    assert status["write_errors"] == 1 and status["failed_requests"] == 1
    _, totals = worker_values([{"steering": True, "live_configs": 0, "peak_live_configs": 0, "capture": status}])
    assert totals["capture_write_errors"] == 1 and totals["capture_failed_requests"] == 1
    before = REGISTRY.get_sample_value("vllm_steer_capture_write_errors_total") or 0.0
    apply_engine({"increments": totals})
    assert REGISTRY.get_sample_value("vllm_steer_capture_write_errors_total") == before + 1
    fs.close()


def test_sae_lens_windows_of_a_quiet_consumer_reach_the_disk(tmp_path):
    """Whole windows buffered longer than flush_s are written by the idle writer, without close()
    (a server never closes its consumers); the tail shorter than a window stays buffered."""
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1, format="sae_lens", context_size=4, flush_s=0.05)
    rows = _rows(9, 8)
    fs.on_rows("q", 2, "post_mlp", np.arange(9), rows, {})
    _published(fs.on_request_finished("q", {"prompt_len": 9}))
    state = tmp_path / "default" / "sae_lens" / "blocks.2.hook_resid_post" / "state.json"
    deadline = time.monotonic() + 60
    while not state.exists():
        assert time.monotonic() < deadline, "the idle writer never wrote the buffered windows"
        time.sleep(0.02)
    d = state.parent
    s = json.loads((d / "index.json").read_text())["shards"]
    assert [x["windows"] for x in s] == [2]
    acts = np.memmap(d / s[0]["file"], np.float32, "r", s[0]["offset"], (2, 4, 8))
    np.testing.assert_array_equal(acts.reshape(8, 8), rows[:8])
    fs.close()


def test_a_publish_that_fails_midway_leaves_no_shard_of_the_request(tmp_path, monkeypatch):
    """A rename that fails at the second shard (after the batch's sync): the first shard, already renamed into
    place, is removed with the rest; request.json says failed."""
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("1_post_mlp.bin"):
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    for layer in (0, 1):
        fs.on_rows("m", layer, "post_mlp", np.arange(3), _rows(3, seed=layer), {})
    monkeypatch.setattr(fsmod.os, "replace", replace)
    _published(fs.on_request_finished("m", {"prompt_len": 3}))
    monkeypatch.setattr(fsmod.os, "replace", real_replace)
    st = _status(tmp_path, "m")
    assert st["status"] == "failed" and "Input/output error" in st["error"], st
    assert sorted(p.name for p in (tmp_path / "default" / "m").iterdir()) == ["request.json"]
    assert fs.stats()["write_errors"] == 1 and fs.stats()["failed_requests"] == 1
    fs.close()


def test_bf16_rows_are_written_as_bf16_and_read_back_exactly(tmp_path):
    """bf16 rows arrive as their bits (``raw_rows``, ``meta["dtype"]``): the file holds 2 bytes a value,
    the sidecar says ``bfloat16``, ``load_request`` gives float32 (exact) or torch bf16, the documented
    two numpy lines read the same values; the sae_lens format stores them as float32."""
    import torch

    rows = torch.randn(6, 16).to(torch.bfloat16)
    bits = rows.view(torch.int16).numpy().view(np.uint16)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    fs.on_rows("r", 3, "post_mlp", np.arange(3), bits[:3], {"dtype": "bfloat16"})
    fs.on_rows("r", 3, "post_mlp", np.arange(3, 6), bits[3:], {"dtype": "bfloat16"})
    _published(fs.on_request_finished("r", {"prompt_len": 6}))
    fs.close()
    side = json.loads((tmp_path / "default" / "r" / "3_post_mlp.json").read_text())
    assert side["dtype"] == "bfloat16" and side["shape"] == [6, 16]
    path = tmp_path / "default" / "r" / "3_post_mlp.bin"
    assert path.stat().st_size == 6 * 16 * 2
    positions, got = load_request(str(tmp_path), "r")[(3, "post_mlp")]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, rows.float().numpy())
    np.testing.assert_array_equal(positions, np.arange(6))
    t = load_request(str(tmp_path), "r", torch=True)[(3, "post_mlp")][1]
    assert t.dtype == torch.bfloat16 and torch.equal(t, rows)
    b = np.fromfile(path, np.uint16).reshape(side["shape"])  # the two lines in the module's docstring
    np.testing.assert_array_equal((b.astype(np.uint32) << 16).view(np.float32), rows.float().numpy())
    sae = FilesystemConsumer("sae", root=str(tmp_path / "sae"), threads=1, format="sae_lens", context_size=2)
    sae.on_rows("r", 3, "post_mlp", np.arange(6), bits, {"dtype": "bfloat16"})
    _published(sae.on_request_finished("r", {"prompt_len": 6}))
    sae.close()
    d = tmp_path / "sae" / "default" / "sae_lens" / "blocks.3.hook_resid_post"
    s = json.loads((d / "index.json").read_text())["shards"][0]
    acts = np.memmap(d / s["file"], np.float32, "r", s["offset"], (s["windows"], 2, 16))
    np.testing.assert_array_equal(np.asarray(acts).reshape(-1, 16), rows.float().numpy()[: s["windows"] * 2])


@pytest.mark.parametrize("fsync", [True, "files", "false"])
def test_fsync_modes(tmp_path, monkeypatch, fsync):
    """``fsync`` (a param may come as a string): true: one ``syncfs`` per batch of publications and no per-file
    fsync; ``"files"``: every shard, sidecar and record fsynced; ``false``: neither. Files appear whole either way
    (renamed into place once complete) with their request.json."""
    synced, syncfs = [], []
    real, real_syncfs = fsmod.os.fsync, fsmod._syncfs
    monkeypatch.setattr(fsmod.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    monkeypatch.setattr(fsmod, "_syncfs", lambda fd: (syncfs.append(fd), real_syncfs(fd)))
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=2, fsync=fsync)
    rows = np.arange(32, dtype=np.float32).reshape(2, 16)
    for i in range(3):
        fs.on_rows(f"r{i}", 1, "post_mlp", np.array([0, 1]), rows + i, {})
        _published(fs.on_request_finished(f"r{i}", {"prompt_len": 2}))
    for i in range(3):
        positions, got = load_request(str(tmp_path), f"r{i}")[(1, "post_mlp")]
        np.testing.assert_array_equal(got, rows + i)
        assert json.loads((tmp_path / "default" / f"r{i}" / "request.json").read_text())["status"] == "complete"
    assert not list(tmp_path.rglob("*.tmp"))
    if fsync is True:
        assert 1 <= len(syncfs) <= 3 and not synced  # each request published alone here: at most one each
    elif fsync == "files":
        assert len(synced) == 9 and not syncfs  # per request: the shard, its sidecar, request.json
    else:
        assert not synced and not syncfs
    fs.close()
    with pytest.raises(ValueError, match="fsync must be"):
        FilesystemConsumer("fs", root=str(tmp_path), fsync="sometimes")


def _held_appends(monkeypatch) -> threading.Event:
    """The writers' appends wait (up to 60 s) until the returned event is set: a stuck writer."""
    gate = threading.Event()
    real_append = fsmod._Writer.append

    def append(self, *args):
        gate.wait(60)
        real_append(self, *args)

    monkeypatch.setattr(fsmod._Writer, "append", append)
    return gate


def _blocked_writer(monkeypatch):
    """Holds the writer's first append until the returned event is set (so publications queue up behind it and
    are committed as one batch: BATCH_S made long enough for a slow machine)."""
    gate = _held_appends(monkeypatch)
    monkeypatch.setattr(fsmod, "BATCH_S", 600.0)
    return gate


def test_requests_finishing_together_share_one_sync_and_nothing_is_published_before_it(tmp_path, monkeypatch):
    """Five requests queued behind a busy writer: one ``syncfs`` makes all their bytes durable, and at that moment
    none of their shards, sidecars or records is in place yet (only ``.tmp`` files); after it all are published."""
    gate = _blocked_writer(monkeypatch)
    seen = []
    real_syncfs = fsmod._syncfs

    def syncfs(fd):
        seen.append(sorted(p.name for p in tmp_path.rglob("*") if p.is_file()))
        real_syncfs(fd)

    monkeypatch.setattr(fsmod, "_syncfs", syncfs)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    futs = []
    for i in range(5):
        for layer in (0, 3):
            fs.on_rows(f"r{i}", layer, "post_mlp", np.arange(4), _rows(4, seed=10 * i + layer), {})
        futs.append(fs.on_request_finished(f"r{i}", {"prompt_len": 4}))
    gate.set()
    for f in futs:
        _published(f)
    assert len(seen) == 1, seen  # one sync for the batch
    assert seen[0] and all(name.endswith(".tmp") for name in seen[0]), seen[0]
    assert len(seen[0]) == 5 * (2 + 2 + 1)  # per request: 2 shards, 2 sidecars, the record
    for i in range(5):
        got = load_request(str(tmp_path), f"r{i}")
        for layer in (0, 3):
            np.testing.assert_array_equal(got[(layer, "post_mlp")][1], _rows(4, seed=10 * i + layer))
    assert not list(tmp_path.rglob("*.tmp"))
    fs.close()


def test_a_write_error_in_one_request_of_a_batch_fails_only_that_request(tmp_path, monkeypatch):
    """ENOSPC on one request's shard while it shares a batch with others: it is published as failed (no shard
    left), the others of the batch complete."""
    gate = _blocked_writer(monkeypatch)
    disk = _FullDisk(only="/bad/")
    monkeypatch.setattr(fsmod, "_write_all", disk)
    disk.full = True
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    futs = []
    for rid in ("ok1", "bad", "ok2"):
        fs.on_rows(rid, 0, "post_mlp", np.arange(3), _rows(3), {})
        futs.append(fs.on_request_finished(rid, {"prompt_len": 3}))
    gate.set()
    for f in futs:
        _published(f)
    assert _status(tmp_path, "bad")["status"] == "failed"
    assert sorted(p.name for p in (tmp_path / "default" / "bad").iterdir()) == ["request.json"]
    for rid in ("ok1", "ok2"):
        assert _status(tmp_path, rid)["status"] == "complete"
        np.testing.assert_array_equal(load_request(str(tmp_path), rid)[(0, "post_mlp")][1], _rows(3))
    assert fs.stats()["write_errors"] == 1 and fs.stats()["failed_requests"] == 1
    fs.close()


def test_a_failed_sync_fails_its_whole_batch_and_the_next_batch_is_written(tmp_path, monkeypatch):
    """``syncfs`` reporting EIO: it cannot say whose bytes were lost, so every request of that batch is published
    as failed (files removed, counted); the next request, synced fine, completes."""
    gate = _blocked_writer(monkeypatch)
    broken = [True]
    real_syncfs = fsmod._syncfs

    def syncfs(fd):
        if broken[0]:
            raise OSError(errno.EIO, "Input/output error")
        real_syncfs(fd)

    monkeypatch.setattr(fsmod, "_syncfs", syncfs)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    futs = []
    for rid in ("a", "b"):
        fs.on_rows(rid, 0, "post_mlp", np.arange(3), _rows(3), {})
        futs.append(fs.on_request_finished(rid, {"prompt_len": 3}))
    gate.set()
    for f in futs:
        _published(f)
    for rid in ("a", "b"):
        st = _status(tmp_path, rid)
        assert st["status"] == "failed" and "Input/output error" in st["error"], st
        assert sorted(p.name for p in (tmp_path / "default" / rid).iterdir()) == ["request.json"]
        with pytest.raises(CaptureWriteError):
            load_request(str(tmp_path), rid)
    assert fs.stats()["write_errors"] == 2 and fs.stats()["failed_requests"] == 2
    broken[0] = False
    fs.on_rows("c", 0, "post_mlp", np.arange(3), _rows(3), {})
    _published(fs.on_request_finished("c", {"prompt_len": 3}))
    assert _status(tmp_path, "c")["status"] == "complete"
    fs.close()


def test_sidecar_positions_range_round_trips_and_old_sidecars_load(tmp_path):
    """Contiguous positions are written as ``positions_range`` (a constant size), others as the list; both load
    back through ``load_request``, and so does a sidecar of the earlier format (``positions`` always a list)."""
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    fs.on_rows("r", 0, "post_mlp", np.arange(5, 9), _rows(4), {})
    fs.on_rows("r", 0, "post_mlp", np.arange(9, 12), _rows(3, seed=1), {})
    fs.on_rows("r", 1, "post_mlp", np.array([0, 2, 3]), _rows(3, seed=2), {})
    fs.on_rows("r", 2, "post_mlp", np.array([7]), _rows(1, seed=3), {})
    _published(fs.on_request_finished("r", {"prompt_len": 12}))
    fs.close()
    d = tmp_path / "default" / "r"
    sides = {k: json.loads((d / f"{k}_post_mlp.json").read_text()) for k in (0, 1, 2)}
    assert sides[0]["positions_range"] == [5, 12] and "positions" not in sides[0]
    assert sides[1]["positions"] == [0, 2, 3] and "positions_range" not in sides[1]
    assert sides[2]["positions_range"] == [7, 8]
    got = load_request(str(tmp_path), "r")
    np.testing.assert_array_equal(got[(0, "post_mlp")][0], np.arange(5, 12))
    np.testing.assert_array_equal(got[(0, "post_mlp")][1], np.concatenate([_rows(4), _rows(3, seed=1)]))
    np.testing.assert_array_equal(got[(1, "post_mlp")][0], [0, 2, 3])
    np.testing.assert_array_equal(got[(2, "post_mlp")][0], [7])
    old = {k: v for k, v in sides[0].items() if k != "positions_range"}  # as earlier versions wrote it
    (d / "0_post_mlp.json").write_text(json.dumps({**old, "positions": list(range(5, 12))}))
    np.testing.assert_array_equal(load_request(str(tmp_path), "r")[(0, "post_mlp")][0], np.arange(5, 12))


def test_short_writes_are_finished(tmp_path, monkeypatch):
    """``os.writev`` may write less than asked (over 2 GiB, a nearly full disk): the rest is written after it."""
    real_writev = os.writev

    def short_writev(fd, bufs):
        return real_writev(fd, [bytes(bufs[0])[:3]])  # 3 bytes of the first view only

    monkeypatch.setattr(fsmod.os, "writev", short_writev)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    views = [memoryview(b"abcdef"), memoryview(b""), memoryview(b"ghij")] * 700  # more than IOV_MAX views
    fsmod._write_all(fd, views)
    os.close(fd)
    assert path.read_bytes() == b"abcdefghij" * 700


def test_blocks_are_written_straight_from_the_arena_in_row_order(tmp_path):
    """Rows big enough to be written as views (``Block.chunks``: one per run of consecutive rows, no gather
    copy): a prompt's runs then decode steps interleaving two requests x two sites, gathered into multi-packet
    flushes, read back in order; ``chunks`` holds the same bytes as ``materialize`` for every block."""
    from vllm_steer.capture.fs_gather import MIN_RUN_BYTES, StepGather

    d = 1024  # float32: 4 KiB rows, over MIN_RUN_BYTES
    assert 4 * d >= MIN_RUN_BYTES
    g = StepGather(1 << 30)
    rng = np.random.default_rng(3)
    g.add(["a", "b"], [("post_mlp", 0), ("post_mlp", 0)], np.array([0, 3]), np.array([3, 5]), np.arange(5),
          rng.standard_normal((5, d)).astype(np.float32), arena_rows=64)
    for step in range(4):
        g.add(["a", "a", "b"], [("post_mlp", 0), ("post_mlp", 1), ("post_mlp", 0)], np.arange(3), np.arange(1, 4),
              np.full(3, 10 + step), rng.standard_normal((3, d)).astype(np.float32), arena_rows=64)
    blocks = g.flush()
    assert len(blocks) == 3
    for b in blocks:
        chunks = b.chunks()
        assert all(isinstance(c, memoryview) for c in chunks)
        assert b"".join(bytes(c) for c in chunks) == b.materialize().tobytes()
    a0 = next(b for b in blocks if (b.request_id, b.layer) == ("a", 0))
    assert [len(c) for c in a0.chunks()] == [3 * 4 * d] + [4 * d] * 4  # the prompt's rows in one view, then a row a step

    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=2, max_open=1)  # reopened as the LRU turns
    expected = {}
    for step in range(6):
        for rid in ("x", "y"):
            for layer in (0, 1):
                n = 3 if step == 0 else 1  # a prompt of 3, then one token a step
                rows = rng.standard_normal((n, d)).astype(np.float32)
                pos = np.arange(n) if step == 0 else np.array([2 + step])
                expected.setdefault((rid, layer), []).append(rows)
                fs.on_rows(rid, layer, "post_mlp", pos, rows, {})
    for rid in ("x", "y"):
        _published(fs.on_request_finished(rid, {"prompt_len": 3}))
    fs.close()
    for rid in ("x", "y"):
        got = load_request(str(tmp_path), rid)
        for layer in (0, 1):
            np.testing.assert_array_equal(got[(layer, "post_mlp")][0], np.arange(8))
            np.testing.assert_array_equal(got[(layer, "post_mlp")][1], np.concatenate(expected[(rid, layer)]))


def test_a_request_that_does_not_wait_is_answered_at_once_and_published_behind(tmp_path, monkeypatch):
    """``"wait": false``: on_request_finished returns None (nothing for the response to wait on) while the writer is
    stuck, and the request is published all the same once it moves; the key is the consumer's only per-request one."""
    gate = _held_appends(monkeypatch)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    rows = _rows(4)
    fs.on_rows("r", 1, "post_mlp", np.arange(4), rows, {})
    assert fs.on_request_finished("r", {"prompt_len": 4, "params": {"wait": False}}) is None
    assert not (tmp_path / "default" / "r" / "request.json").exists()  # the writer has not moved yet
    gate.set()
    deadline = time.monotonic() + 30
    while not (tmp_path / "default" / "r" / "request.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    fs.close()
    assert _status(tmp_path, "r")["status"] == "complete"
    np.testing.assert_array_equal(load_request(str(tmp_path), "r")[(1, "post_mlp")][1], rows)
    FilesystemConsumer.validate_params({"wait": False})
    with pytest.raises(ValueError, match="wait must be true or false"):
        FilesystemConsumer.validate_params({"wait": "no"})
    with pytest.raises(ValueError, match="only per-request key is 'wait'"):
        FilesystemConsumer.validate_params({"colour": "red"})


def test_a_request_end_flushes_only_its_rows_and_arenas_are_reused(tmp_path):
    """``StepGather.flush(request)`` hands out that request's rows only (the others stay gathered, flushed later in
    order); the arena is filled on past a flush without touching the rows its blocks view, and once no block views
    an arena the pool hands it out again: a steady capture allocates nothing."""
    from vllm_steer.capture.fs_gather import StepGather

    d = 1024  # float32: 4 KiB rows, written as views
    g = StepGather(1 << 30)
    rng = np.random.default_rng(5)
    sent: dict = {}

    def step(rids, k):
        data = rng.standard_normal((2 * len(rids), d)).astype(np.float32)
        sites = [s for _ in rids for s in (("post_mlp", 0), ("post_mlp", 1))]
        groups = [r for r in rids for _ in range(2)]
        for (hook, layer), rid, row in zip(sites, groups, data):
            sent.setdefault((rid, layer), []).append(row)
        g.add(groups, sites, np.arange(len(groups)), np.arange(1, len(groups) + 1), np.full(len(groups), k), data,
              arena_rows=64)

    for k in range(3):
        step(["a", "b"], k)
    mine = g.flush("a")
    assert sorted((b.request_id, b.layer) for b in mine) == [("a", 0), ("a", 1)]
    assert g.nbytes == 3 * 2 * 4 * d  # b's rows stay gathered
    first = {(b.request_id, b.layer): b"".join(bytes(c) for c in b.chunks()) for b in mine}
    for k in range(3, 5):
        step(["b"], k)
    rest = g.flush()
    assert sorted((b.request_id, b.layer) for b in rest) == [("b", 0), ("b", 1)]
    for b in mine + rest:
        assert b"".join(bytes(c) for c in b.chunks()) == np.stack(sent[(b.request_id, b.layer)]).tobytes()
        assert b.positions.tolist() == list(range(len(sent[(b.request_id, b.layer)])))
    assert all(b"".join(bytes(c) for c in b.chunks()) == first[(b.request_id, b.layer)] for b in mine)
    assert g.pool.allocated == 1  # one arena held both flushes
    del mine, rest, b
    for k in range(5, 200):  # many arenas' worth of steps, each flushed and written (dropped) before the next fills
        step(["c"], k)
        blocks = g.flush()
        del blocks
    assert g.pool.allocated == 1  # the written arena came back each time


def test_without_syncfs_a_publication_does_not_wait_for_its_writers_later_work(tmp_path, monkeypatch):
    """``fsync: false``: a request's end hands its writer its own rows only, and the prepared request is published
    at once, not held back (up to ``BATCH_S``) while its writer has other requests' rows queued: nothing is shared
    by waiting without a ``syncfs``."""
    gates = {"a": threading.Event(), "b": threading.Event()}
    real_append = fsmod._Writer.append

    def append(self, root, block, dtype):
        gates[block.request_id].wait(60)
        real_append(self, root, block, dtype)

    monkeypatch.setattr(fsmod._Writer, "append", append)
    monkeypatch.setattr(fsmod, "BATCH_S", 600.0)
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1, fsync=False)
    fs.on_rows("a", 0, "post_mlp", np.arange(4), _rows(4), {})
    fs.on_rows("b", 0, "post_mlp", np.arange(4), _rows(4, seed=1), {})
    fut = fs.on_request_finished("a", {"prompt_len": 4})  # queued: a's rows, a's publication
    assert fs._gather.nbytes == _rows(4).nbytes  # b's rows stay gathered
    fs._flush()  # then b's rows, whose write is held
    gates["a"].set()
    assert fut.result(timeout=30) is None and _status(tmp_path, "a")["status"] == "complete"
    assert not (tmp_path / "default" / "b").exists()  # b's write still held
    gates["b"].set()
    _published(fs.on_request_finished("b", {"prompt_len": 4}))
    np.testing.assert_array_equal(load_request(str(tmp_path), "b")[(0, "post_mlp")][1], _rows(4, seed=1))
    fs.close()
