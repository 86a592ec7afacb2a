"""Worker side of the capture host: the shared-memory row ring, the host process, and its two threads.

A capturing worker runs its consumers in one child process (``runtime.capture_host``), so nothing a
consumer does competes with the model runner for the GIL. Per step, ``send_rows`` copies the used pool
rows into a ring of shared memory (a memfd both processes map; on a GPU it is registered as pinned
memory and the copy is a non-blocking D2H on the capture stream) and queues the packet's entries
for the notifier thread, which waits for the copy's event (the GIL released) and writes them to
the host's command pipe (a step's finish notices reach it as one item, ``finish``, and the host as one
message each). The reader thread takes the host's answers: a lane done with a packet frees
its slot (and, for the last lane, the packet's ring rows), a finished request goes to
``CaptureRuntime._finished_by`` exactly as the in-process lanes did.

Bounds (never waited for): each consumer has at most ``max_row_packets`` row packets and
``max_finishes`` finish notices in flight (``Lane.row_slots`` / ``finish_slots``, taken by
``CaptureRuntime``), and the ring holds ``RING_STEPS`` full pools; a packet that finds no room in the
ring is dropped for every consumer that wanted it and counted (``stats["ring_full"]`` and, per
consumer, ``dropped_packets``), named in each request's ``meta["dropped"]``.

On a GPU the notifier holds its Python work for a step's packets and finishes (pickling, reading reduced rows,
writing the pipe) until the next step's forward is launched (``launched``; at most ``GATE_S``): their copies end with
the step's GPU work, which is when the next step's host work (the engine's update and schedule, the runner's input
preparation) stands between the GPU and its next kernels: a thread taking the GIL there costs the GPU its time 1:1
(s38's prefill profile: vLLM's per-request loop ran 4x slower beside them). The reader's answers from the host come
whenever the consumers are done (a filesystem consumer's after its writes): one that comes while the GPU runs a step
is handled at once; those that come after the step's GPU work is done wait for the next launch, handled together.

If the host dies (a consumer crashed it, or it was killed), the worker logs it once, counts
``stats["consumer_host_deaths"]``, answers every request still waiting on its consumers with
``{"error": "consumer_died", ...}`` (driver results) and from then on captures nothing for them:
capture is disabled for this worker's consumers until the engine restarts; generation goes on.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import torch

from vllm_steer.runtime.streams import current_stream

logger = logging.getLogger("vllm.steer.capture")

RING_STEPS = 4  # the ring holds this many full device pools (steer.capture_max_rows rows each)
GATE_S = 0.01  # the longest the notifier waits for the next launch (an engine with no next step: its last results)
HOST_START_S = 120.0  # the host must have built its consumers by then


class Lane:
    """The worker's view of one consumer in the host: its in-flight bounds and unanswered finishes."""

    def __init__(self, bit: int, instance: str, driver: bool, max_row_packets: int, max_finishes: int) -> None:
        self.bit, self.instance, self.driver = bit, instance, driver
        self.row_slots = threading.Semaphore(max_row_packets)
        self.finish_slots = threading.Semaphore(max_finishes)
        self.outstanding: dict[str, int] = {}  # key -> finish notices the host has not answered


class RowRing:
    """Contiguous row ranges of the ring, handed out in order; a range is reused once it and every
    older one are freed (packets finish nearly in order: a slow lane only delays reuse)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._live: deque[list] = deque()  # [packet id, start, end, freed], oldest first
        self._by_id: dict[int, list] = {}
        self._lock = threading.Lock()

    def alloc(self, packet_id: int, n: int) -> int | None:
        with self._lock:
            if not self._live:
                start = 0 if n <= self.rows else None
            else:
                first, last = self._live[0][1], self._live[-1][2]
                if self._live[-1][1] >= first:  # not wrapped: free are [last, rows) and [0, first)
                    start = last if last + n <= self.rows else (0 if n <= first else None)
                else:  # wrapped: free is [last, first)
                    start = last if last + n <= first else None
            if start is not None:
                entry = [packet_id, start, start + n, False]
                self._live.append(entry)
                self._by_id[packet_id] = entry
            return start

    def free(self, packet_id: int) -> None:
        with self._lock:
            entry = self._by_id.pop(packet_id, None)
            if entry is not None:
                entry[3] = True
            while self._live and self._live[0][3]:
                self._live.popleft()


class _Reduced:
    """Ring rows holding a batch of finished requests' device-reduced rows (``CaptureHost.stage_reduced``): freed
    when the step thread and every finish notice reading them let go."""

    def __init__(self, ring: RowRing, packet_id: int, start: int, n_ring: int, n: int, source: Any = None) -> None:
        self.ring, self.packet_id, self.start, self.n_ring, self.n = ring, packet_id, start, n_ring, n
        self._refs = 1  # the step thread's, until its notices are queued
        self._lock = threading.Lock()
        # the device rows being copied (``_copy_into``): alive until the notices that waited on the
        # copy let go, instead of ``record_stream``, whose event every later allocation of the step would poll
        self.source = source

    def hold(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.source = None
            self.ring.free(self.packet_id)


class CaptureHost:
    """The consumers' process of one worker, fed through the ring and a pipe."""

    def __init__(self, rt: Any, consumers: list[tuple[int, str, type, dict]], ring_rows: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, max_row_packets: int, max_finishes: int,
                 gate: bool = True) -> None:
        self.rt = rt
        self.lanes = {bit: Lane(bit, instance, getattr(cls, "location", None) == "driver", max_row_packets,
                                max_finishes) for bit, instance, cls, _ in consumers}
        self.dead = False
        self.consumer_stats: dict[int, dict[str, int]] = {}  # bit -> the consumer's own counters (host's last)
        self._closing = False
        self._lock = threading.Lock()
        # forwards launched (``launched``): a notifier item queued after launch k waits for launch k + 1 (GPU only)
        self._launches = 0
        self._launch = threading.Condition()
        self._waiting = 0  # threads waiting for a launch (``_after_launch``: the notifier, the reader)
        self._gated = device.type == "cuda" and gate
        self.step_event: Any = None  # the last step's output event (the runner's: ``CaptureRuntime.after_forward``)
        self._refs: dict[int, int] = {}  # packet id -> lanes not yet done with it
        self._next_id = 0
        self.ring = RowRing(ring_rows)
        elem = torch.empty((), dtype=dtype).element_size()
        size = ring_rows * hidden * elem
        self._fd = os.memfd_create("vllm-steer-capture", os.MFD_CLOEXEC)  # only the host inherits it
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self.rows = torch.frombuffer(self._map, dtype=dtype).view(ring_rows, hidden)
        if device.type == "cuda":  # the D2H copy lands in the shared pages directly
            err = torch.cuda.cudart().cudaHostRegister(self.rows.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"vllm-steer: cudaHostRegister of the capture ring ({size} bytes) failed: {err}")
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_steer.runtime.capture_host", str(os.getpid()), str(cmd_r), str(res_w)],
            pass_fds=(cmd_r, res_w, self._fd), stdin=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(res_w)
        self._cmd = Connection(cmd_w, readable=False)
        self._res = Connection(res_r, writable=False)
        dtype_name = str(dtype).removeprefix("torch.")
        try:
            self._cmd.send(("init", {
                "sys_path": list(sys.path), "ring_fd": self._fd, "ring_rows": ring_rows, "hidden": hidden,
                "dtype": dtype_name,
                "consumers": [(bit, instance, f"{cls.__module__}:{cls.__qualname__}", params)
                              for bit, instance, cls, params in consumers]}))
            answer = self._res.recv() if self._res.poll(HOST_START_S) else ("failed", f"no answer in {HOST_START_S:.0f} s")
        except (EOFError, OSError) as exc:
            answer = ("failed", f"the capture host exited at start ({type(exc).__name__})")
        if answer[0] != "ready":
            self.close()
            raise RuntimeError(f"vllm-steer: capture consumers failed to start: {answer[1]}")
        self.global_specs: dict[int, Any] = answer[1]
        self._notify: queue.Queue = queue.Queue()  # bounded by the lanes' slots
        threading.Thread(target=self._notifier, name="vllm-steer-capture-notify", daemon=True).start()
        threading.Thread(target=self._reader, name="vllm-steer-capture-results", daemon=True).start()

    # ---- the step thread ---------------------------------------------------------------------
    def launched(self) -> None:
        """A step's forward is launched (the GPU has its work queued): the notifier goes on with what the steps before
        it queued, the reader with the answers that came meanwhile. A step with no thread waiting costs one add (the
        step thread alone writes the count; a thread about to wait reads it under the lock after saying so)."""
        self._launches += 1
        if self._waiting:
            with self._launch:
                self._launch.notify_all()

    def _tag(self) -> int:
        """The launch a notifier item (or an answer the reader got) waits for: the next one (0: none, on a CPU or with
        the gate off)."""
        return self._launches + 1 if self._gated else 0

    def _gpu_busy(self) -> bool:
        """Whether the GPU still runs the last step handed on (its output's event, ``step_event``, pending); False
        when there is none or it cannot say (the reader then waits for the next launch, as before)."""
        event = self.step_event
        try:
            return event is not None and not event.query()
        except Exception:  # never the reader's end: an event of another kind, a device error
            return False

    def _after_launch(self, tag: int) -> None:
        with self._launch:
            self._waiting += 1
            try:
                self._launch.wait_for(lambda: self._launches >= tag, GATE_S)
            finally:
                self._waiting -= 1

    def send_rows(self, rows: torch.Tensor, groups: tuple, lanes: list[Lane], copy_stream: Any) -> Any:
        """Copy ``rows`` into the ring and queue the packet for ``lanes`` (their row slots taken); ``groups``:
        ``StepPlan.wire()`` (request ids, sites, starts, ends, the cells' runs: columns, so the notifier's
        pickle does not grow by one tuple of arrays per (request, site)).
        Returns the copy's event (GPU), True (CPU), or None when the ring is full (nothing queued)."""
        n = rows.shape[0]
        packet_id = self._next_id
        self._next_id += 1
        start = self.ring.alloc(packet_id, n)
        if start is None:
            return None
        event = _copy_into(self.rows[start : start + n], rows, copy_stream)
        with self._lock:
            self._refs[packet_id] = len(lanes)
        self._notify.put((event, self._tag(), ("rows", packet_id, start, n, groups, [lane.bit for lane in lanes])))
        return event if event is not None else True

    def finish(self, notices: list[tuple], event: Any = None) -> None:
        """Queue finish notices, one per (request, lane) as ``(lane, request id, key, meta, request, reduced)`` (each
        lane's finish slot taken), in one item for the notifier (one wake-up a step, not one a request); ``reduced``:
        the request's device-reduced rows for that consumer: ``(block, first row, n, items)`` of a ``stage_reduced``
        block (``event``: its copy's; per row ``(layer, hook, count, last position, mean)``), ``("lost", rows)``
        when the ring had no room, or None."""
        with self._lock:
            dead = self.dead
            if not dead:
                for lane, _, key, *_ in notices:
                    lane.outstanding[key] = lane.outstanding.get(key, 0) + 1
        if dead:
            for lane, _, key, *_ in notices:
                lane.finish_slots.release()
                self.rt._finished_by(key, lane.bit, lane.instance, self._died_result())
            return
        staged = False
        for *_, reduced in notices:
            if reduced is not None and reduced[0] != "lost":
                reduced[0].hold()
                staged = True
        self._notify.put((event if staged else None, self._tag(),
                          ("finish", [(lane.bit, *rest) for lane, *rest in notices])))

    def stage_reduced(self, rows: torch.Tensor, copy_stream: Any) -> tuple[Any, "_Reduced"] | None:
        """Copy finished requests' float32 reduced rows ``[n, D]`` into the ring (a model-dtype ring holds a float32
        row in 4 / itemsize ring rows): (the copy's event, the block their finish notices read), or None when the
        ring is full. The caller holds the block until its notices are queued (then ``_Reduced.release``)."""
        n, hidden = rows.shape
        per = 4 // self.rows.element_size()
        packet_id = self._next_id
        self._next_id += 1
        start = self.ring.alloc(packet_id, n * per)
        if start is None:
            return None
        event = _copy_into(self.rows[start : start + n * per].view(torch.float32).view(n, hidden), rows, copy_stream)
        return event, _Reduced(self.ring, packet_id, start, n * per, n, rows)

    def _read_reduced(self, red: tuple) -> tuple[list, int]:
        """(the reduced rows as numpy, with their items; rows lost) once the copy is done; the last notice of a
        block frees its ring rows."""
        if red[0] == "lost":
            return [], red[1]
        block, first, n, items = red
        rows = self.rows[block.start : block.start + block.n_ring].view(torch.float32).view(block.n, -1)
        data = rows[first : first + n].numpy().copy()
        block.release()
        return [(*item, row) for item, row in zip(items, data)], 0

    # ---- threads -----------------------------------------------------------------------------
    def _notifier(self) -> None:
        while True:
            event, tag, msg = self._notify.get()
            if msg is None:  # closing: what was queued before went out
                self._cmd.close()
                return
            # a step's finish notices come as one item; each goes to the host as its own message, all of them once the
            # next step is launched (one wait an item: a step's wave of ends is not spread over later steps)
            for notice in (msg[1] if msg[0] == "finish" else (None,)):
                if self.dead:
                    break
                try:
                    if event is not None:
                        event.synchronize()  # releases the GIL (and sleeps: a blocking-sync event) while the copy runs
                        event = None
                    if tag:
                        self._after_launch(tag)
                        tag = 0
                    self._cmd.send(msg if notice is None else self._finish_message(*notice))
                except (OSError, ValueError) as exc:
                    self._died(f"its command pipe failed ({type(exc).__name__}: {exc})")
                except Exception:
                    logger.exception("vllm-steer: capture notice failed")

    def _finish_message(self, bit: int, request_id: str, key: str, meta: dict, req: Any, red: tuple | None) -> tuple:
        """A finish notice as the host reads it (its reduced rows read here: their copy is done)."""
        dropped = req.dropped_for(bit) if req.dropped else {}
        spec = req.specs.get(bit)
        reduced, lost = self._read_reduced(red) if red is not None else ([], 0)
        return ("finish", request_id, key, {bit: {
            **meta, "params": dict(spec.params) if spec is not None else {},
            "dropped": dropped, "dropped_rows": sum(map(len, dropped.values())) + lost,
            **({"reduced": reduced} if reduced else {})}})

    def _reader(self) -> None:
        while True:
            batch: list[bytes] = []
            try:
                batch.append(self._res.recv_bytes())  # the GIL released while it waits
                # on a GPU the answers' Python (unpickling, results pushed) is done while the GPU runs a step (its
                # output's event pending: the step thread launches or waits then); an answer that comes once the
                # step is done, when the host work between two steps is what the GPU waits for (the GIL taken there
                # costs the GPU its time 1:1), waits for the next launch, as the notifier's items do; then every
                # answer that came meanwhile goes in one batch (an idle engine: one GATE_S wait)
                if not self._gpu_busy() and (tag := self._tag()):
                    self._after_launch(tag)
                while self._res.poll(0):
                    batch.append(self._res.recv_bytes())
            except (EOFError, OSError):
                for data in batch:  # what came before the end is still answered
                    self._handle(data)
                self._died("it exited")
                return
            for data in batch:
                self._handle(data)

    def _handle(self, data: bytes) -> None:
        msg = None
        try:
            msg = pickle.loads(data)
            self._answer(msg)
        except Exception:
            logger.exception("vllm-steer: capture host answer %r failed", msg[0] if msg else data[:40])

    def _answer(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "done":
            _, packet_id, bit = msg
            self.lanes[bit].row_slots.release()
            with self._lock:
                left = self._refs[packet_id] = self._refs[packet_id] - 1
                if left == 0:
                    del self._refs[packet_id]
            if left == 0:
                self.ring.free(packet_id)
        elif kind == "finished":
            _, key, bit, out = msg
            lane = self.lanes[bit]
            with self._lock:
                n = lane.outstanding.get(key, 0)
                if n == 0:  # already answered (the host was declared dead meanwhile)
                    return
                if n == 1:
                    del lane.outstanding[key]
                else:
                    lane.outstanding[key] = n - 1
            lane.finish_slots.release()
            self.rt._finished_by(key, bit, lane.instance, out)
        elif kind == "errors":
            self.rt._count("consumer_errors", msg[1])
        elif kind == "stats":
            self.consumer_stats = msg[1]

    def _died_result(self) -> dict:
        return {"error": "consumer_died", "message": "the capture consumers' process died (see the worker log): "
                                                     "capture is disabled for them until the engine restarts"}

    def _died(self, why: str) -> None:
        with self._lock:
            if self.dead:
                return
            self.dead = True
            owed = {bit: dict(lane.outstanding) for bit, lane in self.lanes.items()}
            for lane in self.lanes.values():
                lane.outstanding.clear()
        if self._closing:
            return
        code = self.proc.poll()
        self.rt._count("consumer_host_deaths")
        logger.error("vllm-steer: the capture consumers' process (pid %d, exit code %s) died: %s; capture is "
                     "disabled for %s until the engine restarts; %d waiting request(s) get a consumer_died error",
                     self.proc.pid, code, why, sorted(lane.instance for lane in self.lanes.values()),
                     sum(sum(o.values()) for o in owed.values()))
        result = self._died_result()
        for bit, keys in owed.items():
            lane = self.lanes[bit]
            for key, n in keys.items():
                for _ in range(n):
                    lane.finish_slots.release()
                    self.rt._finished_by(key, bit, lane.instance, result)

    def close(self, timeout: float = 10.0) -> None:
        """Close the command pipe (the host delivers what it has, closes its consumers, exits)."""
        self._closing = True
        if hasattr(self, "_notify"):
            self._notify.put((None, 0, None))  # the notifier closes the pipe after what is queued
        else:
            self._cmd.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _copy_into(dst: torch.Tensor, rows: torch.Tensor, copy_stream: Any) -> Any:
    """Copy ``rows`` into ring rows ``dst``: on a GPU, on ``copy_stream`` after the work queued so far on the
    current stream (the forward that wrote them), returning the copy's event; on the CPU at once (None). The caller
    keeps ``rows`` alive until the event (a view of the persistent pool, never freed; a gathered tensor held with its
    block), so no ``record_stream``. The kept current stream (``runtime.streams``) and ``set_stream`` instead of a
    stream context: each Python-level stream call costs ~10-50 us of host time on a GPU host (s36's op times)."""
    if not rows.is_cuda:
        dst.copy_(rows)
        return None
    current = current_stream(rows.device)
    copy_stream.wait_event(current.record_event())
    torch.cuda.set_stream(copy_stream)
    try:
        dst.copy_(rows, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # the notifier sleeps on it instead of spinning a core
        event.record(copy_stream)
    finally:
        torch.cuda.set_stream(current)
    return event
