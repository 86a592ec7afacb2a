"""Debug-only timestamps of one request's stages in the API process (``VLLM_STEER_TRACE_PATH=1``).

Off by default: ``ON`` is read once at import and every call site tests it first, so an untraced server
does no work for it. When on, the request middleware (server.request_body) opens a ``Trace`` per steered
HTTP request, the preparation, the hand-over by token and ``process_inputs`` stamp it, and the first
response byte closes it with one log line: milliseconds from the request's arrival to each stage.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("vllm.steer")

ON = os.environ.get("VLLM_STEER_TRACE_PATH", "") not in ("", "0")
_BY_TOKEN: dict[str, "Trace"] = {}


class Trace:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stamps: list[tuple[str, float]] = []

    def stamp(self, stage: str) -> None:
        self.stamps.append((stage, time.perf_counter()))

    def bind(self, token: str | None) -> None:
        """Later stages (``process_inputs``) find this trace by the request's token."""
        if token is not None:
            _BY_TOKEN[token] = self

    def close(self, token: str | None, body_bytes: int) -> None:
        _BY_TOKEN.pop(token, None)
        self.stamp("first_byte")
        stages = " ".join(f"{name}={(t - self.t0) * 1e3:.2f}" for name, t in self.stamps)
        logger.info("vllm-steer trace: bytes=%d %s (ms since arrival)", body_bytes, stages)


def stamp(token: object, stage: str) -> None:
    """Stamp the trace of the request holding ``token`` (nothing if none)."""
    trace = _BY_TOKEN.get(token) if isinstance(token, str) else None
    if trace is not None:
        trace.stamp(stage)
