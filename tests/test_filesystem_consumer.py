"""The filesystem consumer alone: publish is atomic (a killed writer leaves only .tmp files, which
the reader never shows), many concurrent requests each get their own complete files."""

from __future__ import annotations

import errno
import json
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
    """``open`` for the filesystem module: writes to row files (``.bin.tmp``) raise ENOSPC while
    ``full`` is set (small JSON files still fit, as on a disk that is nearly full)."""

    def __init__(self):
        self.full = False

    def __call__(self, path, mode="r", *a, **kw):
        fh = open(path, mode, *a, **kw)
        if not str(path).endswith(".bin.tmp"):
            return fh
        outer = self

        class _File:
            def write(self, data):
                if outer.full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return fh.write(data)

            def __getattr__(self, name):
                return getattr(fh, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                fh.close()

        return _File()


def _status(root, rid):
    return json.loads((root / "default" / rid / "request.json").read_text())


def test_a_write_error_fails_only_its_request_and_later_ones_are_written(tmp_path, monkeypatch):
    """Injected ENOSPC: the request it hits is published as failed (error in request.json, no .tmp
    left, counted); the writer thread lives on and the next request is written once space returns."""
    disk = _FullDisk()
    monkeypatch.setattr(fsmod, "open", disk, raising=False)
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
    monkeypatch.setattr(fsmod, "open", disk, raising=False)
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
        monkeypatch.setattr(fsmod, "open", disk, raising=False)
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
    gate = threading.Event()
    real_append = fsmod._Writer.append

    def slow_append(self, *args):
        gate.wait(60)
        real_append(self, *args)

    monkeypatch.setattr(fsmod._Writer, "append", slow_append)
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
    monkeypatch.setattr(fsmod, "open", disk, raising=False)
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
    """ENOSPC at the second shard's fsync: the first shard, already renamed into place, is removed
    with the rest; request.json says failed."""
    import os

    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("1_post_mlp.bin.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=1)
    for layer in (0, 1):
        fs.on_rows("m", layer, "post_mlp", np.arange(3), _rows(3, seed=layer), {})
    monkeypatch.setattr(fsmod.os, "fsync", fsync)
    _published(fs.on_request_finished("m", {"prompt_len": 3}))
    monkeypatch.setattr(fsmod.os, "fsync", real_fsync)
    assert _status(tmp_path, "m")["status"] == "failed"
    assert sorted(p.name for p in (tmp_path / "default" / "m").iterdir()) == ["request.json"]
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


@pytest.mark.parametrize("fsync", [True, "false"])
def test_fsync_off_skips_every_fsync_and_still_publishes_whole_files(tmp_path, monkeypatch, fsync):
    """``fsync: false`` (a param may come as a string): no file or record is fsynced, files still appear whole
    (renamed into place once complete) with their request.json; by default every shard and record is."""
    synced = []
    real = fsmod.os.fsync
    monkeypatch.setattr(fsmod.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    fs = FilesystemConsumer("fs", root=str(tmp_path), threads=2, fsync=fsync)
    rows = np.arange(32, dtype=np.float32).reshape(2, 16)
    for i in range(3):
        fs.on_rows(f"r{i}", 1, "post_mlp", np.array([0, 1]), rows + i, {})
        _published(fs.on_request_finished(f"r{i}", {"prompt_len": 2}))
    for i in range(3):
        positions, got = load_request(str(tmp_path), f"r{i}")[(1, "post_mlp")]
        np.testing.assert_array_equal(got, rows + i)
        assert json.loads((tmp_path / "default" / f"r{i}" / "request.json").read_text())["status"] == "complete"
    assert (len(synced) >= 9) if fsync is True else not synced  # per request: the shard, its sidecar, request.json
