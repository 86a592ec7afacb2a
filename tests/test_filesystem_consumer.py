"""The filesystem consumer alone: publish is atomic (a killed writer leaves only .tmp files, which
the reader never shows), many concurrent requests each get their own complete files."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from vllm_steer.capture.filesystem import FilesystemConsumer, load_request


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
        fs.on_request_finished(rid, {"external_id": f"ext-{i}", "prompt_len": 3})

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
fs.on_rows("victim", 0, "pre_attn", np.arange(4), np.ones((4, 8), np.float32), {})
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
