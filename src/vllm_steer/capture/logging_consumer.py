"""The ``logging`` capture consumer: per-request summary statistics of the captured residuals."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_steer.capture.consumer import BaseConsumer

logger = logging.getLogger("vllm.steer.capture")


class LoggingConsumer(BaseConsumer):
    location = "worker"

    def __init__(self, instance: str, **params: Any) -> None:
        super().__init__(instance, **params)
        self._stats: dict[str, dict[tuple[int, str], list[float]]] = {}

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        s = self._stats.setdefault(request_id, {}).setdefault((layer, hook), [0, 0.0, 0.0])
        norms = np.linalg.norm(rows.astype(np.float32), axis=1)
        s[0] += len(norms)
        s[1] += float(norms.sum())
        s[2] += float(rows.astype(np.float32).mean(axis=1).sum())

    def on_request_finished(self, request_id, meta) -> None:
        for (layer, hook), (n, norm_sum, mean_sum) in sorted(self._stats.pop(request_id, {}).items()):
            logger.info("vllm-steer capture %s: request %s layer %d %s: %d tokens, mean norm %.4f, mean %.6f",
                        self.instance, request_id, layer, hook, n, norm_sum / n, mean_sum / n)
        return None
