"""Example capture consumers for vllm-steer (see README.md): a linear-probe scorer (driver), a
consumer that always raises (worker) and a slow driver (sleeps on finish when a request asks),
discovered through ``vllm.capture_consumers``."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np


def probe_weights(dim: int, seed: int) -> np.ndarray:
    """The probe direction: a unit vector from ``seed`` (tests recompute it)."""
    w = np.random.default_rng(seed).standard_normal(dim).astype(np.float64)
    return w / np.linalg.norm(w)


class LinearProbe:
    location = "driver"

    def __init__(self, instance: str, dim: int, seed: int = 0, bias: float = 0.0,
                 global_spec: dict | None = None) -> None:
        self.instance = instance
        self.w = probe_weights(int(dim), int(seed))
        self.b = float(bias)
        self.global_spec = global_spec
        self._sums: dict[str, tuple[np.ndarray, int]] = {}

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        if params:
            raise ValueError(f"the probe takes no per-request keys, got {sorted(params)}")

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        total, n = self._sums.get(request_id, (np.zeros_like(self.w), 0))
        self._sums[request_id] = (total + rows.astype(np.float64).sum(axis=0), n + len(rows))

    def on_request_finished(self, request_id, meta) -> dict | None:
        total, n = self._sums.pop(request_id, (None, 0))
        if not n:
            return None
        logit = float(self.w @ (total / n)) + self.b
        return {"score": 1.0 / (1.0 + math.exp(-logit)), "logit": logit, "rows": n}

    def close(self) -> None:
        return None


class ExplodingConsumer:
    location = "worker"

    def __init__(self, instance: str, **params: Any) -> None:
        self.instance = instance
        self.global_spec = params.get("global_spec")

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        return None

    def on_rows(self, *args: Any) -> None:
        raise RuntimeError("explode: on_rows always raises")

    def on_request_finished(self, request_id, meta) -> None:
        raise RuntimeError("explode: on_request_finished always raises")

    def close(self) -> None:
        return None


class SlowConsumer:
    """A driver whose ``on_request_finished`` sleeps ``sleep_s`` seconds (a per-request key, default
    0) before returning ``{"slept_s": ...}``: a stand-in for a consumer that takes seconds."""

    location = "driver"

    def __init__(self, instance: str, **params: Any) -> None:
        self.instance = instance
        self.global_spec = None

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        extra = set(params) - {"sleep_s"}
        if extra:
            raise ValueError(f"slow takes only sleep_s, got {sorted(extra)}")
        s = params.get("sleep_s", 0)
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not 0 <= s <= 60:
            raise ValueError("sleep_s: a number of seconds, 0 to 60")

    def on_rows(self, *args: Any) -> None:
        return None

    def on_request_finished(self, request_id, meta) -> dict:
        s = float(meta.get("params", {}).get("sleep_s", 0))
        time.sleep(s)
        return {"slept_s": s}

    def close(self) -> None:
        return None
