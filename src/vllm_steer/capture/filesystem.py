"""The ``filesystem`` capture consumer: one file per (request, layer, hook), published atomically.

Layout: ``{root}/{tag}/{request_id}/{layer}_{hook}.bin`` (rows, row-major, float32 or the model's
fp16) plus ``{layer}_{hook}.json`` (positions, dtype, shape) and ``request.json`` (request
metadata), written last: a request directory with ``request.json`` is complete. Writes for a
request go to thread ``hash(request_id) % threads`` (so a file's order is kept), each thread keeps
an LRU of open ``.bin.tmp`` files; on finish every file is fsynced and ``os.replace``d into place,
so readers never see a partial shard (a killed process leaves only ``.tmp`` files). Under pipeline
parallelism each stage writes the files of its own sites and publishes ``request.json`` too: the
request is complete once every stage has (``load_request`` takes the count of sites to expect).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from vllm_steer.capture.consumer import BaseConsumer


def _safe(request_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)


class _Writer:
    def __init__(self, max_open: int) -> None:
        self.open: OrderedDict[Path, Any] = OrderedDict()
        self.max_open = max_open
        self.meta: dict[str, dict[Path, dict]] = {}  # request -> final path -> sidecar

    def append(self, request_id: str, path: Path, positions: np.ndarray, rows: np.ndarray) -> None:
        tmp = path.with_name(path.name + ".tmp")
        fh = self.open.pop(tmp, None)
        if fh is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(tmp, "ab")
        self.open[tmp] = fh
        while len(self.open) > self.max_open:
            _, old = self.open.popitem(last=False)
            old.close()
        fh.write(np.ascontiguousarray(rows).tobytes())
        side = self.meta.setdefault(request_id, {}).setdefault(
            path, {"positions": [], "dtype": str(rows.dtype), "hidden": int(rows.shape[1])})
        side["positions"].extend(int(p) for p in positions)

    def publish(self, request_dir: Path, request_id: str, meta: dict) -> None:
        for path, side in self.meta.pop(request_id, {}).items():
            tmp = path.with_name(path.name + ".tmp")
            fh = self.open.pop(tmp, None) or open(tmp, "ab")
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(tmp, path)
            side["shape"] = [len(side["positions"]), side["hidden"]]
            _write_json(path.with_suffix(".json"), side)
        request_dir.mkdir(parents=True, exist_ok=True)
        _write_json(request_dir / "request.json", {"request_id": request_id, **meta})


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # each pipeline stage publishes request.json
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FilesystemConsumer(BaseConsumer):
    location = "worker"

    def __init__(self, instance: str, root: str, tag: str = "default", threads: int = 2,
                 max_open: int = 64, **params: Any) -> None:
        super().__init__(instance, **params)
        self.root = Path(root) / tag
        self._queues = [queue.Queue() for _ in range(max(1, int(threads)))]
        self._writers = [_Writer(max_open) for _ in self._queues]
        for q, w in zip(self._queues, self._writers):
            threading.Thread(target=self._run, args=(q, w), daemon=True, name="vllm-steer-fs").start()

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        if params:
            raise ValueError(f"the filesystem consumer takes no per-request keys, got {sorted(params)}")

    def _queue_of(self, request_id: str) -> queue.Queue:
        return self._queues[zlib.crc32(request_id.encode()) % len(self._queues)]

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        path = self.root / _safe(request_id) / f"{layer}_{hook}.bin"
        self._queue_of(request_id).put(("append", request_id, path, positions, rows))

    def on_request_finished(self, request_id, meta) -> None:
        done = threading.Event()
        self._queue_of(request_id).put(("publish", request_id, self.root / _safe(request_id), meta, done))
        done.wait(60)  # published before the dispatcher reports the request done
        return None

    @staticmethod
    def _run(q: queue.Queue, writer: _Writer) -> None:
        while True:
            item = q.get()
            if item[0] == "append":
                writer.append(*item[1:])
            else:
                _, request_id, request_dir, meta, done = item
                try:
                    writer.publish(request_dir, request_id, meta)
                finally:
                    done.set()


def _request_dir(base: Path, request_id: str) -> Path:
    """The directory of an engine request id, or of the one request whose external id it is."""
    d = base / _safe(request_id)
    if d.exists():
        return d
    matches = [p.parent for p in base.glob("*/request.json")
               if json.loads(p.read_text()).get("external_id") == request_id]
    return matches[0] if len(matches) == 1 else d


def load_request(root: str, request_id: str, tag: str = "default",
                 sites: int | None = None) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """Read a published request back: {(layer, hook): (positions, rows [n, D])}. Raises
    FileNotFoundError while the request is not complete (no request.json yet, or fewer than
    ``sites`` sites published: pipeline stages publish their own)."""
    d = _request_dir(Path(root) / tag, request_id)
    if not (d / "request.json").exists():
        raise FileNotFoundError(f"capture of {request_id!r} is not published under {d}")
    if sites is not None and len(list(d.glob("*_*.json"))) < sites:
        raise FileNotFoundError(f"capture of {request_id!r}: not every pipeline stage has published under {d}")
    out = {}
    for side_path in sorted(d.glob("*_*.json")):
        side = json.loads(side_path.read_text())
        layer, hook = side_path.stem.split("_", 1)
        rows = np.fromfile(side_path.with_suffix(".bin"), dtype=side["dtype"]).reshape(side["shape"])
        out[(int(layer), hook)] = (np.asarray(side["positions"]), rows)
    return out
