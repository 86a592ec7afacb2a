"""``activations``: the built-in driver consumer that returns each request's residual, reduced.

Enable it in the steer block (``"capture": ["activations"]``) and ask for it per request:
``{"capture": {"activations": {"layers": [..], "hooks": ["post_mlp"], "positions": "last_prompt",
"reduce": "last"}}}``. ``reduce``: ``"last"`` (the row at the highest captured position, the
default) or ``"mean"`` (the mean over every captured position). The result, in the response's
``capture`` field (no files):

    {"sites": ["post_mlp.3", ...], "count": [rows reduced per site], "shape": [n_sites, hidden],
     "dtype": "float32", "data": "<base64 of the float32 [n_sites, hidden] matrix, row-major>",
     "dropped_rows": <rows the request asked for and the engine dropped (capture's pool was full)>}

``decode_result`` turns it back into ``{site: vector}``. ``vllm_steer.extract`` is built on it.
The reduction runs on the device (``device_reduce``: one accumulator row per site, ``on_reduced`` at the
end, float32 sums for ``mean``); when the engine's accumulator rows are all held a request's rows come
step by step (``on_rows``) and are reduced here in float64. Under pipeline parallelism each stage's instance returns its own sites and ``merge`` joins them (sites
in the same order as one stage would give; ``dropped_rows`` summed).
Like every consumer it is called from its one dispatch thread (``runtime.capture_host``), so it keeps its
per-request sums without a lock.
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar

import numpy as np

from vllm_steer.capture.consumer import BaseConsumer
from vllm_steer.core.site_names import parse_site_name

REDUCTIONS = ("last", "mean")


class _Site:
    __slots__ = ("total", "count", "last", "last_pos")

    def __init__(self, dim: int) -> None:
        self.total = np.zeros(dim, np.float64)
        self.count = 0
        self.last: np.ndarray | None = None
        self.last_pos = -1


class ActivationStats(BaseConsumer):
    location: ClassVar[str] = "driver"

    def __init__(self, instance: str, **params: Any) -> None:
        super().__init__(instance, **params)
        if self.params:
            raise ValueError(f"the activations consumer takes no parameters, got {sorted(self.params)}")
        self._sites: dict[str, dict[str, _Site]] = {}

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        extra = set(params) - {"reduce"}
        if extra:
            raise ValueError(f"unknown key {sorted(extra)[0]!r} (the activations consumer takes 'reduce')")
        if params.get("reduce", "last") not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {list(REDUCTIONS)}, got {params['reduce']!r}")

    @classmethod
    def device_reduce(cls, params: dict[str, Any]) -> str | None:
        return params.get("reduce", "last")  # the engine reduces on the device while it has rows for it

    def on_reduced(self, request_id: str, layer: int, hook: str, reduce: str, row: np.ndarray, count: int,
                   position: int) -> None:
        site = self._sites.setdefault(request_id, {})[f"{hook}.{layer}"] = _Site(row.shape[0])
        site.total = row.astype(np.float64) * count
        site.count, site.last, site.last_pos = count, np.array(row, np.float32), position

    def on_rows(self, request_id: str, layer: int, hook: str, positions: np.ndarray, rows: np.ndarray,
                meta: dict[str, Any]) -> None:
        if not len(rows):
            return
        per_request = self._sites.setdefault(request_id, {})
        site = per_request.get(f"{hook}.{layer}")
        if site is None:
            site = per_request[f"{hook}.{layer}"] = _Site(rows.shape[1])
        site.total += rows.astype(np.float64).sum(axis=0)
        site.count += len(rows)
        i = int(np.argmax(positions))
        if int(positions[i]) > site.last_pos:
            site.last_pos, site.last = int(positions[i]), np.array(rows[i], np.float32)

    def on_request_finished(self, request_id: str, meta: dict[str, Any]) -> dict | None:
        sites = self._sites.pop(request_id, None)
        if not sites:
            return None
        reduce = (meta.get("params") or {}).get("reduce", "last")
        names = sorted(sites, key=_site_order)
        rows = np.stack([(sites[n].total / sites[n].count).astype(np.float32) if reduce == "mean" else sites[n].last
                         for n in names])
        return {"sites": names, "count": [sites[n].count for n in names], "shape": list(rows.shape),
                "dtype": "float32", "data": base64.b64encode(np.ascontiguousarray(rows).tobytes()).decode(),
                "dropped_rows": int(meta.get("dropped_rows", 0))}


    @classmethod
    def merge(cls, results: list[dict]) -> dict:
        """The pipeline stages' results of one request as one (each stage holds other sites)."""
        rows = [np.frombuffer(base64.b64decode(r["data"]), np.float32).reshape(r["shape"]) for r in results]
        by_site = {}
        for r, block in zip(results, rows):
            for name, count, row in zip(r["sites"], r["count"], block):
                if name in by_site:
                    raise ValueError(f"site {name} is in two stages' results")
                by_site[name] = (count, row)
        names = sorted(by_site, key=_site_order)
        merged = np.stack([by_site[n][1] for n in names])
        return {"sites": names, "count": [by_site[n][0] for n in names], "shape": list(merged.shape),
                "dtype": "float32", "data": base64.b64encode(np.ascontiguousarray(merged).tobytes()).decode(),
                "dropped_rows": sum(int(r.get("dropped_rows", 0)) for r in results)}


def _site_order(name: str) -> tuple[int, str]:
    """A result's site order: by layer, then hook name."""
    hook, layer = parse_site_name(name)
    return layer, hook


def decode_result(result: dict) -> dict[str, np.ndarray]:
    """``{site: float32 vector}`` of one ``activations`` result (``"post_mlp.3"`` -> ``[hidden]``)."""
    if not isinstance(result, dict) or "data" not in result:
        raise ValueError(f"not an activations result: {str(result)[:200]}")
    rows = np.frombuffer(base64.b64decode(result["data"]), np.float32).reshape(result["shape"])
    return dict(zip(result["sites"], rows))
