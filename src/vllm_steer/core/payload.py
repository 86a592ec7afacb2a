"""The engine-internal steering payload: what the API side puts in ``SamplingParams.extra_args``.

The front end validates, resolves tiers and hashes once per request, then ships each distinct
effective vector set once, already in the model dtype and in table layout (``core.layout``),
keyed by its hash. The worker only copies those bytes into table rows. A plain dict of str/int/bytes so
msgspec carries it between processes unchanged. Also the codec that ships a named module's tiers
to the workers once, through ``collective_rpc``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_steer.core.layout import Layout
from vllm_steer.core.vectors import Vectors

PAYLOAD_KEY = "vllm_steer"
PAYLOAD_VERSION = 2
SAE_VERSIONS_KEY = "sae_versions"  # payload key: runtime SAE name -> the registration the request was prepared for

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
class EngineSteering:
    """The decoded payload of one request: a config key per phase (None: unsteered phase).

    ``configs`` holds each key's rows in table layout (the shipped bytes), except for a bare module reference (``module``:
    name, version, scale), whose rows the worker builds from its module registry."""

    prefill_key: str | None
    decode_key: str | None
    configs: dict[str, Layout]
    module: dict | None = None
    sae: dict | None = None  # key -> SAE clamp entries (core.sae_rows wire form)
    condition: dict | None = None  # key -> its condition (frontend.condition_spec wire form)

    @property
    def keys(self) -> tuple[str, ...]:
        return _distinct(self.prefill_key, self.decode_key)


def encode_payload(
    prefill_key: str | None,
    decode_key: str | None,
    configs: dict[str, Layout],
    dtype: str,
    module: dict | None = None,
    capture: dict | None = None,
) -> dict:
    """The payload of a request: each config in table layout (model-dtype bytes), keyed."""
    return {
        "v": PAYLOAD_VERSION,
        "dtype": dtype,
        "prefill": prefill_key,
        "decode": decode_key,
        "configs": {key: [[hook, list(ids), raw] for hook, (ids, raw) in layout.items()]
                    for key, layout in configs.items()},
        "module": module,
        "capture": capture,
    }


def decode_payload(payload: dict) -> EngineSteering:
    """Inverse of encode_payload (on the worker): the shipped bytes themselves, no copy."""
    if payload.get("v") != PAYLOAD_VERSION:
        raise ValueError(f"steering payload version {payload.get('v')} != {PAYLOAD_VERSION}")
    configs = {key: {hook: (tuple(layers), raw) for hook, layers, raw in entries}
               for key, entries in payload["configs"].items()}
    return EngineSteering(payload["prefill"], payload["decode"], configs, payload.get("module"), payload.get("sae"),
                          payload.get("condition"))


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
