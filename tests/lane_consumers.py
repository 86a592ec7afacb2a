"""Capture consumers for tests/test_capture_lanes.py. They run in the capture host process (which
imports them by module path), so they are light to import and steered through files, not memory."""

from __future__ import annotations

import os
import time


class Stuck:
    """A driver whose every ``on_request_finished`` waits (≤ 60 s) for the file ``release`` to exist."""

    location = "driver"

    def __init__(self, instance: str, release: str = "", **params) -> None:
        self.release = release
        self.global_spec = None

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        pass

    def on_request_finished(self, request_id, meta):
        deadline = time.monotonic() + 60
        while self.release and not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"seen": request_id}

    def close(self) -> None:
        pass


class Quick(Stuck):
    def on_request_finished(self, request_id, meta):
        return {"seen": request_id, "rows": meta.get("dropped_rows")}


class Raising(Stuck):
    """A driver whose ``on_request_finished`` raises; on a request asking ``{"die": true}`` it ends its process."""

    def on_request_finished(self, request_id, meta):
        if meta.get("params", {}).get("die"):
            os._exit(3)
        raise KeyError(f"no probe for {request_id}")

    @classmethod
    def validate_params(cls, params) -> None:
        return None


class Summing(Stuck):
    """A driver returning what it received: per site the positions and the rows' sum."""

    def __init__(self, instance: str, **params) -> None:
        super().__init__(instance)
        self.got: dict = {}

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        site = self.got.setdefault(request_id, {}).setdefault(f"{hook}.{layer}", [[], 0.0, None])
        site[0] += [int(p) for p in positions]
        site[1] += float(rows.astype("float64").sum())
        site[2] = str(rows.dtype)

    def on_request_finished(self, request_id, meta):
        return {"sites": self.got.pop(request_id, {}), "dropped": meta.get("dropped")}
