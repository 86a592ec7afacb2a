"""The capture-consumer contract and its discovery through the ``vllm.capture_consumers`` entry points.

A consumer class (advertised as ``name = "package.module:Class"``) declares ``location``:
``"worker"`` (an instance runs on TP rank 0 of every pipeline stage, on that stage's sites: tensor
parallel ranks hold the same residual, so each site is delivered once) or ``"driver"`` (its
``on_request_finished`` may return a JSON-able per-request result that comes back with the request's
output). A driver also has an instance on TP rank 0 of every pipeline stage, which hears of a request
only when the request's spec names a site of that stage. Under pipeline parallelism a request whose
sites span stages so gets one result per stage; the process that submitted it merges them with the
class's ``merge`` (in stage order) into the one result the response carries. A class without its own
``merge`` cannot span stages: such a request is refused (400) in the front end (``mergeable``).
``meta["stage"]`` / ``meta["stages"]`` tell an instance which pipeline stage it is on, of how many.

Where consumers run: in a separate process per capturing worker (the "capture host",
``runtime.capture_host``), never in the worker: nothing a consumer does (numpy, file writes, pure
Python) takes the model runner's GIL. The host imports the class by its module path with the
worker's ``sys.path``, builds each instance there (constructor errors fail the engine's start) and
gives each consumer its own thread (a slow one delays only its own deliveries and its own
requests' results, which a response waits for at most ``steer.capture_result_timeout_s``).
Instances share nothing with the worker's memory: keep state in the instance, results in the
return value. Exceptions are caught and counted; an exception from a driver's
``on_request_finished`` is the request's result ``{"error": "consumer_error", "message": ...}``. If
the host process dies, the worker logs it, answers the requests it owed with ``{"error":
"consumer_died", ...}`` and captures nothing more for its consumers until the engine restarts.
The engine never waits for capture: rows it cannot keep are dropped, and
``on_request_finished``'s ``meta["dropped"]`` names their positions.

A consumer that only wants one row per site (the last captured, or the mean) says so with
``device_reduce(params)``: the engine then reduces on the device (``runtime.capture_reduce``) and calls
``on_reduced`` once per site at the request's end, before ``on_request_finished``, instead of
``on_rows`` each step. When the engine's accumulator rows (``steer.capture_reduce_rows``) are all
held, a request falls back to ``on_rows`` (counted in capture stats as ``reduce_fallbacks``), so such a
consumer implements both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

GROUP = "vllm.capture_consumers"


@dataclass(frozen=True)
class RowPacket:
    """One step's rows for one consumer, in column form (the optional ``on_packet``): group ``g`` is request
    ``request_ids[g]`` at site ``sites[g]`` (``(hook, layer)``), its rows ``data[starts[g]:ends[g]]`` at
    ``positions[starts[g]:ends[g]]``. ``data`` is read-only and valid during the call only (it may be the
    shared ring's memory: copy what you keep); ``meta`` as ``on_rows``'s."""

    request_ids: list[str]
    sites: list[tuple[str, int]]
    starts: np.ndarray  # int64 [groups]
    ends: np.ndarray
    positions: np.ndarray  # int64 [rows]
    data: np.ndarray  # [rows, D]
    meta: dict


@runtime_checkable
class CaptureConsumer(Protocol):
    location: ClassVar[str]  # "worker" | "driver"
    global_spec: dict | None  # captured for every request when set (after __init__)

    def __init__(self, instance: str, **params: Any) -> None: ...

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        """Raise ValueError on a bad per-request spec's consumer-specific keys."""

    def on_rows(self, request_id: str, layer: int, hook: str, positions: np.ndarray, rows: np.ndarray,
                meta: dict[str, Any]) -> None:
        """Residual rows ``[n, D]`` (model dtype as numpy; bf16 arrives as float32) at ``positions``.
        A class with ``raw_rows = True`` gets the rows as stored instead (bf16: their uint16 bits) and
        ``meta["dtype"]`` names the model dtype (``"bfloat16"``, ``"float16"``, ``"float32"``)."""

    # Optional: a consumer that defines ``on_packet(packet: RowPacket)`` gets each step's rows in one call
    # (column form, see RowPacket) instead of one ``on_rows`` per (request, site): the filesystem consumer
    # does, so its Python per step does not grow with requests x sites.

    @classmethod
    def device_reduce(cls, params: dict[str, Any]) -> str | None:
        """``"last"`` / ``"mean"``: a request with these spec params wants only that reduction per site
        (delivered through ``on_reduced``); None: every row through ``on_rows`` (optional method)."""

    def on_reduced(self, request_id: str, layer: int, hook: str, reduce: str, row: np.ndarray, count: int,
                   position: int) -> None:
        """A site's reduction (float32 ``[D]``): ``"last"``, the row at ``position`` (the highest captured),
        or ``"mean"`` over the ``count`` captured rows (float32 sums on the device). Called at the
        request's end, before ``on_request_finished``; only for consumers whose ``device_reduce`` says so."""

    def on_request_finished(self, request_id: str, meta: dict[str, Any]) -> dict | None:
        """All rows of the request were delivered. Driver consumers may return a result.

        ``meta``: ``prompt_len``; ``external_id`` (the id the caller knows, when it differs);
        ``params``: the request's consumer-specific spec keys (those ``validate_params`` checked);
        ``dropped``: ``{"hook.layer": [positions]}`` this consumer wanted and will never get
        (empty when nothing was dropped); ``dropped_rows``: how many; ``stage``, ``stages``: this
        instance's pipeline stage and the engine's count of them (0 and 1 without pipeline
        parallelism; each stage's instance hears of the request's end). Rows are dropped, never
        waited for, when a step wants more than the device pool holds (``steer.capture_max_rows``)
        or 256 row packets are still undelivered (a slow consumer) or the shared ring to the
        consumers' process is full. Each position of a request
        arrives at most once, also when a preempted request recomputes it; positions the engine
        does not compute (prefix-cache hits) are not captured and not listed.

        Work that outlasts the call (files still being written) may return a ``concurrent.futures.Future``
        of the result instead: the consumer's thread goes on with the next rows at once, and the request's
        result is sent (and its response, which waits for every consumer, released) when the future is done;
        an exception set on it counts as one raised here. ``on_rows`` and ``on_request_finished`` of one
        instance are always called from the same thread."""

    def close(self) -> None: ...

    # Optional, worker consumers:
    # @classmethod
    # def response_waits(cls, params: dict[str, Any]) -> bool:
    #     """Whether a request's response waits for this consumer to be done with the request (default True: e.g.
    #     until its files are published). A request whose every consumer says no (and that names no driver, whose
    #     results the response carries) ends with its last token."""

    # Optional, driver consumers under pipeline parallelism (see the module docstring):
    # @classmethod
    # def merge(cls, results: list[dict]) -> dict:
    #     """One result from the results of the request's stages (stage order, two or more, none an
    #     error object). Raising makes the request's result ``{"error": "merge_failed", ...}``."""


class BaseConsumer:
    """Convenience base: no global spec, no params check, nothing to do on finish, no ``merge``."""

    location: ClassVar[str] = "worker"

    def __init__(self, instance: str, **params: Any) -> None:
        self.instance = instance
        self.params = params
        self.global_spec = params.pop("global_spec", None)

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> None:
        return None

    @classmethod
    def device_reduce(cls, params: dict[str, Any]) -> str | None:
        return None

    def on_request_finished(self, request_id: str, meta: dict[str, Any]) -> dict | None:
        return None

    def close(self) -> None:
        return None


def mergeable(cls: type) -> bool:
    """Whether a driver consumer class merges per-stage results (defines a ``merge`` classmethod)."""
    return callable(getattr(cls, "merge", None))


def response_waits(cls: type, params: dict[str, Any]) -> bool:
    """Whether a request's response waits for a consumer of class ``cls`` given its per-request ``params``: a
    driver's always (its result is in the response); a worker's unless its optional ``response_waits`` says no."""
    if cls.location == "driver":
        return True
    own = getattr(cls, "response_waits", None)
    return True if own is None else bool(own(params))


def reduces_on_device(cls: type) -> bool:
    """Whether a consumer class may ask for device reduction (defines its own ``device_reduce``)."""
    own = getattr(cls, "device_reduce", None)
    return own is not None and getattr(own, "__func__", None) is not BaseConsumer.device_reduce.__func__


@functools.cache
def consumer_class(name: str) -> type:
    """The class advertised as ``name`` in the ``vllm.capture_consumers`` group (looked up once per process:
    scanning every distribution's entry points took ~10 ms, on every capturing request's preparation)."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        available = sorted(ep.name for ep in entry_points(group=GROUP))
        raise ValueError(f"no capture consumer named {name!r} (installed: {available})")
    cls = found[0].load()
    if getattr(cls, "location", None) not in ("worker", "driver"):
        raise ValueError(f"capture consumer {name!r} must declare location = 'worker' or 'driver'")
    return cls
