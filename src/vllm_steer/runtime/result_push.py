"""Worker side of the capture result channel: PUSH a finished request's driver results to the
process that submitted it (its ``capture_reply`` address; the receiving end is ``capture.inbox``).

One PUSH socket per address, connected on first use and kept (a process that submits requests keeps
one address for its life; at most ``MAX_SOCKETS`` are kept, the least recently used closed past it).
Sends never block: each socket queues at most ``SEND_HWM`` messages for a peer that is slow or gone;
past that (or on any send error) the message is dropped, counted (``failed``, reported in the capture
stats as ``result_push_failed``) and logged once a minute. A result that msgpack cannot encode is
sent as an error object for its instance (``capture.inbox.encode_message``). Never raises into the caller (a consumer lane).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import zmq

from vllm_steer.capture.inbox import encode_message

logger = logging.getLogger("vllm.steer.capture")

SEND_HWM = 1024
MAX_SOCKETS = 64


class ResultPusher:
    def __init__(self) -> None:
        self.sent = 0
        self.failed = 0
        self._lock = threading.Lock()  # lanes push from their threads; zmq sockets are not thread-safe
        self._ctx: zmq.Context | None = None
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._logged = 0.0

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._socks[address] = sock
            while len(self._socks) > MAX_SOCKETS:
                self._socks.popitem(last=False)[1].close(0)
        self._socks.move_to_end(address)
        return sock

    def push(self, address: str, key: str, count: int, results: dict, stage: int = 0) -> bool:
        try:
            data = encode_message(key, count, results, stage)
            with self._lock:
                self._socket(address).send(data, zmq.NOBLOCK)
                self.sent += 1
            return True
        except Exception as e:
            with self._lock:
                self.failed += 1
                now = time.monotonic()
                log, self._logged = now - self._logged > 60, (now if now - self._logged > 60 else self._logged)
            if log:
                logger.warning("vllm-steer: a capture result for %s could not be sent to %s (%s: %s); "
                               "its response gets a timeout error", key, address, type(e).__name__, e)
            return False

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close(0)
            self._socks.clear()
