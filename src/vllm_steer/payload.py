"""The engine-internal steering payload: what the API side puts in ``SamplingParams.extra_args``.

The front end validates, resolves tiers and hashes once per request, then ships each distinct
effective vector set once, already in the model dtype and in table layout, keyed by its hash.
The worker only copies bytes into table rows. A plain dict of str/int/bytes so msgspec carries
it between processes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_steer import bf16
from vllm_steer.spec import stack_rows

PAYLOAD_KEY = "vllm_steer"
PAYLOAD_VERSION = 1

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported model dtype for steering tables: {dtype}")


@dataclass(frozen=True)
class HookVectors:
    """Vectors of one hook point: ``data[i]`` is added at layer ``layers[i]``."""

    layers: tuple[int, ...]
    data: torch.Tensor  # [len(layers), D], model dtype, CPU


@dataclass(frozen=True)
class EngineSteering:
    """The decoded payload of one request: a config key per phase (None: unsteered phase).

    ``configs`` holds the vectors of each key, except for a bare module reference (``module``:
    name, version, scale), whose rows the worker builds from its module registry."""

    prefill_key: str | None
    decode_key: str | None
    configs: dict[str, dict[str, HookVectors]]
    module: dict | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return _distinct(self.prefill_key, self.decode_key)


def encode_payload(
    prefill_key: str | None,
    decode_key: str | None,
    configs: dict[str, dict[str, tuple[list[int], np.ndarray]]],
    dtype: torch.dtype,
    module: dict | None = None,
    capture: dict | None = None,
) -> dict:
    """Pack effective float32 vectors (per key, per hook: layers + [n, D] array) in ``dtype``."""
    packed: dict[str, list] = {}
    for key, hooks in configs.items():
        entries = []
        for hook, (layers, arr) in hooks.items():
            entries.append([hook, list(layers), to_dtype_bytes(arr, dtype)])
        packed[key] = entries
    return {
        "v": PAYLOAD_VERSION,
        "dtype": dtype_name(dtype),
        "prefill": prefill_key,
        "decode": decode_key,
        "configs": packed,
        "module": module,
        "capture": capture,
    }


def to_dtype_bytes(arr: np.ndarray, dtype: torch.dtype) -> bytes:
    """float32 array -> raw bytes in ``dtype`` (bf16 by round-to-nearest-even, as torch does)."""
    f32 = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == torch.float32:
        return f32.tobytes()
    if dtype == torch.float16:
        return f32.astype(np.float16).tobytes()
    words = f32.view(np.uint32)
    if not (words & np.uint32(0xFFFF)).any():  # already on the bf16 grid (a bf16 request): no rounding
        return (words >> np.uint32(16)).astype(np.uint16).tobytes()
    return bf16.to_bits(f32).tobytes()


def decode_payload(payload: dict, hidden_size: int) -> EngineSteering:
    """Inverse of encode_payload (on the worker)."""
    if payload.get("v") != PAYLOAD_VERSION:
        raise ValueError(f"steering payload version {payload.get('v')} != {PAYLOAD_VERSION}")
    dtype = _TORCH_DTYPES[payload["dtype"]]
    configs: dict[str, dict[str, HookVectors]] = {}
    for key, entries in payload["configs"].items():
        hooks = {}
        for hook, layers, raw in entries:
            buf = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
            data = buf.view(dtype).view(len(layers), hidden_size)
            hooks[hook] = HookVectors(tuple(layers), data)
        configs[key] = hooks
    return EngineSteering(payload["prefill"], payload["decode"], configs, payload.get("module"))


def hook_vectors(vectors: dict[str, dict[int, np.ndarray]], dtype: torch.dtype) -> dict[str, HookVectors]:
    """float32 {hook: {layer: vec}} -> table-layout HookVectors in the model dtype (worker side)."""
    out = {}
    for hook, layers in vectors.items():
        ids = sorted(layers)
        data = torch.from_numpy(np.array(stack_rows(layers, ids), dtype=np.float32)).to(dtype)
        out[hook] = HookVectors(tuple(ids), data)
    return out


def payload_of(sampling_params: object | None) -> dict | None:
    """The steering payload a request's SamplingParams carry (None: unsteered, or no params)."""
    extra = getattr(sampling_params, "extra_args", None)
    return extra.get(PAYLOAD_KEY) if extra else None


def payload_keys(payload: dict | None) -> tuple[str, ...]:
    """The distinct config keys a request needs rows for (no decoding of vectors)."""
    if not payload:
        return ()
    return _distinct(payload["prefill"], payload["decode"])


def _distinct(*keys: str | None) -> tuple[str, ...]:
    """Non-None keys, first occurrence kept, in a fixed order (row allocation is deterministic)."""
    return tuple(dict.fromkeys(k for k in keys if k is not None))
