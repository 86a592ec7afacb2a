"""The ``filesystem`` capture consumer: a request's rows written off the dispatch thread, published
atomically, write faults contained to the request they hit.

Two output formats (``format``):

- ``"files"`` (default): ``{root}/{tag}/{request_id}/{layer}_{hook}.bin`` (rows, row-major, in the
  model's dtype: ``"bfloat16"`` rows are raw bf16, half the bytes of float32) plus ``{layer}_{hook}.json``
  (``dtype``, ``shape``, ``hidden`` and the rows' positions: ``"positions_range": [start, stop]`` when they are
  consecutive, the usual case, else ``"positions": [...]``; files written before the range form always have
  ``positions``, and ``read_positions`` reads either). ``load_request`` returns float32 (``torch=True``: torch tensors in the stored
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

A step's rows arrive in one call (``on_packet``) and are gathered as they came (``capture.fs_gather``, in pooled
arenas reused as the writers finish with them: no fresh pages a step); when they reach ``FLUSH_BYTES`` per open file
(at most a quarter of ``max_queued_mb``) they are regrouped per file, and at a request's end its own rows are (the
others' stay gathered, so a finish does not cut every file's block short); each file's block goes to its writer
thread, which writes it with one ``os.writev`` of views of the gather arena (one per run of consecutive rows: no
gather copy), so a decode step costs O(1) Python here, not a call per (request, site). Writes for a request go to thread
``hash(request_id) % threads`` (so a file's order is kept; ``threads`` 4 by default, as the GPU benches ran; their
writes release the GIL), each thread keeps an LRU of open
``.bin.tmp`` descriptors (``max_open``; default: from the process's file limit, up to 1024).
``on_request_finished`` does not wait for the publication: it returns a ``Future`` the writer completes once
the request is published, and the capture host answers the request then (the response waits for it, bounded
by ``capture_result_timeout_s``). A request's spec may say ``"wait": false`` (the consumer's one per-request key):
its response then ends with its last token and its files are published behind it (``request.json`` says when;
the queue's bounds and counters are the same), so a client's slot is not held by the disk.

Publication protocol (a writer thread, per batch of the requests it finished together):

1. prepare each request: close its ``.bin.tmp`` files, write each sidecar and the record (``request.json``,
   or ``stage-K.json`` under pipeline parallelism) under ``.tmp`` names; a write error here fails only that
   request (its files removed, its record says ``failed``);
2. make the batch durable: one ``syncfs`` of the root's filesystem (``fsync: true``, the default) for every
   request of the batch; ``fsync: "files"`` fsyncs each file in step 1 instead (where ``syncfs`` is missing,
   or where the root shares its filesystem with other heavy writers: ``syncfs`` writes their dirty data too;
   before Linux 5.8 ``syncfs`` does not report write-back errors); ``fsync: false`` skips this;
3. publish each request: its shards and sidecars renamed into place, its record last.

So nothing is renamed to its final name before its bytes (the record's too) are durable, and a request
directory with ``request.json`` is complete; readers never see a partial shard (a killed process leaves only
``.tmp`` files). With ``syncfs`` a batch is what the writer's queue holds: prepared requests are committed as soon
as the queue is empty, ``BATCH_REQUESTS`` are waiting, or the oldest has waited ``BATCH_S`` behind other work, so a
lone request is synced at once and a busy writer pays one sync for many requests (each request's 2 files a
site plus its record were each fsynced before); otherwise (``fsync: false`` or ``"files"``: no sync to share) each
request is committed as soon as it is prepared. A failed ``syncfs`` cannot say whose bytes were lost: every
request of its batch is published as ``failed``. A failed rename fails only its request. With ``fsync: false``
files are still published by rename when complete, so readers on this host see whole files as before, but a
machine crash may lose the last ones; the disk's sync rate no longer bounds the requests (a response waits for
its files' publication).
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
IOV_MAX = 1024  # views per os.writev (Linux's limit)
BATCH_REQUESTS = 64  # prepared publications made durable together, at most (one syncfs)
BATCH_S = 0.05  # a prepared publication waits at most this long for others while its writer has work queued
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


class _Prepared:
    """A request made ready to publish: its files closed and written under ``.tmp`` names (``renames``: tmp ->
    final, in publication order, the record last), waiting for its batch's sync."""

    __slots__ = ("request_id", "request_dir", "record", "stage", "stages", "renames", "failed", "item")

    def __init__(self, request_id: str, request_dir: Path, record: dict, stage: int, stages: int, item: tuple) -> None:
        self.request_id, self.request_dir, self.record, self.stage, self.stages = (
            request_id, request_dir, record, stage, stages)
        self.renames: list[tuple[Path, Path]] = []
        self.failed = record["status"] == "failed"
        self.item = item  # the queue's publish item (its Future is set once published)


class _Writer:
    """One writer thread's state: open ``.tmp`` files (LRU of raw descriptors) and per-request sidecars. Every
    method runs on that thread; an OSError fails only the request it hit (a failed batch sync: its requests)."""

    def __init__(self, max_open: int, count: Callable[[str], None], sink: Any = None, sync: str = "syncfs") -> None:
        self.open: OrderedDict[tuple, tuple[int, str]] = OrderedDict()  # (request, layer, hook) -> (fd, request)
        self.max_open = max_open
        self.count = count
        self.sink = sink  # the sae-lens datasets, or None for the files format
        self.sync = sync  # "syncfs", "files" or "off" (`_sync_mode`): how bytes are made durable before publication
        self.meta: dict[str, dict[tuple, dict]] = {}  # request -> (layer, hook) -> sidecar (and its "path", "tmp")
        self.failed: dict[str, str] = {}  # request -> first error

    def append(self, root: Path, block: Block, dtype: str) -> None:
        """Write a block of a file (``{root}/{request}/{layer}_{hook}.bin.tmp``) in one ``os.writev`` straight
        from the gather arena."""
        request_id = block.request_id
        if request_id in self.failed:
            return
        try:
            sides = self.meta.get(request_id)
            if sides is None:
                sides = self.meta[request_id] = {}
            side = sides.get((block.layer, block.hook))
            if side is None:
                path = root / _safe(request_id) / f"{block.layer}_{block.hook}.bin"
                side = sides[(block.layer, block.hook)] = {
                    "positions": [], "dtype": dtype, "hidden": int(block.rows.shape[1]), "path": path,
                    "tmp": path.with_name(path.name + ".tmp")}
            key = (request_id, block.layer, block.hook)
            entry = self.open.pop(key, None)
            if entry is None:
                try:
                    fd = _open_append(side["tmp"])
                except FileNotFoundError:  # the request's first file: its directory
                    side["path"].parent.mkdir(parents=True, exist_ok=True)
                    fd = _open_append(side["tmp"])
                entry = (fd, request_id)
            self.open[key] = entry
            self._evict()
            if request_id in self.failed:  # evicting one of its own files failed
                return
            _write_all(entry[0], block.chunks())
            side["positions"].append(block.positions)
        except OSError as e:
            self.fail(request_id, e)

    def _evict(self) -> None:
        while len(self.open) > self.max_open:
            _, (old, rid) = self.open.popitem(last=False)
            try:
                os.close(old)
            except OSError as e:
                self.fail(rid, e)

    def fail(self, request_id: str, err: BaseException) -> None:
        """The request's writes failed: count it once, drop its open files, ``.tmp`` files and
        the shards a failing publish already renamed into place."""
        if request_id not in self.failed:
            self.failed[request_id] = f"{type(err).__name__}: {err}"
            self.count("write_errors")
            logger.warning("vllm-steer: filesystem capture of %s failed: %s", request_id, err)
        for (layer, hook), side in self.meta.pop(request_id, {}).items():
            entry = self.open.pop((request_id, layer, hook), None)
            if entry is not None:
                try:
                    os.close(entry[0])
                except OSError:
                    pass
            path, sidecar = side["path"], side["path"].with_suffix(".json")
            for p in (side["tmp"], path, sidecar, _tmp_json(sidecar)):
                _remove(p)

    def _finish_files(self, request_id: str, renames: list[tuple[Path, Path]]) -> dict:
        """Close the request's shards; read them out (sae_lens) or write their sidecars under ``.tmp`` names
        (files: ``renames`` gets shard and sidecar, published after the batch's sync)."""
        out: dict = {}
        for (layer, hook), side in list(self.meta.get(request_id, {}).items()):
            path, tmp = side["path"], side["tmp"]
            entry = self.open.pop((request_id, layer, hook), None)
            if entry is not None:
                try:
                    if self.sync == "files" and self.sink is None:
                        os.fsync(entry[0])
                finally:
                    os.close(entry[0])
            elif self.sync == "files" and self.sink is None:  # evicted from the LRU earlier
                _fsync_path(tmp)
            positions = np.concatenate(side["positions"]) if side["positions"] else np.zeros(0, np.int64)
            side["shape"] = [len(positions), side["hidden"]]
            if self.sink is not None:
                rows = np.memmap(tmp, dtype=side["dtype"], mode="r", shape=tuple(side["shape"])) if side["shape"][0] else None
                if rows is not None:
                    out[f"{hook}.{layer}"] = self.sink.add(hook, int(layer), positions, rows)
                    del rows
                _remove(tmp)
            else:
                record = {k: side[k] for k in ("dtype", "hidden", "shape")}
                record.update(sidecar_positions(positions))
                sidecar = path.with_suffix(".json")
                renames.append((tmp, path))
                renames.append((_write_tmp_json(sidecar, record, self.sync == "files"), sidecar))
        self.meta.pop(request_id, None)
        return out

    def prepare(self, request_dir: Path, request_id: str, meta: dict, item: tuple) -> _Prepared:
        """The request's files closed, its sidecars and record written under ``.tmp`` names: published by
        ``commit`` once the batch is durable."""
        renames: list[tuple[Path, Path]] = []
        if request_id not in self.failed:
            try:
                written = self._finish_files(request_id, renames)
                if self.sink is not None:
                    meta = {**meta, "sae_lens": written}
            except OSError as e:
                self.fail(request_id, e)
        error = self.failed.pop(request_id, None)
        if error is not None:
            self.count("failed_requests")
            renames = []  # fail() removed them
            meta = {**meta, "status": "failed", "error": error}
        else:
            meta = {**meta, "status": "partial" if meta.get("dropped_rows") else "complete"}
        record = {"request_id": request_id, **meta}
        stage, stages = record.pop("stage", 0), record.pop("stages", 1)
        prep = _Prepared(request_id, request_dir, record, stage, stages, item)
        prep.renames = renames
        try:
            request_dir.mkdir(parents=True, exist_ok=True)
            final = request_dir / (f"stage-{stage}.json" if stages > 1 else "request.json")
            prep.renames.append((_write_tmp_json(final, record, self.sync == "files"), final))
        except OSError as e:
            self._unpublished(prep, e)
        return prep

    def _unpublished(self, prep: _Prepared, err: OSError) -> None:
        """Not even the record could be written: the request stays unpublished (its files removed)."""
        if not prep.failed:
            self.count("write_errors")
            self.count("failed_requests")
        for tmp, final in prep.renames:
            _remove(tmp)
            if not _is_record(final):
                _remove(final)
        prep.renames = []
        logger.warning("vllm-steer: filesystem capture of %s: request.json not written: %s", prep.request_id, err)

    def commit(self, batch: list[_Prepared]) -> None:
        """Make the batch's bytes durable (one ``syncfs`` for them all), then publish each request: its
        shards and sidecars renamed into place, its record last. A failed sync fails every request of the batch
        (it cannot say whose bytes were lost); a failed rename fails only its request."""
        live = [p for p in batch if p.renames]
        if live and self.sync == "syncfs":
            try:
                _syncfs_of(live[0].request_dir)
            except OSError as e:
                for prep in live:
                    self._fail_prepared(prep, e)
        for prep in live:
            if not prep.renames:
                continue
            try:
                for tmp, final in prep.renames[:-1]:
                    os.replace(tmp, final)
            except OSError as e:
                self._fail_prepared(prep, e)
                continue
            tmp, final = prep.renames[-1]
            try:
                os.replace(tmp, final)
            except OSError as e:
                _remove(tmp)
                self._unpublished(prep, e)
                continue
            if prep.stages > 1:
                try:
                    _merge_stages(prep.request_dir, prep.stages, self.sync != "off")
                except OSError as e:  # this stage is published; request.json is not (a later stage may write it)
                    self.count("write_errors")
                    logger.warning("vllm-steer: filesystem capture of %s: request.json not written: %s",
                                   prep.request_id, e)

    def _fail_prepared(self, prep: _Prepared, err: OSError) -> None:
        """A prepared request whose publication failed: its files removed, a ``failed`` record published
        (fsynced on its own: the failure path)."""
        if not prep.failed:
            self.count("write_errors")
            self.count("failed_requests")
            logger.warning("vllm-steer: filesystem capture of %s failed: %s", prep.request_id, err)
        for tmp, final in prep.renames:
            _remove(tmp)
            if not _is_record(final):
                _remove(final)
        prep.renames, prep.failed = [], True
        record = {**prep.record, "status": "failed", "error": f"{type(err).__name__}: {err}"}
        try:
            final = prep.request_dir / (f"stage-{prep.stage}.json" if prep.stages > 1 else "request.json")
            _write_json(final, record, self.sync != "off")
            if prep.stages > 1:
                _merge_stages(prep.request_dir, prep.stages, self.sync != "off")
        except OSError as e2:
            logger.warning("vllm-steer: filesystem capture of %s: request.json not written: %s", prep.request_id, e2)


def _is_record(path: Path) -> bool:
    return path.name == "request.json" or path.name.startswith("stage-")


def _open_append(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)


def _write_all(fd: int, chunks: list[memoryview]) -> None:
    """Write flat byte views in order: ``os.writev`` (IOV_MAX views a call), finishing a short write (over
    2 GiB, a nearly full disk) one view at a time."""
    for k in range(0, len(chunks), IOV_MAX):
        part = chunks[k : k + IOV_MAX]
        done = os.writev(fd, part)
        if done == sum(map(len, part)):
            continue
        for mv in part:
            if done >= len(mv):
                done -= len(mv)
                continue
            mv, done = mv[done:], 0
            while len(mv):
                mv = mv[os.write(fd, mv):]


def sidecar_positions(positions: np.ndarray) -> dict:
    """A sidecar's positions: ``{"positions_range": [start, stop]}`` when they are ``start, start + 1, ...,
    stop - 1`` (every prompt and generated token captured: the common case, and a constant size), else
    ``{"positions": [...]}``. ``read_positions`` reads either."""
    n = len(positions)
    if n and int(positions[-1]) - int(positions[0]) == n - 1 and (n == 1 or bool((np.diff(positions) == 1).all())):
        return {"positions_range": [int(positions[0]), int(positions[0]) + n]}
    return {"positions": positions.tolist()}


def read_positions(side: dict) -> np.ndarray:
    """A sidecar's positions (either form of ``sidecar_positions``; files written before the range form have
    ``positions``)."""
    if "positions_range" in side:
        return np.arange(*side["positions_range"], dtype=np.int64)
    return np.asarray(side["positions"], dtype=np.int64)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_syncfs_fn() -> Callable[[int], int] | None:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).syncfs  # releases the GIL while it waits
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


_libc_syncfs = _libc_syncfs_fn()
HAS_SYNCFS = hasattr(os, "syncfs") or _libc_syncfs is not None


def _syncfs(fd: int) -> None:
    """``syncfs(2)``: every dirty byte of the filesystem holding ``fd`` to the disk (reports writeback errors
    since Linux 5.8)."""
    if hasattr(os, "syncfs"):
        os.syncfs(fd)
        return
    if _libc_syncfs(fd) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _syncfs_of(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _syncfs(fd)
    finally:
        os.close(fd)


def _tmp_json(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")  # each pipeline stage publishes request.json


def _write_tmp_json(path: Path, obj: dict, fsync: bool = False) -> Path:
    """``obj`` as JSON under a ``.tmp`` name beside ``path`` (the caller renames it into place); one write."""
    tmp = _tmp_json(path)
    data = json.dumps(obj).encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            _write_all(fd, [memoryview(data)])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        _remove(tmp)
        raise
    return tmp


def _write_json(path: Path, obj: dict, fsync: bool = True) -> None:
    """``obj`` published at ``path`` on its own: written, fsynced (``fsync``), renamed into place."""
    tmp = _write_tmp_json(path, obj, fsync)
    try:
        os.replace(tmp, path)
    except OSError:
        _remove(tmp)
        raise


def _merge_stages(request_dir: Path, stages: int, fsync: bool = True) -> None:
    """Pipeline parallelism, once a stage's ``stage-K.json`` is in place: ``request.json`` if every stage's record
    is there (the last stage to publish finds them all; two finishing at once both write the same file)."""
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

    def __init__(self, instance: str, root: str, tag: str = "default", threads: int = 4,
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
        # rows not yet handed to a writer; its arenas: as many as the queue bound holds, and the one being filled
        self._gather = StepGather(self._budget.limit // 4, self._budget.limit + self._budget.limit // 4)
        self._gathering = threading.RLock()  # the lane's thread only, as the contract says; a lock all the same
        self._dtype = ""  # the files' dtype (the model's)
        self._pending_publishes = 0
        self.sink = None
        if format == "sae_lens":
            from vllm_steer.capture.saelens_format import SaeLensDatasets
            self.sink = SaeLensDatasets(self.root / "sae_lens", int(context_size), float(shard_mb), self._count)
        self._queues = [queue.Queue() for _ in range(max(1, int(threads)))]
        sync = _sync_mode(fsync)
        open_each = int(max_open) or _open_files_each(len(self._queues))
        self._writers = [_Writer(open_each, self._count, self.sink, sync) for _ in self._queues]
        self._threads = [threading.Thread(target=self._run, args=(q, w), daemon=True, name="vllm-steer-fs")
                         for q, w in zip(self._queues, self._writers)]
        for t in self._threads:
            t.start()

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        extra = set(params) - {"wait"}
        if extra:
            raise ValueError(f"the filesystem consumer's only per-request key is 'wait', got {sorted(extra)}")
        if not isinstance(params.get("wait", True), bool):
            raise ValueError(f"wait must be true or false, got {params['wait']!r}")

    @classmethod
    def response_waits(cls, params: dict[str, Any]) -> bool:
        """``"wait": false``: the response does not wait for the files (nor for this consumer's end of the request)."""
        return params.get("wait", True) is not False

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
        if not g.fits(rows):
            self._flush()
        g.add(packet.request_ids, packet.sites, packet.starts, packet.ends, packet.positions, rows,
              arena_rows=-(-self._arena_bytes() // max(1, rows[0].nbytes)) if len(rows) else 0)
        if g.nbytes >= self._flush_bytes():
            self._flush()

    def _flush_bytes(self) -> int:
        """Gathered bytes that make a flush: FLUSH_BYTES per open file, at most a quarter of the limit."""
        return min(self._budget.limit // 4, FLUSH_BYTES * max(1, self._gather.active_files()))

    def _arena_bytes(self) -> int:
        """A new arena's size: two flushes (a request's prompt arriving mid-arena seldom forces an early one),
        at most a quarter of the limit."""
        return min(self._budget.limit // 4, 2 * self._flush_bytes())  # BufferPool rounds it up to a power of two

    def _drop(self, packet: RowPacket) -> None:
        self._count("dropped_writes")
        with self._lock:
            for rid, (hook, layer), a, b in zip(packet.request_ids, packet.sites, packet.starts.tolist(),
                                                packet.ends.tolist()):
                self._dropped.setdefault(rid, {}).setdefault(f"{hook}.{layer}", []).extend(
                    packet.positions[a:b].tolist())

    def _flush(self, request_id: str | None = None) -> None:
        """Every gathered row (or only ``request_id``'s) to its file's writer: one block per file, one queue
        item per writer."""
        per_queue: dict[int, list[Block]] = {}
        for block in self._gather.flush(request_id):
            per_queue.setdefault(self._queue_index(block.request_id), []).append(block)
        for k, blocks in per_queue.items():
            self._queues[k].put(("append", blocks, self._dtype, sum(b.nbytes for b in blocks)))

    def on_request_finished(self, request_id, meta) -> Future | None:
        """Hand the request's last rows to its writer and queue its publication: a ``Future`` done once
        ``request.json`` is written (None when the request will not be published, or when it asked ``"wait":
        false``: its response does not wait for the files, which are published all the same)."""
        with self._gathering:
            self._flush(request_id)  # its last rows go before its publication (the others' stay gathered)
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
        return done if (meta.get("params") or {}).get("wait", True) else None

    def _run(self, q: queue.Queue, writer: _Writer) -> None:
        """The writer thread: appends as they come; publications prepared, then committed: at once without
        ``syncfs`` (nothing to share), else in batches (when the queue is empty, ``BATCH_REQUESTS`` are waiting
        or the oldest has waited ``BATCH_S``)."""
        batch: list[_Prepared] = []
        while True:
            if batch:
                item = q.get_nowait() if not q.empty() else "commit"
            else:
                try:
                    item = q.get(timeout=self.flush_s if self.sink is not None else None)
                except queue.Empty:  # idle: buffered sae-lens windows go to disk
                    self.sink.flush_stale(self.flush_s)
                    continue
            if item == "commit" or item is None or len(batch) >= BATCH_REQUESTS or (
                    batch and time.monotonic() - batch[0].item[6] > BATCH_S):
                self._commit(writer, batch)
                batch = []
            if item is None:
                return
            if item == "commit":
                continue
            if item[0] == "append":
                nbytes = item[3]
                self._append(writer, item)
                item = None  # no view of the arena outlives its write (the pool reuses the arena), then its room
                self._budget.give(nbytes)
                continue
            item = (*item, time.monotonic())  # [6]: when it was prepared
            try:
                batch.append(writer.prepare(item[2], item[1], item[3], item))
            except Exception as e:  # a bug, not a disk fault: still only this request fails
                logger.exception("vllm-steer: filesystem capture writer")
                writer.fail(item[1], e)
                batch.append(writer.prepare(item[2], item[1], item[3], item))  # request.json says failed
            if writer.sync != "syncfs":
                self._commit(writer, batch)
                batch = []

    def _append(self, writer: _Writer, item: tuple) -> None:
        _, blocks, dtype, _ = item
        try:
            for b in blocks:
                writer.append(self.root, b, dtype)
        except Exception as e:  # a bug, not a disk fault: still only these requests fail
            logger.exception("vllm-steer: filesystem capture writer")
            for rid in {b.request_id for b in blocks}:
                writer.fail(rid, e)

    def _commit(self, writer: _Writer, batch: list[_Prepared]) -> None:
        try:
            writer.commit(batch)
        except Exception:  # a bug: the requests are answered all the same (their files may be missing)
            logger.exception("vllm-steer: filesystem capture writer")
        for prep in batch:
            item = prep.item
            with self._lock:
                self._pending_publishes -= 1
            if time.monotonic() - item[5] > self.publish_timeout_s:  # the writers are behind
                self._count("publish_timeouts")
            item[4].set_result(None)
        if batch and self.sink is not None:
            self.sink.flush_stale(self.flush_s)

    def close(self) -> None:
        """Finish what is queued (bounded wait), then write the sae-lens datasets' last whole windows."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=self.publish_timeout_s)
        if self.sink is not None:
            self.sink.close()


def _sync_mode(fsync: bool | str) -> str:
    """The ``fsync`` param: true (or ``"syncfs"``): one ``syncfs`` per batch (per-file fsyncs where there is no
    syncfs); ``"files"``: each file fsynced; false: none."""
    mode = str(fsync).lower()
    if mode in ("false", "0", "no", "off"):
        return "off"
    if mode == "files":
        return "files"
    if mode in ("true", "1", "yes", "syncfs"):
        return "syncfs" if HAS_SYNCFS else "files"
    raise ValueError(f"filesystem consumer: fsync must be true, false, 'syncfs' or 'files', got {fsync!r}")


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
        out[(int(layer), hook)] = (read_positions(side), rows)
    return out
