"""Driver consumers' results arriving in this process on a side channel (one ZMQ PULL socket).

Every process that submits capturing requests (each API server process, a ``vllm.LLM`` user) has one
``ResultInbox`` (``inbox()``), bound on first use to an ipc path. The front end puts that address in
each capturing request's engine payload (``capture_reply``) and registers the request here
(``expect``: the driver instances whose results come back and how many worker messages end it); the
worker holding the request's consumers PUSHes ``(id, count, results, stage)`` to it when every consumer
has handled the request's end (``runtime.result_push``). A reader thread files the messages; waiters
(``wait`` for asyncio, ``wait_blocking``) are woken when their ids are complete. Nothing here asks the
engine anything.

Pipeline parallelism: every stage holding a consumer of the request sends its own messages, and a
driver instance whose sites span stages sends a result from each. Results are kept per stage and
merged when the request is taken (``_resolved``: the consumer class's ``merge``, given by the front
end, over the stages' results in stage order). A failed stage decides its instance's result: the first
error object in stage order, or ``timeout`` / ``engine_dead`` for a stage that never answered, with
``"stage": k`` added when the instance spans stages; a raising ``merge`` gives ``merge_failed``.

Bounds: at most ``MAX_ENTRIES`` registered requests (the oldest dropped past it, counted in
``stats["evicted"]``); complete results nobody collects expire after their TTL; a message for an
unknown id (evicted, or collected already) is counted (``stats["unexpected"]``) and dropped. A wait
ends at its deadline, each driver instance without a result then holding ``timeout_error``, or at once
with ``engine_dead_error`` once the caller's ``dead()`` says the engine is gone.

Wire format: msgspec msgpack of ``[id, count, results, stage]`` (no pickle: the socket is a local path any
local process could connect to).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import msgspec
import zmq
from prometheus_client import Counter

logger = logging.getLogger("vllm.steer")

MAX_ENTRIES = 65536  # requests registered and not yet collected, in this process
# what the bounds dropped, on /metrics (per API process; summed by vLLM's multiprocess collector)
METRICS = {"evicted": Counter("vllm_steer_capture_inbox_evicted", "Capture results dropped by this process's bounds "
                              "(more than MAX_ENTRIES registered, or complete and uncollected past their TTL)"),
           "unexpected": Counter("vllm_steer_capture_inbox_unexpected", "Capture result messages for no waiting "
                                 "request (evicted, or collected already): dropped"),
           "bad_messages": Counter("vllm_steer_capture_inbox_bad_messages", "Malformed capture result messages")}
DONE_TTL_S = 60.0  # complete results nobody waits for (at least; see ``ResultInbox.ttl``)
DEAD_CHECK_S = 0.2  # how often a waiting response looks at its engine's health (a local flag, no call)

def _plain(obj: Any) -> Any:
    """numpy values a consumer returns travel as lists / Python scalars (as they would print in JSON)."""
    tolist = getattr(obj, "tolist", None)
    if tolist is not None:
        return tolist()
    raise NotImplementedError(f"cannot send a {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_plain)
_decoder = msgspec.msgpack.Decoder()


def encode_message(key: str, count: int, results: dict, stage: int = 0) -> bytes:
    """One worker message (from pipeline stage ``stage``); a result that cannot be encoded is sent as an
    error object instead."""
    try:
        return _encoder.encode([key, count, results, stage])
    except Exception:
        pass
    sendable = {}
    for instance, result in results.items():
        try:
            _encoder.encode(result)
            sendable[instance] = result
        except Exception as e:
            sendable[instance] = {"error": "unserializable", "message": f"the result could not be sent: {e}"}
    return _encoder.encode([key, count, sendable, stage])


def decode_message(data: bytes) -> tuple[str, int, dict, int]:
    key, count, results, stage = _decoder.decode(data)
    return str(key), int(count), dict(results), int(stage)


def timeout_error(timeout: float) -> dict:
    """What ``capture`` holds for a driver instance whose result did not come in time."""
    return {"error": "timeout", "message": f"no result within {timeout:g} s (steer.capture_result_timeout_s)"}


def engine_dead_error() -> dict:
    """What ``capture`` holds for a driver instance whose engine died before its result came."""
    return {"error": "engine_dead", "message": "the engine stopped before this request's capture results came"}


def _is_error(result: Any) -> bool:
    """An error object (``{"error": code, "message": ...}``) rather than a consumer's result."""
    return isinstance(result, dict) and isinstance(result.get("error"), str) and "message" in result


@dataclass
class _Entry:
    instances: list[str]  # driver instances whose results come back
    messages: int  # worker messages (engine requests x pushing stages) that end it
    requests: int  # engine requests: each pushing stage's final messages count them
    stages: dict[str, tuple[int, ...]]  # driver instance -> the pipeline stages it runs on (absent: stage 0)
    merge: dict[str, Callable[[list], Any] | None]  # instance -> its class's merge (instances spanning stages)
    got: int = 0
    got_by_stage: dict[int, int] = field(default_factory=dict)
    results: dict[str, dict[int, Any]] = field(default_factory=dict)  # instance -> stage -> result
    done_at: float | None = None
    wakers: list[Callable[[], None]] = field(default_factory=list)

    def missing(self, stage: int) -> bool:
        """Whether ``stage`` still owes final messages (it never answered in time)."""
        return self.done_at is None and self.got_by_stage.get(stage, 0) < self.requests


class ResultInbox:
    def __init__(self) -> None:
        from vllm.utils.network_utils import get_open_zmq_ipc_path

        self.address = get_open_zmq_ipc_path()
        self.ttl = DONE_TTL_S
        self.stats = {"received": 0, "unexpected": 0, "evicted": 0, "bad_messages": 0}
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._swept = 0.0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._closed = False
        self._thread = threading.Thread(target=self._read, name="vllm-steer-capture-inbox", daemon=True)
        self._thread.start()

    def _count(self, stat: str) -> None:
        self.stats[stat] += 1
        METRICS[stat].inc()

    # ---- registration (the front end, when a capturing request is submitted) ----------
    def expect(self, key: str, instances: Iterable[str], messages: int, *, requests: int | None = None,
               stages: dict[str, tuple[int, ...]] | None = None,
               merge: dict[str, Callable[[list], Any] | None] | None = None) -> None:
        """``messages`` end ``key`` (0: nothing will come, it is complete now); ``requests``: the engine
        requests each pushing stage's final messages count (default ``messages``: one stage);
        ``stages``: the pipeline stages each driver instance runs on (default stage 0 only), whose
        results ``merge`` joins (instance -> the consumer class's ``merge``, None if it has none)."""
        e = _Entry(sorted(instances), max(0, messages), messages if requests is None else requests,
                   stages or {}, merge or {})
        if not e.messages:
            e.done_at = time.monotonic()
        with self._lock:
            self._entries[key] = e
            self._entries.move_to_end(key)
            self._evict()

    def _evict(self) -> None:
        """Lock held: keep at most MAX_ENTRIES; complete results older than the TTL go."""
        now = time.monotonic()
        while len(self._entries) > MAX_ENTRIES:
            _, e = self._entries.popitem(last=False)
            self._count("evicted")
            self._wake(e)
        if now - self._swept < 1.0:
            return
        self._swept = now  # at most one walk a second
        for key in [k for k, e in self._entries.items() if e.done_at is not None and now - e.done_at > self.ttl
                    and not e.wakers]:
            del self._entries[key]
            self._count("evicted")

    # ---- the reader thread --------------------------------------------------------------
    def _read(self) -> None:
        while not self._closed:
            try:
                if not self._sock.poll(500):
                    continue
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._closed:
                    return
                logger.exception("vllm-steer: the capture result inbox failed to receive")
                time.sleep(0.1)
                continue
            try:
                self.deliver(*decode_message(data))
            except Exception:
                self._count("bad_messages")
                logger.exception("vllm-steer: a malformed capture result message was dropped")

    def deliver(self, key: str, count: int, results: dict, stage: int = 0) -> None:
        """File one worker's message for ``key`` from pipeline stage ``stage`` (the reader thread;
        tests call it directly)."""
        with self._lock:
            self.stats["received"] += 1
            e = self._entries.get(key)
            if e is None:
                self._count("unexpected")
                return
            for instance, result in results.items():
                e.results.setdefault(instance, {})[stage] = result
            e.got += count
            e.got_by_stage[stage] = e.got_by_stage.get(stage, 0) + count
            if e.got >= e.messages and e.done_at is None:
                e.done_at = time.monotonic()
                self._wake(e)

    @staticmethod
    def _wake(e: _Entry) -> None:
        for waker in e.wakers:
            waker()

    # ---- waiting --------------------------------------------------------------------------
    def _arm(self, keys: list[str], waker: Callable[[], None]) -> None:
        """Add ``waker`` to each open entry (called when it completes or is evicted)."""
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None and e.done_at is None:
                    e.wakers.append(waker)

    def _complete(self, keys: list[str]) -> bool:
        """Every id complete (or unknown: evicted, never registered)."""
        with self._lock:
            return all(k not in self._entries or self._entries[k].done_at is not None for k in keys)

    def _take(self, keys: list[str], timeout: float, expected: dict[str, list[str]] | None,
              dead: bool) -> dict[str, dict]:
        """Results by id (removing them); each missing driver instance gets an error object."""
        with self._lock:
            entries = {key: self._entries.pop(key, None) for key in keys}
        missing = engine_dead_error() if dead else timeout_error(timeout)
        out = {}
        for key, e in entries.items():  # merging runs outside the lock
            if e is None:  # evicted, or never registered: every expected instance is missing
                out[key] = {instance: dict(missing) for instance in (expected or {}).get(key, ())}
                continue
            res = {}
            for instance in sorted(set(e.instances) | set(e.results)):
                result = _resolved(e, instance, missing)
                if result is not None:
                    res[instance] = result
            out[key] = res
        return out

    async def wait(self, keys: list[str], timeout: float, expected: dict[str, list[str]] | None = None,
                   dead: Callable[[], bool] = lambda: False) -> dict[str, dict]:
        """Results by id once every id is complete, at ``timeout`` or as soon as ``dead()``."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        deadline = time.monotonic() + timeout

        def waker() -> None:
            loop.call_soon_threadsafe(event.set)

        gone = False
        self._arm(keys, waker)
        while not self._complete(keys):
            left = deadline - time.monotonic()
            gone = dead()
            if left <= 0 or gone:
                break
            try:
                await asyncio.wait_for(event.wait(), min(left, DEAD_CHECK_S))
            except asyncio.TimeoutError:
                pass
            event.clear()
        self._disarm(keys, waker)
        return self._take(keys, timeout, expected, gone)

    def wait_blocking(self, keys: list[str], timeout: float, dead: Callable[[], bool] = lambda: False
                      ) -> dict[str, dict]:
        """``wait`` for a caller without an event loop (``capture.collect``)."""
        event = threading.Event()
        deadline = time.monotonic() + timeout
        gone = False
        self._arm(keys, event.set)
        while not self._complete(keys):
            left = deadline - time.monotonic()
            gone = dead()
            if left <= 0 or gone:
                break
            event.wait(min(left, DEAD_CHECK_S))
            event.clear()
        self._disarm(keys, event.set)
        return self._take(keys, timeout, None, gone)

    def _disarm(self, keys: list[str], waker: Callable[[], None]) -> None:
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    e.wakers = [w for w in e.wakers if w is not waker]

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


def _resolved(e: _Entry, instance: str, missing: dict) -> Any:
    """One driver instance's result from its stages' (None: it returned nothing)."""
    by_stage = e.results.get(instance, {})
    expected = e.stages.get(instance, (0,) if instance in e.instances else ())
    stages = sorted(set(expected) | set(by_stage))
    spans = len(stages) > 1
    for stage in stages:  # the first failed stage, in stage order, is the instance's result
        result = by_stage.get(stage)
        if result is None and stage in expected and e.missing(stage):
            result = dict(missing)
        if _is_error(result):
            return {**result, "stage": stage} if spans else result
    got = [by_stage[s] for s in stages if by_stage.get(s) is not None]
    if len(got) <= 1:
        return got[0] if got else None
    merge = e.merge.get(instance)
    if merge is None:
        return {"error": "not_mergeable", "message": f"consumer instance {instance!r} returned results on pipeline "
                f"stages {[s for s in stages if by_stage.get(s) is not None]} and its class defines no merge"}
    try:
        return merge(got)
    except Exception as exc:  # noqa: BLE001 - a consumer's bug is its request's result, never the server's
        logger.exception("vllm-steer: merging %s's capture results failed", instance)
        return {"error": "merge_failed", "message": f"merging the pipeline stages' results failed: "
                                                    f"{type(exc).__name__}: {exc}"}


_INBOX: ResultInbox | None = None
_INBOX_LOCK = threading.Lock()


def inbox() -> ResultInbox:
    """This process's inbox (bound on first use)."""
    global _INBOX
    if _INBOX is None:
        with _INBOX_LOCK:
            if _INBOX is None:
                _INBOX = ResultInbox()
    return _INBOX
