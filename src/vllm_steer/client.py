"""Client helpers: pack vectors into the request wire format in one call (no hand-made base64).

    from vllm_steer.client import pack
    body = {"steering_vectors": {"post_mlp": pack(vectors, layers=[10, 11])}}

The binary wire form skips base64 and the server's JSON parse of the vectors: pack with
``binary=True`` and send ``msgpack_body(body)`` with ``Content-Type: application/msgpack``.
Works with numpy arrays or torch tensors; needs neither vLLM nor a GPU.
"""

from __future__ import annotations

import base64
from typing import Any, Sequence

import numpy as np

from vllm_steer.core import bf16

__all__ = ["MSGPACK_CONTENT_TYPE", "msgpack_body", "pack", "steering_body"]

MSGPACK_CONTENT_TYPE = "application/msgpack"

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


def _as_2d_bytes(vectors: Any, dtype: str) -> tuple[bytes, tuple[int, int]]:
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    if hasattr(vectors, "detach"):  # a torch tensor
        import torch

        t = vectors.detach().cpu()
        t = t.reshape(1, -1) if t.dim() == 1 else t
        t = t.to(getattr(torch, dtype)).contiguous()
        raw = t.view(torch.uint8).numpy().tobytes()
        return raw, (t.shape[0], t.shape[1])
    arr = np.asarray(vectors)
    arr = arr.reshape(1, -1) if arr.ndim == 1 else arr
    if arr.ndim != 2:
        raise ValueError(f"expected [n_layers, hidden] vectors, got shape {arr.shape}")
    if dtype == "bfloat16":
        words = bf16.to_bits(arr)
        return words.tobytes(), (words.shape[0], words.shape[1])
    arr = np.ascontiguousarray(arr, dtype=_NUMPY_DTYPES[dtype])
    return arr.tobytes(), (arr.shape[0], arr.shape[1])


def pack(
    vectors: Any,
    layers: Sequence[int],
    dtype: str = "float32",
    scales: Sequence[float] | None = None,
    binary: bool = False,
) -> dict:
    """The packed form of one hook's vectors: row i is added at ``layers[i]``. ``binary``: ``data``
    as raw bytes (for msgpack bodies and ``extra_args``) instead of a base64 string (JSON)."""
    raw, shape = _as_2d_bytes(vectors, dtype)
    if len(layers) != shape[0]:
        raise ValueError(f"{shape[0]} vectors but {len(layers)} layer indices")
    out = {
        "dtype": dtype,
        "shape": list(shape),
        "layer_indices": [int(l) for l in layers],
        "data": raw if binary else base64.b64encode(raw).decode("ascii"),
    }
    if scales is not None:
        out["scales"] = [float(s) for s in scales]
    return out


def steering_body(
    hooks: dict[str, tuple[Any, Sequence[int]]],
    phase: str = "both",
    dtype: str = "float32",
    binary: bool = False,
) -> dict:
    """``{field: {hook: packed}}`` for ``extra_body`` / ``extra_args``; phase: both|prefill|decode."""
    field = {"both": "steering_vectors", "prefill": "prefill_steering_vectors", "decode": "decode_steering_vectors"}[phase]
    return {field: {hook: pack(v, layers, dtype, binary=binary) for hook, (v, layers) in hooks.items()}}


def msgpack_body(body: dict) -> bytes:
    """A whole OpenAI request body as msgpack (send with ``Content-Type: application/msgpack``)."""
    import msgspec

    return msgspec.msgpack.encode(body)
