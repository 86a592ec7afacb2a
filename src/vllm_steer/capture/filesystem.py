"""The ``filesystem`` capture consumer: a request's rows written off the dispatch thread, published
atomically, write faults contained to the request they hit.

Two output formats (``format``):

- ``"files"`` (default): ``{root}/{tag}/{request_id}/{layer}_{hook}.bin`` (rows, row-major, in the
  model's dtype: ``"bfloat16"`` rows are raw bf16, half the bytes of float32) plus ``{layer}_{hook}.json``
  (positions, dtype, shape). ``load_request`` returns float32 (``torch=True``: torch tensors in the stored
  dtype); without it, two lines of numpy: ``b = np.fromfile(bin, np.uint16 if dtype == "bfloat16" else
  dtype)`` then, for bfloat16, ``(b.astype(np.uint32) << 16).view(np.float32)`` (exact).
- ``"sae_lens"``: the rows go to one dataset per site that sae-lens trains from directly
  (``capture.saelens_format``: ``context_size`` tokens a row, ``shard_mb`` an arrow file, windows
  waiting ``flush_s`` written anyway); the request directory keeps only ``request.json``. bf16 rows are
  written as float32 there (Arrow has no bfloat16; sae-lens reads the dataset's dtype as stored).

Either way ``request.json`` (the request's metadata and ``status``) is written last: a request
directory with it is done. ``status`` is ``"complete"``; ``"partial"`` when rows were dropped
(``dropped`` names the positions: the engine's drops and this consumer's); or ``"failed"`` with
``error`` when a write failed (disk full, ...): that request's ``.tmp`` files are removed and nothing
of it is published, and the writers go on with the next requests (written again once space returns).

A step's rows arrive in one call (``on_packet``) and are gathered as they came (``capture.fs_gather``); when
they reach ``FLUSH_BYTES`` per open file (at most a quarter of ``max_queued_mb``), and at a request's end,
they are regrouped per file and each file's block goes to its writer thread (which gathers its rows), so a decode
step costs O(1) Python here, not a call per (request, site). Writes for a request go to thread
``hash(request_id) % threads`` (so a file's order is kept), each thread keeps an LRU of open
``.bin.tmp`` files (``max_open``; default: from the process's file limit, up to 1024); on finish every
file is fsynced and ``os.replace``d into place, so readers never see
a partial shard (a killed process leaves only ``.tmp`` files). ``on_request_finished`` does not wait for
that: it returns a ``Future`` the writer completes once the request is published, and the capture host
answers the request then (the response waits for it, bounded by ``capture_result_timeout_s``).
``fsync: false`` skips the fsyncs: files are still published by rename when complete, so readers on this
host see whole files as before, but a machine crash may lose the last ones; the disk's sync rate no longer
bounds the requests (a response waits for its files' publication).
Under pipeline parallelism each stage writes the files of its own sites and its own record,
``stage-K.json`` (``request.json``'s content for its sites); the stage that finds every stage's record
there writes ``request.json`` for the whole request (``merged_record``: ``failed`` if a stage failed,
naming it, ``partial`` if a stage dropped rows, ``stages`` each stage's status). So ``request.json``
still marks a finished request; with stages on several hosts, ``root`` must be a filesystem they share.

Exhaustion policy. Rows waiting for a writer hold at most ``max_queued_mb`` (default 1024). A step whose
rows find no room waits for the writers up to ``max_wait_s`` (default 1 s; the consumer's lane holds its
ring rows meanwhile, so the engine's shared ring is the buffer: the step itself never waits), then its rows
are dropped, counted in ``stats()["dropped_writes"]`` and named in the request's ``dropped``; after such a
drop steps are dropped at once until the writers have drained half the limit. A write error is
counted in ``write_errors`` and fails only its request (``failed_requests``); a publication that took
longer than ``publish_timeout_s`` after its request finished is counted (``publish_timeouts``: the
writers are behind), and at most ``MAX_PENDING_PUBLISHES`` publications wait for a stuck writer
(past that a request is not published: ``failed_requests``). ``stats()`` reaches ``/metrics``
through the capture runtime's status.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import resource
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vllm_steer.capture.consumer import BaseConsumer, RowPacket
from vllm_steer.capture.fs_gather import Block, StepGather

logger = logging.getLogger("vllm.steer.capture")

FORMATS = ("files", "sae_lens")
MAX_PENDING_PUBLISHES = 1024
FLUSH_BYTES = 256 * 1024  # gathered rows are flushed at this many bytes per open file (and at a request's end)
STATS = ("write_errors", "dropped_writes", "failed_requests", "publish_timeouts")


class CaptureWriteError(RuntimeError):
    """A request whose files could not be written (``request.json`` says ``status: failed``)."""


def _safe(request_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class _Writer:
    """One writer thread's state: open ``.tmp`` files (LRU) and per-request sidecars. Every method
    runs on that thread; an OSError fails only the request it hit."""

    def __init__(self, max_open: int, count: Callable[[str], None], sink: Any = None, fsync: bool = True) -> None:
        self.open: OrderedDict[Path, tuple[Any, str]] = OrderedDict()  # tmp -> (file, request)
        self.max_open = max_open
        self.count = count
        self.sink = sink  # the sae-lens datasets, or None for the files format
        self.fsync = fsync  # files and records fsynced before they are published
        self.meta: dict[str, dict[Path, dict]] = {}  # request -> final path -> sidecar
        self.failed: dict[str, str] = {}  # request -> first error

    def append(self, request_id: str, path: Path, positions: list[np.ndarray], rows: list[np.ndarray],
               dtype: str) -> None:
        """Write a chunk of a file's rows (``rows``: blocks ``[n, D]``, ``positions`` theirs) in one write."""
        if request_id in self.failed:
            return
        try:
            tmp = path.with_name(path.name + ".tmp")
            entry = self.open.pop(tmp, None)
            if entry is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                entry = (open(tmp, "ab"), request_id)
            self.open[tmp] = entry
            side = self.meta.setdefault(request_id, {}).setdefault(
                path, {"positions": [], "dtype": dtype, "hidden": int(rows[0].shape[1])})
            self._evict()
            if request_id in self.failed:  # evicting one of its own files failed
                return
            entry[0].write(np.ascontiguousarray(rows[0] if len(rows) == 1 else np.concatenate(rows)))
            side["positions"] += positions
        except OSError as e:
            self.fail(request_id, e)

    def _evict(self) -> None:
        while len(self.open) > self.max_open:
            _, (old, rid) = self.open.popitem(last=False)
            try:
                old.close()  # buffered bytes land now: a full disk may say so here
            except OSError as e:
                self.fail(rid, e)

    def fail(self, request_id: str, err: BaseException) -> None:
        """The request's writes failed: count it once, drop its open files, ``.tmp`` files and
        the shards a failing publish already renamed into place."""
        if request_id not in self.failed:
            self.failed[request_id] = f"{type(err).__name__}: {err}"
            self.count("write_errors")
            logger.warning("vllm-steer: filesystem capture of %s failed: %s", request_id, err)
        for path in self.meta.pop(request_id, {}):
            tmp = path.with_name(path.name + ".tmp")
            entry = self.open.pop(tmp, None)
            if entry is not None:
                try:
                    entry[0].close()
                except OSError:
                    pass
            for p in (tmp, path, path.with_suffix(".json")):
                _remove(p)

    def _finish_files(self, request_id: str) -> dict:
        """Close, fsync and read out (sae_lens) or rename into place (files) the request's shards."""
        out: dict = {}
        for path, side in list(self.meta.get(request_id, {}).items()):
            tmp = path.with_name(path.name + ".tmp")
            fh = self.open.pop(tmp, (None,))[0] or open(tmp, "ab")
            with fh:
                fh.flush()
                if self.sink is None and self.fsync:
                    os.fsync(fh.fileno())
            positions = np.concatenate(side["positions"]) if side["positions"] else np.zeros(0, np.int64)
            side["shape"] = [len(positions), side["hidden"]]
            if self.sink is not None:
                layer, hook = path.stem.split("_", 1)
                rows = np.memmap(tmp, dtype=side["dtype"], mode="r", shape=tuple(side["shape"])) if side["shape"][0] else None
                if rows is not None:
                    out[f"{hook}.{layer}"] = self.sink.add(hook, int(layer), positions, rows)
                    del rows
                _remove(tmp)
            else:
                os.replace(tmp, path)
                _write_json(path.with_suffix(".json"), {**side, "positions": positions.tolist()}, self.fsync)
        self.meta.pop(request_id, None)
        return out

    def publish(self, request_dir: Path, request_id: str, meta: dict) -> None:
        if request_id not in self.failed:
            try:
                written = self._finish_files(request_id)
                if self.sink is not None:
                    meta = {**meta, "sae_lens": written}
            except OSError as e:
                self.fail(request_id, e)
        error = self.failed.pop(request_id, None)
        if error is not None:
            self.count("failed_requests")
            meta = {**meta, "status": "failed", "error": error}
        else:
            meta = {**meta, "status": "partial" if meta.get("dropped_rows") else "complete"}
        record = {"request_id": request_id, **meta}
        stage, stages = record.pop("stage", 0), record.pop("stages", 1)
        try:
            request_dir.mkdir(parents=True, exist_ok=True)
            if stages > 1:
                _publish_stage(request_dir, record, stage, stages, self.fsync)
            else:
                _write_json(request_dir / "request.json", record, self.fsync)
        except OSError as e:  # not even request.json fits: the request stays unpublished
            if error is None:
                self.count("write_errors")
                self.count("failed_requests")
            logger.warning("vllm-steer: filesystem capture of %s: request.json not written: %s", request_id, e)


def _write_json(path: Path, obj: dict, fsync: bool = True) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # each pipeline stage publishes request.json
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        _remove(tmp)
        raise


def _publish_stage(request_dir: Path, record: dict, stage: int, stages: int, fsync: bool = True) -> None:
    """Pipeline parallelism: this stage's record, then ``request.json`` if every stage's is there (the
    last stage to publish finds them all; two finishing at once both write the same file)."""
    _write_json(request_dir / f"stage-{stage}.json", record, fsync)
    parts = []
    for k in range(stages):
        try:
            parts.append(json.loads((request_dir / f"stage-{k}.json").read_text()))
        except FileNotFoundError:  # that stage writes request.json when it publishes
            return
    _write_json(request_dir / "request.json", merged_record(parts), fsync)


def merged_record(parts: list[dict]) -> dict:
    """The whole request's ``request.json`` from its stages' records (stage order)."""
    out = {k: v for k, v in parts[0].items() if k not in ("status", "error")}
    for key in ("dropped", "sae_lens"):  # each stage names its own sites
        if any(key in p for p in parts):
            out[key] = {site: v for p in parts for site, v in (p.get(key) or {}).items()}
    if any("dropped_rows" in p for p in parts):
        out["dropped_rows"] = sum(int(p.get("dropped_rows", 0)) for p in parts)
    status = [p.get("status") for p in parts]
    failed = [f"stage {k}: {p.get('error')}" for k, p in enumerate(parts) if p.get("status") == "failed"]
    out["status"] = "failed" if failed else "partial" if "partial" in status else "complete"
    if failed:
        out["error"] = "; ".join(failed)
    out["stages"] = status
    return out


class _Budget:
    """Bytes of rows held for the writers (gathered or queued), bounded: ``take`` waits at most ``wait_s`` for
    room, then refuses; after a refusal it refuses at once until the writers have drained half the limit
    (a stuck disk costs one wait, not one per step)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.shedding = limit, 0, False
        self.cond = threading.Condition()

    def take(self, n: int, wait_s: float | None = None) -> bool:
        """Room for ``n`` bytes: at once (``wait_s`` None), or waiting for it at most ``wait_s``."""
        with self.cond:
            deadline = None
            while self.used + n > self.limit and self.used > 0:
                if wait_s is None:
                    return False
                if deadline is None:
                    deadline = time.monotonic() + (0.0 if self.shedding else wait_s)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.shedding = True
                    return False
                self.cond.wait(left)
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.cond:
            self.used -= n
            if self.used * 2 <= self.limit:
                self.shedding = False
            self.cond.notify_all()


class FilesystemConsumer(BaseConsumer):
    location = "worker"
    raw_rows = True  # bf16 rows as stored (their bits): written as they are, half float32's bytes

    def __init__(self, instance: str, root: str, tag: str = "default", threads: int = 2,
                 max_open: int = 0, format: str = "files", max_queued_mb: float = 1024, max_wait_s: float = 1.0,
                 publish_timeout_s: float = 20.0, context_size: int = 128, shard_mb: float = 64,
                 flush_s: float = 10.0, fsync: bool | str = True, **params: Any) -> None:
        super().__init__(instance, **params)
        if format not in FORMATS:
            raise ValueError(f"filesystem consumer: format must be one of {FORMATS}, got {format!r}")
        self.root = Path(root) / tag
        self.format = format
        self.publish_timeout_s = float(publish_timeout_s)
        self.flush_s = float(flush_s)
        self._counts = dict.fromkeys(STATS, 0)
        self._lock = threading.Lock()
        self._budget = _Budget(int(float(max_queued_mb) * 2**20))  # params may come as strings ("name:key=val")
        self.max_wait_s = float(max_wait_s)
        self._dropped: dict[str, dict[str, list[int]]] = {}  # request -> rows this consumer dropped
        self._gather = StepGather(self._budget.limit // 4)  # rows not yet handed to a writer
        self._gathering = threading.RLock()  # the lane's thread only, as the contract says; a lock all the same
        self._dtype = ""  # the files' dtype (the model's)
        self._pending_publishes = 0
        self.sink = None
        if format == "sae_lens":
            from vllm_steer.capture.saelens_format import SaeLensDatasets
            self.sink = SaeLensDatasets(self.root / "sae_lens", int(context_size), float(shard_mb), self._count)
        self._queues = [queue.Queue() for _ in range(max(1, int(threads)))]
        sync = fsync if isinstance(fsync, bool) else str(fsync).lower() not in ("false", "0", "no")
        open_each = int(max_open) or _open_files_each(len(self._queues))
        self._writers = [_Writer(open_each, self._count, self.sink, sync) for _ in self._queues]
        self._threads = [threading.Thread(target=self._run, args=(q, w), daemon=True, name="vllm-steer-fs")
                         for q, w in zip(self._queues, self._writers)]
        for t in self._threads:
            t.start()

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        if params:
            raise ValueError(f"the filesystem consumer takes no per-request keys, got {sorted(params)}")

    def _count(self, stat: str, n: int = 1) -> None:
        with self._lock:
            self._counts[stat] += n

    def stats(self) -> dict[str, int]:
        """Counters since start (``write_errors``, ``dropped_writes``, ``failed_requests``, ``publish_timeouts``)."""
        with self._lock:
            return dict(self._counts)

    def _queue_index(self, request_id: str) -> int:
        return zlib.crc32(request_id.encode()) % len(self._queues)

    def _queue_of(self, request_id: str) -> queue.Queue:
        return self._queues[self._queue_index(request_id)]

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        """One (request, site)'s rows: a packet of one group."""
        self.on_packet(RowPacket([request_id], [(hook, layer)], np.zeros(1, np.int64),
                                 np.full(1, len(rows), np.int64), positions, rows, meta))

    def on_packet(self, packet: RowPacket) -> None:
        """A step's rows, gathered as they are (``capture.fs_gather``) until a flush regroups them per file.
        Runs on the capture host's lane of this instance, as ``on_request_finished`` does."""
        with self._gathering:
            self._take(packet)

    def _take(self, packet: RowPacket) -> None:
        rows, dtype = packet.data, packet.meta.get("dtype")
        if dtype == "bfloat16" and self.sink is not None:  # the sae_lens datasets hold float32 (exact)
            rows, dtype = (rows.astype(np.uint32) << 16).view(np.float32), None
        budget = self._budget
        if not budget.take(rows.nbytes):
            self._flush()  # what is gathered goes to the writers first: they free the room waited for
            if not budget.take(rows.nbytes, self.max_wait_s):  # the writers are behind (a slow or full disk)
                self._drop(packet)
                return
        self._dtype = dtype or str(rows.dtype)
        g = self._gather
        if not g.fits(len(rows)):
            self._flush()
        g.add(packet.request_ids, packet.sites, packet.starts, packet.ends, packet.positions, rows,
              arena_rows=-(-self._flush_bytes() // max(1, rows[0].nbytes)) if len(rows) else 0)
        if g.nbytes >= self._flush_bytes():
            self._flush()

    def _flush_bytes(self) -> int:
        """Gathered bytes that make a flush: FLUSH_BYTES per open file, at most a quarter of the limit."""
        return min(self._budget.limit // 4, FLUSH_BYTES * max(1, self._gather.active_files()))

    def _drop(self, packet: RowPacket) -> None:
        self._count("dropped_writes")
        with self._lock:
            for rid, (hook, layer), a, b in zip(packet.request_ids, packet.sites, packet.starts.tolist(),
                                                packet.ends.tolist()):
                self._dropped.setdefault(rid, {}).setdefault(f"{hook}.{layer}", []).extend(
                    packet.positions[a:b].tolist())

    def _flush(self) -> None:
        """Every gathered row to its file's writer: one block per file, one queue item per writer."""
        per_queue: dict[int, list[Block]] = {}
        for block in self._gather.flush():
            per_queue.setdefault(self._queue_index(block.request_id), []).append(block)
        for k, blocks in per_queue.items():
            self._queues[k].put(("append", blocks, self._dtype, sum(b.nbytes for b in blocks)))

    def _path(self, block: Block) -> Path:
        return self.root / _safe(block.request_id) / f"{block.layer}_{block.hook}.bin"

    def on_request_finished(self, request_id, meta) -> Future | None:
        """Hand the request's last rows to its writer and queue its publication: a ``Future`` done once
        ``request.json`` is written (None when the request will not be published)."""
        with self._gathering:
            self._flush()  # its last rows (and the others' gathered ones) go before its publication
            self._gather.files.forget(request_id)
        with self._lock:
            mine = self._dropped.pop(request_id, {})
            full = self._pending_publishes >= MAX_PENDING_PUBLISHES
            if not full:
                self._pending_publishes += 1
        if full:  # the writers are stuck: this request is never published
            self._count("failed_requests")
            logger.warning("vllm-steer: filesystem capture of %s not published: %d publications waiting",
                           request_id, MAX_PENDING_PUBLISHES)
            return None
        if mine:
            dropped = {k: sorted(set(meta.get("dropped", {}).get(k, [])) | set(v))
                       for k, v in {**meta.get("dropped", {}), **mine}.items()}
            meta = {**meta, "dropped": dropped, "dropped_rows": sum(map(len, dropped.values()))}
        done: Future = Future()
        self._queue_of(request_id).put(("publish", request_id, self.root / _safe(request_id), meta, done,
                                        time.monotonic()))
        return done

    def _run(self, q: queue.Queue, writer: _Writer) -> None:
        while True:
            try:
                item = q.get(timeout=self.flush_s if self.sink is not None else None)
            except queue.Empty:  # idle: buffered sae-lens windows go to disk
                self.sink.flush_stale(self.flush_s)
                continue
            if item is None:
                return
            try:
                if item[0] == "append":
                    for b in item[1]:
                        writer.append(b.request_id, self._path(b), [b.positions], [b.materialize()], item[2])
                else:
                    writer.publish(item[2], item[1], item[3])
            except Exception as e:  # a bug, not a disk fault: still only this request fails
                logger.exception("vllm-steer: filesystem capture writer")
                for rid in {b.request_id for b in item[1]} if item[0] == "append" else (item[1],):
                    writer.fail(rid, e)
                if item[0] == "publish":
                    writer.publish(item[2], item[1], item[3])  # request.json says failed
            finally:
                if item[0] == "append":
                    self._budget.give(item[3])
                else:
                    with self._lock:
                        self._pending_publishes -= 1
                    if time.monotonic() - item[5] > self.publish_timeout_s:  # the writers are behind
                        self._count("publish_timeouts")
                    item[4].set_result(None)
                    if self.sink is not None:
                        self.sink.flush_stale(self.flush_s)

    def close(self) -> None:
        """Finish what is queued (bounded wait), then write the sae-lens datasets' last whole windows."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=self.publish_timeout_s)
        if self.sink is not None:
            self.sink.close()


def _open_files_each(threads: int) -> int:
    """Open files each writer keeps (its LRU): a quarter of the process's file limit shared by the writers,
    at least 64, at most 1024 (a batch of 32 requests x 32 sites keeps every file open)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = soft // 4 // max(1, threads) if soft != resource.RLIM_INFINITY else 1024
    return max(64, min(1024, room))


def _request_dir(base: Path, request_id: str) -> Path:
    """The directory of an engine request id, or of the one request whose external id it is."""
    d = base / _safe(request_id)
    if d.exists():
        return d
    matches = [p.parent for p in base.glob("*/request.json")
               if json.loads(p.read_text()).get("external_id") == request_id]
    return matches[0] if len(matches) == 1 else d


def read_rows(path: Path, dtype: str, shape: list[int], torch: bool = False) -> Any:
    """A ``.bin`` file's rows: float32 numpy for bfloat16 (exact), numpy in the stored dtype otherwise;
    ``torch``: a torch tensor in the stored dtype (bfloat16 included)."""
    raw = np.fromfile(path, dtype=np.uint16 if dtype == "bfloat16" else dtype).reshape(shape)
    if torch:
        import torch as _torch

        t = _torch.from_numpy(raw)
        return t.view(_torch.bfloat16) if dtype == "bfloat16" else t
    return (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else raw


def load_request(root: str, request_id: str, tag: str = "default", sites: int | None = None,
                 torch: bool = False) -> dict[tuple[int, str], tuple[np.ndarray, Any]]:
    """Read a published request back (``format="files"``): {(layer, hook): (positions, rows [n, D])}, rows
    as ``read_rows`` gives them (bfloat16 files: float32 numpy, or with ``torch`` bf16 tensors).
    Raises FileNotFoundError while the request is not complete (no request.json yet: under pipeline
    parallelism it comes with the last stage; or fewer than ``sites`` sites published), CaptureWriteError when its writes
    failed."""
    d = _request_dir(Path(root) / tag, request_id)
    if not (d / "request.json").exists():
        raise FileNotFoundError(f"capture of {request_id!r} is not published under {d}")
    info = json.loads((d / "request.json").read_text())
    if info.get("status") == "failed":
        raise CaptureWriteError(f"capture of {request_id!r} failed: {info.get('error')}")
    if sites is not None and len(list(d.glob("*_*.json"))) < sites:
        raise FileNotFoundError(f"capture of {request_id!r}: not every pipeline stage has published under {d}")
    out = {}
    for side_path in sorted(d.glob("*_*.json")):
        side = json.loads(side_path.read_text())
        layer, hook = side_path.stem.split("_", 1)
        rows = read_rows(side_path.with_suffix(".bin"), side["dtype"], side["shape"], torch)
        out[(int(layer), hook)] = (np.asarray(side["positions"]), rows)
    return out
