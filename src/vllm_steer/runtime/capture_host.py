"""The capture host: the process that runs a capturing worker's consumers (``python -m`` this module).

The worker (``runtime.capture_lanes``) starts one per capturing worker process with two pipes (commands
in, answers out) and a shared-memory ring (a memfd, mapped read-only here) that the worker copies
each step's captured rows into. Nothing a consumer does here (numpy, file writes, a third-party
plugin's pure Python) takes the worker's GIL.

Wire (pickled ``multiprocessing.connection`` messages):
- in: ``("init", {...})`` once, then ``("rows", packet_id, ring_row0, n, groups, bits)`` (``groups``: request
  ids, (hook, layer) sites, first and end cells per (request, site), and the cells' positions and consumer masks
  as runs, expanded here (``cells_of_runs``): ``runtime.capture_plan.StepPlan.wire``) and
  ``("finish", request_id, key, {bit: meta}, bits)``;
- out: ``("ready", {bit: global_spec})`` or ``("failed", message)``, then ``("done", packet_id, bit)``
  (a lane is done with a packet: its ring rows may be reused once every lane is), ``("finished", key,
  bit, result)`` (``result``: a driver's return value, or ``{"error": "consumer_error", ...}`` when
  ``on_request_finished`` raised; a returned ``concurrent.futures.Future`` is answered when it is done, and
  the lane goes on meanwhile), ``("errors", n)`` (exceptions caught in ``on_rows``) and ``("stats",
  {bit: counts})`` (consumers' own counters, their optional ``stats()``: sent every ``STATS_S`` when they changed).

Each consumer keeps its own queue and thread here (a slow consumer delays only itself); the worker
bounds what each may have queued (it never sends more), so the queues here need no bound of their own.
The host stops reading when its command pipe closes (the worker closed it or died) or on SIGTERM (sent when its
worker dies, ``PR_SET_PDEATHSIG``, or by a service manager stopping the group); it then delivers what it received
(at most ``DRAIN_S``), closes its consumers (files flushed, sae-lens windows written) and exits: it outlives its
worker by that bound only. It ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the rows
already captured are the worker's to end, not the keyboard's. It runs at the lowest CPU priority (``NICE``):
on the CPU lane a consumer burning a core slowed the engine's steps 4x at equal priority (its OMP threads
lost their core), not at nice 19.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import mmap
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from vllm_steer.capture.consumer import RowPacket

logger = logging.getLogger("vllm.steer.capture")

PR_SET_PDEATHSIG = 1
NICE = 19  # consumers are background work: on a busy host the engine's threads get the CPU first
DRAIN_S = 30.0  # once told to stop: how long the lanes may take to deliver what they received, all together
STATS_S = 1.0  # how often consumers' own counters are read (and sent when they changed)


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the pipe's EOF still ends the host
        pass
    if os.getppid() != parent:  # the worker died before the prctl took
        os._exit(0)


def _load(path: str) -> type:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def cells_of_runs(run_len: np.ndarray, run_pos: np.ndarray, run_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's position and consumer mask from runs (run i: ``run_len[i]`` cells at positions ``run_pos[i]``,
    +1, ..., each with mask ``run_mask[i]``)."""
    n = int(run_len.sum()) if len(run_len) else 0
    if n == len(run_len):  # a cell a run
        return run_pos, run_mask
    first = np.cumsum(run_len) - run_len
    return np.arange(n, dtype=np.int64) + np.repeat(run_pos - first, run_len), np.repeat(run_mask, run_len)


def ring_view(fd: int, rows: int, hidden: int, dtype: str) -> np.ndarray:
    """The ring as numpy ``[rows, hidden]`` (bfloat16 as its raw uint16 bits)."""
    np_dtype = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    size = rows * hidden * np.dtype(np_dtype).itemsize
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    return np.frombuffer(mm, np_dtype).reshape(rows, hidden)


def as_float(block: np.ndarray, dtype: str) -> np.ndarray:
    """Rows as consumers get them: bfloat16 becomes float32 (exact), other dtypes as stored."""
    if dtype == "bfloat16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block


class _Packet:
    """One step's rows in the ring, converted once for the lanes that take some of them."""

    def __init__(self, ring: np.ndarray, dtype: str, row0: int, n: int, groups: tuple) -> None:
        self.ring, self.dtype, self.row0, self.n = ring, dtype, row0, n
        self.request_ids, self.sites, self.starts, self.ends, *runs = groups
        self.positions, self.masks = cells_of_runs(*runs)
        self._lock = threading.Lock()
        self._data: np.ndarray | None = None

    def data(self) -> np.ndarray:
        """The rows as consumers get them, converted once (a new array, shared by the lanes: read-only)."""
        with self._lock:
            if self._data is None:
                data = as_float(self.ring[self.row0 : self.row0 + self.n], self.dtype)
                self._data = data if self.dtype == "bfloat16" else data.copy()  # a new array, not ring memory
                self._data.flags.writeable = False
            return self._data

    def raw(self, copy: bool) -> np.ndarray:
        """The rows as stored (bfloat16: its uint16 bits), for consumers with ``raw_rows``: this lane's
        read-only copy out of the ring (one copy of the packet, not one per (request, site)), or, without
        ``copy``, the ring itself (for a lane that copies the cells it takes by a boolean index)."""
        rows = self.ring[self.row0 : self.row0 + self.n]
        if not copy:
            return rows
        out = rows.copy()
        out.flags.writeable = False
        return out


def _columns(packet: _Packet, data: np.ndarray, positions: np.ndarray, mine: np.ndarray | None,
             meta: dict) -> RowPacket:
    """The packet as ``on_packet`` gets it: every cell (``mine`` None: a read-only view of ``data``), or only
    the cells of ``mine`` (copied by a boolean index; groups left empty are left out)."""
    starts, ends = np.asarray(packet.starts, dtype=np.int64), np.asarray(packet.ends, dtype=np.int64)
    rids, sites = packet.request_ids, packet.sites
    if mine is not None:
        counts = np.add.reduceat(mine.astype(np.int64), starts) if len(starts) else starts
        keep = np.flatnonzero(counts)
        rids, sites = [rids[g] for g in keep.tolist()], [sites[g] for g in keep.tolist()]
        ends = np.cumsum(counts[keep])
        starts = ends - counts[keep]
        data, positions = data[mine], positions[mine]
    data = data.view()
    data.flags.writeable = False
    return RowPacket(rids, sites, starts, ends, positions, data, meta)


class _HostLane:
    def __init__(self, bit: int, instance: str, consumer: Any, send) -> None:
        self.bit, self.instance, self.consumer, self.send = bit, instance, consumer, send
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"vllm-steer-capture-{instance}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if item[0] == "rows":
                try:
                    self._rows(item[1], item[2])
                finally:
                    self.send(("done", item[1], self.bit))
            else:
                self._finish(*item[1:])

    def _rows(self, packet_id: int, packet: _Packet) -> None:
        mine = (packet.masks & self.bit) != 0  # one pass over the packet's cells
        every = bool(mine.all())  # the common case: this consumer wants every cell (no per-group mask)
        if not every and not mine.any():
            return
        errors = 0
        raw = bool(getattr(self.consumer, "raw_rows", False))
        meta = {"dtype": packet.dtype} if raw else {}
        on_packet = getattr(self.consumer, "on_packet", None)
        # on_packet's data is valid during the call only: ring memory, not this lane's copy
        data = packet.raw(copy=every and on_packet is None) if raw else packet.data()
        positions = packet.positions
        if on_packet is not None:  # the whole step in one call
            try:
                on_packet(_columns(packet, data, positions, None if every else mine, meta))
            except Exception:
                self.send(("errors", 1))
                logger.exception("vllm-steer: capture consumer %s raised in on_packet", self.instance)
            return
        on_rows = self.consumer.on_rows
        for request_id, (hook, layer), a, b in zip(packet.request_ids, packet.sites, packet.starts, packet.ends):
            # read-only views of the packet's copy, or boolean-index copies: never ring memory
            if every:
                pos, block = positions[a:b], data[a:b]
            else:
                take = mine[a:b]
                if not take.any():
                    continue
                pos, block = positions[a:b][take], data[a:b][take]
            try:
                on_rows(request_id, layer, hook, pos, block, meta)
            except Exception:
                errors += 1
                logger.exception("vllm-steer: capture consumer %s raised in on_rows", self.instance)
        if errors:
            self.send(("errors", errors))

    def _finish(self, request_id: str, key: str, meta: dict) -> None:
        errors = 0
        for layer, hook, count, last_pos, mean, row in meta.pop("reduced", ()):  # reduced on the device
            try:
                self.consumer.on_reduced(request_id, layer, hook, "mean" if mean else "last",
                                         row / count if mean else row, count, last_pos)
            except Exception:
                errors += 1
                logger.exception("vllm-steer: capture consumer %s raised in on_reduced", self.instance)
        if errors:
            self.send(("errors", errors))
        try:
            out = self.consumer.on_request_finished(request_id, meta)
        except Exception as exc:
            out = self._failed(exc)
        if isinstance(out, Future):  # e.g. files still being published: answer when done, go on now
            out.add_done_callback(lambda fut: self.send(("finished", key, self.bit, self._outcome(fut))))
            return
        self.send(("finished", key, self.bit, out))

    def _outcome(self, fut: Future) -> Any:
        exc = fut.exception()
        return self._failed(exc) if exc is not None else fut.result()

    def _failed(self, exc: BaseException) -> dict:
        self.send(("errors", 1))
        logger.error("vllm-steer: capture consumer %s raised in on_request_finished", self.instance,
                     exc_info=(type(exc), exc, exc.__traceback__))
        return {"error": "consumer_error", "message": f"{type(exc).__name__}: {exc}"[:1000]}


def _report_stats(consumers: dict[int, tuple[str, Any]], send, stop: threading.Event) -> None:
    """Consumers' own counters (an optional ``stats()``, e.g. the filesystem consumer's write errors) to the
    worker, which adds them to its capture stats (``/metrics``)."""
    last: dict = {}
    while not stop.wait(STATS_S):
        now = {}
        for bit, (instance, consumer) in consumers.items():
            if callable(getattr(consumer, "stats", None)):
                try:
                    now[bit] = {k: int(v) for k, v in consumer.stats().items()}
                except Exception:
                    logger.exception("vllm-steer: capture consumer %s raised in stats", instance)
        if now != last:
            send(("stats", now))
            last = now


def serve(cmd: Connection, res: Connection) -> None:
    init = cmd.recv()[1]
    # the worker's path in the worker's order: consumers it can import, we import the same way (inserting
    # its later entries first would let e.g. setuptools' vendored typing_extensions shadow the real one)
    sys.path[:] = [*init["sys_path"], *(p for p in sys.path if p not in init["sys_path"])]
    try:
        ring = ring_view(init["ring_fd"], init["ring_rows"], init["hidden"], init["dtype"])
        consumers = {bit: (instance, _load(path)(instance, **params))
                     for bit, instance, path, params in init["consumers"]}
    except BaseException as exc:  # a consumer that cannot start: the worker raises this at start-up
        res.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    res.send(("ready", {bit: getattr(c, "global_spec", None) for bit, (_, c) in consumers.items()}))
    out_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with out_lock:
            try:
                res.send(msg)
            except OSError:  # the worker is gone: nothing to answer
                pass

    lanes = {bit: _HostLane(bit, instance, c, send) for bit, (instance, c) in consumers.items()}
    stop = threading.Event()
    threading.Thread(target=_report_stats, args=(consumers, send, stop), name="vllm-steer-capture-stats",
                     daemon=True).start()
    try:
        _read_commands(cmd, ring, init["dtype"], lanes)
    except _Stop:  # SIGTERM while reading; once the reading is over, SIGTERM is ignored (the drain is bounded)
        pass
    stop.set()
    for lane in lanes.values():  # deliver what was sent, then close the consumers
        lane.queue.put(None)
    deadline = time.monotonic() + DRAIN_S
    for lane in lanes.values():
        lane.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if lane.thread.is_alive():
            logger.warning("vllm-steer: capture consumer %s still busy after %.0f s of draining: rows it had not "
                           "taken are lost", lane.instance, DRAIN_S)
        try:
            lane.consumer.close()
        except Exception:
            logger.exception("vllm-steer: capture consumer %s raised in close", lane.instance)


class _Stop(Exception):
    """Raised in the main thread by SIGTERM while it reads commands: stop reading, deliver what was received."""


_reading = False  # SIGTERM raises _Stop only inside _read_commands (a signal at its return must not cut the drain)


def _on_sigterm(signum, frame) -> None:
    if _reading:
        raise _Stop


def _read_commands(cmd: Connection, ring: Any, dtype: str, lanes: dict[int, _HostLane]) -> None:
    """Hand each command to its lanes' queues until the pipe closes (or SIGTERM: ``_Stop``)."""
    global _reading
    _reading = True
    try:
        while True:
            try:
                msg = cmd.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "rows":
                _, packet_id, row0, n, groups, bits = msg
                packet = _Packet(ring, dtype, row0, n, groups)
                for bit in bits:
                    lanes[bit].queue.put(("rows", packet_id, packet))
            elif msg[0] == "finish":
                _, request_id, key, metas = msg
                for bit, meta in metas.items():
                    lanes[bit].queue.put(("finish", request_id, key, meta))
    finally:
        _reading = False


def main(argv: list[str]) -> int:
    parent, cmd_fd, res_fd = (int(a) for a in argv[1:4])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _die_with_parent(parent)
    os.nice(NICE)  # a consumer burning CPU must not slow the engine's steps (its queues drop, counted, instead)
    logging.basicConfig(level=logging.INFO, format="(capture host pid=%(process)d) %(levelname)s %(message)s")
    serve(Connection(cmd_fd, writable=False), Connection(res_fd, readable=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
