"""The engine-internal steering payload: one typed struct from the API process to the engine core and the workers.

The front end validates, resolves tiers and hashes once per request, then builds one ``SteerPayload``: each
distinct effective vector set once, already in the model dtype and in table layout (``core.layout``), keyed by
its hash, with whatever else the features need (module reference, SAE clamps, condition, stop_when, capture,
projections).
It travels in ``SamplingParams.extra_args[PAYLOAD_KEY]`` as msgpack bytes (``encode_payload``): vLLM's deep
copies of the params then copy one bytes object, not nested lists. A request's large rows (``SIDE_BYTES`` or more
for one hook) travel beside it, in ``extra_args[ROWS_KEY]``, as the very bytes objects the front end checked and
hashed (``encode_split``): vLLM's msgpack encode is then their only copy in the API process, where encoding them
into the payload first was a second one. Readers decode both (``payload_of`` / ``payload_from_extra``; the rows and
probes come back as views, no copy) and read attributes, never raw keys; anything else under the keys is refused
with a ``PayloadError`` naming what was wrong. A new field is one line here.
Also the codec that ships a named module's tiers to the workers once, through ``collective_rpc``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

from vllm_steer.core.layout import Layout
from vllm_steer.core.vectors import Vectors

PAYLOAD_KEY = "vllm_steer"
ROWS_KEY = "vllm_steer_rows"  # the rows shipped beside the payload: a list of bytes, indexed by the payload's rows
SIDE_BYTES = 16 * 1024  # one hook's rows of at least this size travel beside the payload (``encode_split``)
PAYLOAD_TAG = "vllm-steer/3"  # the first element of the encoded array: a payload of another version is refused

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# The wire forms of one SAE clamp site (core.sae_rows) and one condition (frontend.condition_spec).
SaeClamp = tuple[str, str, int, int, memoryview, memoryview, memoryview]  # name, hook, layer, mode, slots, codes, values
Condition = tuple[str, int, float, float, int, memoryview, int]  # hook, layer, threshold, sharpness, hard, probe, applies
Projection = tuple[str, int, memoryview, memoryview]  # hook, layer, dirs [K, D] f32, bounds [K, 2] f32
Rows = dict[str, tuple[tuple[int, ...], memoryview]]  # core.layout.Layout as decoded: hook -> (layers, rows)
# on the wire a hook's rows may be an index into extra_args[ROWS_KEY] instead (``encode_split``)
_WireRows = dict[str, tuple[tuple[int, ...], memoryview | int]]


class PayloadError(ValueError):
    """``extra_args[PAYLOAD_KEY]`` is not a payload this version of vllm-steer wrote."""


class ModuleRef(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False,
                forbid_unknown_fields=True):
    """A named module version whose rows the workers build from their registry (a bare reference)."""

    name: str
    version: int
    scale: float
    layers: tuple[int, ...] | None = None  # the request's selection (None: every layer / hook of the module)
    hooks: tuple[str, ...] | None = None


class SteerPayload(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False,
                   forbid_unknown_fields=True, tag=PAYLOAD_TAG):
    """What one request needs in the engine core and the workers. ``prefill`` / ``decode``: the config key of
    each phase (None: unsteered phase); ``configs``: each key's rows in table layout, except a bare module
    reference's (``module``), which the workers build. Fields most requests leave unset come last (an
    array-like struct omits only trailing defaults)."""

    prefill: str | None = None
    decode: str | None = None
    configs: dict[str, _WireRows] = {}  # read as dict[str, Rows]: ``decode_payload`` resolves side indices
    module: ModuleRef | None = None
    capture: dict[str, Any] | None = None  # consumer instance -> its spec (None: no capture)
    sae: dict[str, list[SaeClamp]] | None = None  # key -> SAE clamp entries (core.sae_rows wire form)
    condition: dict[str, Condition] | None = None  # key -> its condition (frontend.condition_spec wire form)
    stop_when: tuple[float, int, bool] | None = None  # above, tokens, whether the last prompt position counts
    sae_versions: dict[str, int] | None = None  # runtime SAE name -> the registration it was prepared for
    external_id: str | None = None  # the request id callers know (set on capturing payloads)
    capture_reply: str | None = None  # where a worker sends this request's capture results
    projections: dict[str, list[Projection]] | None = None  # key -> its sites' directions (frontend.projection_spec)
    # pool rows one token of the request takes on a worker, by position class (before the last prompt token, the
    # last prompt token, generated): the scheduler chunks its prefill to fit steer.capture_max_rows (engine.capture_budget)
    capture_rows: tuple[int, int, int] | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """The distinct config keys the request needs rows for, in a fixed order (allocation is deterministic)."""
        return tuple(dict.fromkeys(k for k in (self.prefill, self.decode) if k is not None))

    @property
    def steered(self) -> bool:
        return self.prefill is not None or self.decode is not None

    def rows_of(self, key: str) -> Layout | None:
        """The shipped rows of ``key`` (None: a bare module reference's, built by the worker)."""
        return self.configs.get(key)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SteerPayload)


def encode_payload(payload: SteerPayload) -> bytes:
    """The bytes a request carries in ``extra_args[PAYLOAD_KEY]``, rows and all."""
    return _ENCODER.encode(payload)


def encode_split(payload: SteerPayload) -> tuple[bytes, list | None]:
    """(the payload's bytes, the rows that travel beside it in ``extra_args[ROWS_KEY]``, or None): each hook's
    rows of SIDE_BYTES or more leave the payload for an index into that list, as the same bytes objects (no
    copy); a config shared by both phases is shipped once."""
    side: list = []
    configs = None
    for key, rows in payload.configs.items():
        if any(len(raw) >= SIDE_BYTES for _, raw in rows.values()):
            if configs is None:
                configs = dict(payload.configs)
            out = {}
            for hook, (layers, raw) in rows.items():
                if len(raw) >= SIDE_BYTES:
                    side.append(raw)
                    raw = len(side) - 1
                out[hook] = (layers, raw)
            configs[key] = out
    if configs is None:
        return _ENCODER.encode(payload), None
    return _ENCODER.encode(msgspec.structs.replace(payload, configs=configs)), side


def decode_payload(raw: Any, side: Any = None) -> SteerPayload:
    """Inverse of ``encode_payload`` / ``encode_split`` (``side``: ``extra_args[ROWS_KEY]``); PayloadError (naming
    the problem) for anything else."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise PayloadError(f"vllm-steer payload: expected the bytes of encode_payload, got {type(raw).__name__} "
                           f"(extra_args[{PAYLOAD_KEY!r}] is reserved for vllm-steer)")
    try:
        payload = _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        raise PayloadError(f"vllm-steer payload is not a {PAYLOAD_TAG} payload: {e}") from None
    except msgspec.DecodeError as e:
        raise PayloadError(f"vllm-steer payload is garbled: {e}") from None
    for rows in payload.configs.values():
        if any(type(data) is int for _, data in rows.values()):
            return _with_side_rows(payload, side)
    return payload


def _with_side_rows(payload: SteerPayload, side: Any) -> SteerPayload:
    """``payload`` with each row index replaced by a view of ``side``'s bytes at that index."""
    if not isinstance(side, (list, tuple)):
        raise PayloadError(f"vllm-steer payload: its rows travel beside it, but extra_args[{ROWS_KEY!r}] is "
                           f"{type(side).__name__}, not their list")
    configs = {}
    for key, rows in payload.configs.items():
        out = {}
        for hook, (layers, data) in rows.items():
            if type(data) is int:
                if not 0 <= data < len(side) or not isinstance(side[data], (bytes, bytearray, memoryview)):
                    raise PayloadError(f"vllm-steer payload: row block {data} of {key}.{hook} is not in "
                                       f"extra_args[{ROWS_KEY!r}] ({len(side)} blocks)")
                data = memoryview(side[data])
            out[hook] = (layers, data)
        configs[key] = out
    return msgspec.structs.replace(payload, configs=configs)


def payload_from_extra(extra_args: dict | None) -> SteerPayload | None:
    """The payload a request's extra_args carry, decoded with the rows beside it (None: none)."""
    raw = extra_args.get(PAYLOAD_KEY) if extra_args else None
    return decode_payload(raw, extra_args.get(ROWS_KEY)) if raw is not None else None


_CACHED = "_vllm_steer_payload"  # attribute of a vLLM Request: its decoded payload (decoded once per process)


def payload_of(sampling_params: object | None) -> SteerPayload | None:
    """The payload a request's SamplingParams carry, decoded (None: unsteered, or no params)."""
    return payload_from_extra(getattr(sampling_params, "extra_args", None))


def request_payload(request: object) -> SteerPayload | None:
    """``payload_of`` a vLLM ``Request``'s params, decoded once and kept on the request (a payload that
    does not decode raises PayloadError once, then reads as None: the scheduler refuses that request)."""
    cached = getattr(request, _CACHED, _CACHED)
    if cached is _CACHED:
        setattr(request, _CACHED, None)
        cached = payload_of(getattr(request, "sampling_params", None))
        setattr(request, _CACHED, cached)
    return cached


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported model dtype for steering tables: {dtype}")


def tiers_to_wire(tiers: dict[str, Vectors]) -> dict:
    """A named module's tiers as {tier: {hook: [layers, float32 bytes]}}: plain types for collective_rpc."""
    out: dict = {}
    for tier, hooks in tiers.items():
        for hook, layers in hooks.items():
            ids = sorted(layers)
            arr = np.stack([layers[i] for i in ids]).astype(np.float32)
            out.setdefault(tier, {})[hook] = [ids, arr.tobytes()]
    return out


def tiers_from_wire(wire: dict, hidden: int) -> dict[str, Vectors]:
    out: dict[str, Vectors] = {}
    for tier, hooks in wire.items():
        for hook, (ids, raw) in hooks.items():
            arr = np.frombuffer(raw, dtype=np.float32).reshape(len(ids), hidden)
            out.setdefault(tier, {})[hook] = {int(l): arr[i] for i, l in enumerate(ids)}
    return out
