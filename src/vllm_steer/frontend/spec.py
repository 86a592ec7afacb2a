"""Parse and validate a request's steering fields (the arithmetic on them is ``core.vectors``).

Accepted in ``SamplingParams.extra_args`` (and, through the OpenAI server, the request body):
``steering_vectors`` (both phases), ``prefill_steering_vectors``, ``decode_steering_vectors``;
each maps a hook point to ``{layer: [floats]}`` or to the packed form
``{"dtype", "shape": [n, hidden], "layer_indices", "data", "scales"?}`` where ``data`` is the
rows' little-endian bytes, base64 in a string (JSON) or raw (a msgpack bin, or Python bytes)
(when a hook's object has ``data`` it is the packed form; packed wins over any layer keys beside it),
and/or a site name (``core.site_names``: ``"blocks.12.hook_resid_post"`` or ``"post_mlp.12"``) to
``[floats]``; a site given twice in one field is refused. A hook's object (either form) may carry
``"norm": x`` (instead of ``scales``): each of its vectors scaled to ``x`` times its site's typical residual
norm (``core.site_norms``; the server's ``steer.site_norms``). ``steering_module`` takes ``scale`` or ``norm``.
Every problem raises SteeringSpecError naming the field. Vectors come out in float32.
"""

from __future__ import annotations

import binascii
import math
from dataclasses import dataclass, field as dc_field
from typing import Any

import numpy as np
import pybase64

from vllm_steer.core import bf16
from vllm_steer.core.errors import SteeringSpecError, SteeringTooLarge
from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.layer_selection import parse_layers
from vllm_steer.core.layout import KeyHasher, Layout, checked_rows, converted_known, converted_rows, itemsize
from vllm_steer.core.site_names import parse_site_name
from vllm_steer.core.site_norms import Norms, normed
from vllm_steer.core.vectors import MODULE_FIELD, TIER_FIELDS, PackedLayers, Vectors

_PACKED_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None}
_INTS = frozenset((int,))  # type(x) is int: a bool is not a layer index


@dataclass(frozen=True)
class ModelShape:
    """What a steering spec is validated against."""

    num_layers: int
    hidden_size: int
    hooks: tuple[str, ...]  # hook points enabled on this engine
    layers: frozenset[int] | None  # steerable layers (None: all)
    max_bytes: int
    dtype: str = "float32"  # the model's dtype: what table rows (and config keys) are made of
    # typical residual norms per site (steer.site_norms), what inline ``norm`` strengths read; None: none
    site_norms: Norms | None = dc_field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class ModuleRef:
    name: str
    scale: float
    norm: float | None = None  # the strength as a fraction of each site's typical residual norm (scale then 1)
    layers: tuple[int, ...] | None = None  # a selection of the module's layers (None: all)
    hooks: tuple[str, ...] | None = None  # ... and of its hook points

    def selection(self) -> dict:
        """The selection as it travels in the payload (absent keys: everything)."""
        out = {}
        if self.layers is not None:
            out["layers"] = list(self.layers)
        if self.hooks is not None:
            out["hooks"] = list(self.hooks)
        return out


@dataclass(frozen=True)
class SteeringSpec:
    """The validated steering of one request, before resolution into phases."""

    tiers: dict[str, Vectors]  # tier field -> vectors
    module: ModuleRef | None = None

    @property
    def empty(self) -> bool:
        return self.module is None and not any(self.tiers.values())


def check_layer(field: str, raw: Any, shape: ModelShape) -> int:
    try:
        layer = int(raw)
        if isinstance(raw, float) or isinstance(raw, bool) or str(layer) != str(raw):
            raise ValueError
    except (TypeError, ValueError):
        raise SteeringSpecError(field, f"layer index must be a decimal integer, got {raw!r}") from None
    if not 0 <= layer < shape.num_layers:
        raise SteeringSpecError(
            field, f"layer {layer} out of range: the model has {shape.num_layers} layers"
        )
    if shape.layers is not None and layer not in shape.layers:
        raise SteeringSpecError(
            field, f"layer {layer} is not steerable on this server (steer.layers={sorted(shape.layers)})"
        )
    return layer


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def finite_number(field: str, raw: Any) -> float:
    """``raw`` as a float if it is a JSON number (not a bool) that is finite in float32, the precision
    steering computes in; SteeringSpecError naming ``field`` else."""
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw):
        raise SteeringSpecError(field, f"expected a finite number, got {raw!r}")
    if abs(raw) > _FLOAT32_MAX:
        raise SteeringSpecError(field, f"{raw!r} overflows float32 (largest magnitude {_FLOAT32_MAX:.4g})")
    return float(raw)


def check_finite(field: str, arr: np.ndarray) -> None:
    if not np.isfinite(arr).all():
        raise SteeringSpecError(field, "contains NaN or Inf")


def parse_vector(field: str, values: Any, shape: ModelShape) -> np.ndarray:
    """One vector given as ``[floats]`` -> float32 ``[hidden]``."""
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise SteeringSpecError(field, f"expected a list of {shape.hidden_size} floats")
    if len(values) != shape.hidden_size:
        raise SteeringSpecError(
            field, f"expected {shape.hidden_size} floats (hidden size), got {len(values)}"
        )
    try:
        arr = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        raise SteeringSpecError(field, "values must be numbers") from None
    if arr.ndim != 1:
        raise SteeringSpecError(field, "expected a flat list of floats")
    check_finite(field, arr)
    return arr


def _parse_float_layers(field: str, obj: dict, shape: ModelShape) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for raw_layer, values in obj.items():
        if raw_layer == "norm":
            continue  # the hook's strength, applied by ``_parse_tier``
        f = f"{field}.{raw_layer}"
        layer = check_layer(f, raw_layer, shape)
        arr = parse_vector(f, values, shape)
        if layer in out:
            raise SteeringSpecError(f, f"layer {layer} given twice")
        out[layer] = arr
    return out


def _packed_dtype(field: str, obj: dict) -> str:
    dtype_name = obj.get("dtype")
    if dtype_name not in _PACKED_DTYPES:
        raise SteeringSpecError(
            f"{field}.dtype", f"unknown dtype {dtype_name!r}; expected one of {list(_PACKED_DTYPES)}"
        )
    return dtype_name


def _packed_raw(field: str, obj: dict, shape: ModelShape) -> tuple[str, list[int], bytes]:
    """Validate the packed form's header and decode its base64: (dtype name, layers, raw bytes)."""
    dtype_name = _packed_dtype(field, obj)
    dims = obj.get("shape")
    if (
        not isinstance(dims, (list, tuple))
        or len(dims) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in dims)
    ):
        raise SteeringSpecError(f"{field}.shape", f"expected [n_layers, hidden], got {dims!r}")
    n, d = dims
    if d != shape.hidden_size:
        raise SteeringSpecError(
            f"{field}.shape", f"hidden size {d} != the model's hidden size {shape.hidden_size}"
        )
    indices = obj.get("layer_indices")
    if not isinstance(indices, (list, tuple)) or len(indices) != n:
        raise SteeringSpecError(
            f"{field}.layer_indices", f"expected a list of {n} layer indices (shape[0])"
        )
    if _INTS.issuperset(map(type, indices)) and (not indices or (
            min(indices) >= 0 and max(indices) < shape.num_layers and shape.layers is None)):
        layers = list(indices)  # the common case, checked in bulk
    else:
        layers = [check_layer(f"{field}.layer_indices[{i}]", x, shape) for i, x in enumerate(indices)]
    if len(set(layers)) != len(layers):
        raise SteeringSpecError(f"{field}.layer_indices", "duplicate layer index")
    return dtype_name, layers, _packed_data(field, obj, dtype_name, n, shape)


def _packed_data(field: str, obj: dict, dtype_name: str, n: int, shape: ModelShape) -> bytes:
    """The raw bytes of ``n`` packed vectors (``data``: base64, or bytes), their length checked."""
    d = shape.hidden_size
    data = obj.get("data")
    if not isinstance(data, (str, bytes, bytearray, memoryview)):
        raise SteeringSpecError(f"{field}.data", "expected a base64 string (or raw bytes in a msgpack body)")
    expected = n * d * itemsize(dtype_name)
    if expected > shape.max_bytes:
        raise SteeringTooLarge(
            f"{field}.data", f"{expected} bytes exceeds the server's cap of {shape.max_bytes}"
        )
    if isinstance(data, str):
        try:
            raw = pybase64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise SteeringSpecError(f"{field}.data", "invalid base64") from None
    else:
        raw = bytes(data)  # binary already (a msgpack bin, or bytes from Python)
    if len(raw) != expected:
        raise SteeringSpecError(
            f"{field}.data",
            f"decoded {len(raw)} bytes, but shape {[n, d]} of {dtype_name} needs {expected}",
        )
    return raw


def _packed_rows(dtype_name: str, raw: bytes, n: int, d: int) -> np.ndarray:
    """[n, d] rows of the packed dtype (bfloat16 as float32), zero-copy where the dtype allows."""
    if dtype_name == "bfloat16":
        return bf16.from_bits(np.frombuffer(raw, dtype=np.uint16)).reshape(n, d)
    return np.frombuffer(raw, dtype=_PACKED_DTYPES[dtype_name]).reshape(n, d)


def parse_packed_vector(field: str, obj: dict, shape: ModelShape) -> np.ndarray:
    """One vector packed as ``{"dtype", "data"}`` (``data`` base64, or bytes in a msgpack body) -> float32
    ``[hidden]``: the float list's cost without parsing thousands of JSON numbers."""
    extra = sorted(set(obj) - {"dtype", "data"})
    if extra:
        raise SteeringSpecError(f"{field}.{extra[0]}", "unknown key (a packed vector is {\"dtype\", \"data\"})")
    dtype_name = _packed_dtype(field, obj)
    raw = _packed_data(field, obj, dtype_name, 1, shape)
    arr = _packed_rows(dtype_name, raw, 1, shape.hidden_size)[0].astype(np.float32)
    check_finite(f"{field}.data", arr)
    return arr


def decode_packed(field: str, obj: dict, shape: ModelShape) -> PackedLayers:
    """The packed form -> {layer: float32 vector}; zero-copy up to the float32 conversion."""
    dtype_name, layers, raw = _packed_raw(field, obj, shape)
    n, d = len(layers), shape.hidden_size
    src = _packed_rows(dtype_name, raw, n, d)
    scales = obj.get("scales")
    if scales is not None and obj.get("norm") is not None:
        raise SteeringSpecError(f"{field}.norm", "give scales or norm, not both")
    if scales is not None:
        if not isinstance(scales, (list, tuple)) or len(scales) != n:
            raise SteeringSpecError(
                f"{field}.scales", f"expected {n} scales (one per layer), got {scales!r}"
            )
        for i, s in enumerate(scales):
            finite_number(f"{field}.scales[{i}]", s)
        src = _scale_rows(src, scales, bf16_source=dtype_name == "bfloat16")
    arr = src.astype(np.float32, copy=False)
    check_finite(f"{field}.data", arr)
    return PackedLayers(arr, layers)


def packed_fast_tier(fields: dict[str, Any], shape: ModelShape, convert: bool = False) -> str | None:
    """The tier field of a request ``parse_packed_fast`` takes (None: the general path): one tier, every hook
    packed in the model's dtype (``convert``: in any packed dtype, rounded to the model's), no scales, no norm, no
    module."""
    if fields.get(MODULE_FIELD) is not None:
        return None
    present = [t for t in TIER_FIELDS if fields.get(t) is not None]
    if len(present) != 1 or not isinstance(fields[present[0]], dict):
        return None
    if not all(h in HOOK_NAMES and isinstance(v, dict) and "data" in v
               and (v.get("dtype") == shape.dtype or (convert and v.get("dtype") in _PACKED_DTYPES))
               and v.get("scales") is None and "norm" not in v for h, v in fields[present[0]].items()):
        return None
    return present[0]


def packed_fast_light(fields: dict[str, Any], shape: ModelShape) -> bool:
    """Whether ``parse_packed_fast`` takes the request and converts nothing: every block in the model's dtype, or
    in another whose conversion is remembered (the same float32 vectors with every request): light work, which
    ``SteeringFrontend.cheap`` lets the event loop do."""
    tier = packed_fast_tier(fields, shape, convert=True)
    if tier is None:
        return False
    for obj in fields[tier].values():
        if obj["dtype"] == shape.dtype:
            continue
        data, layers = obj["data"], obj.get("layer_indices")
        if not isinstance(data, bytes) or not isinstance(layers, list) or not converted_known(
                data, layers, obj["dtype"], shape.dtype, shape.hidden_size):
            return False
    return True


def parse_packed_fast(fields: dict[str, Any], shape: ModelShape) -> tuple[str, Layout, str | None] | None:
    """The common per-request case, straight to table layout: one tier, every hook packed (in the model's dtype:
    without float32; in another: rounded as the float32 path rounds it, ``converted_rows``), no scales, no module.
    Returns (tier field, layout, its ``layout_key``, each hook hashed as soon as its rows are checked), or None when
    the request needs the general path (which then reports any error)."""
    tier = packed_fast_tier(fields, shape, convert=True)
    if tier is None:
        return None
    dtype_name = shape.dtype
    hooks = fields[tier]
    layout: Layout = {}
    hasher = KeyHasher(dtype_name)
    total = 0
    for hook in sorted(hooks, key=HOOK_NAMES.index):
        f = f"{tier}.{hook}"
        check_hook(f, hook, shape)
        src, layers, raw = _packed_raw(f, hooks[hook], shape)
        total += len(raw)
        if src != dtype_name:  # rounded to the model dtype as the float32 path rounds it, remembered as checked rows
            n, d = len(layers), shape.hidden_size
            try:
                rows, digest = converted_rows(raw, layers, src, dtype_name, d,
                                              lambda: _packed_rows(src, raw, n, d).astype(np.float32, copy=False))
            except ValueError:
                return None  # the general path refuses it, naming its field as it always has
        else:
            try:
                rows, digest = checked_rows(raw, layers, dtype_name, shape.hidden_size)
            except ValueError as e:
                raise SteeringSpecError(f"{f}.data", str(e)) from None
        if rows is not None:
            layout[hook] = rows
            hasher.add(hook, *rows, digest)
    if total > shape.max_bytes:
        raise SteeringTooLarge(tier, f"{total} bytes of vectors exceeds the server's cap of {shape.max_bytes}")
    return tier, layout, hasher.key()


def _scale_rows(src: np.ndarray, scales: list, bf16_source: bool) -> np.ndarray:
    """Multiply row i by scales[i] in the source dtype (a bf16 source stays on the bf16 grid:
    the float32 product of two bf16 values is exact, then rounds once, as torch's bf16 mul)."""
    if bf16_source:
        factors = bf16.round_to_bf16(np.asarray(scales, dtype=np.float32)).reshape(-1, 1)
        return bf16.round_to_bf16(src * factors)
    return src * np.asarray(scales, dtype=src.dtype).reshape(-1, 1)


def check_hook(field: str, hook: Any, shape: ModelShape) -> None:
    if hook not in HOOK_NAMES:
        raise SteeringSpecError(field, f"unknown hook point {hook!r}; expected one of {list(HOOK_NAMES)}")
    if hook not in shape.hooks:
        raise SteeringSpecError(
            field, f"hook point {hook!r} is not enabled on this server (steer.hooks={list(shape.hooks)})"
        )


def parse_site_key(field: str, key: str, shape: ModelShape) -> tuple[str, int]:
    """A tier's site-name key (``blocks.12.hook_resid_post``, ``post_mlp.12``) -> (hook, layer), checked."""
    try:
        hook, layer = parse_site_name(key)
    except ValueError as e:
        raise SteeringSpecError(field, str(e)) from None
    check_hook(field, hook, shape)
    return hook, check_layer(field, layer, shape)


def _parse_tier(field: str, obj: Any, shape: ModelShape) -> Vectors:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SteeringSpecError(field, "expected an object mapping hook points (or site names) to vectors")
    out: Vectors = {}
    site_keys = [k for k in obj if isinstance(k, str) and "." in k]  # hook points have no dot
    for hook, value in obj.items():
        if hook in site_keys:
            continue
        f = f"{field}.{hook}"
        check_hook(f, hook, shape)
        if not isinstance(value, dict):
            raise SteeringSpecError(f, "expected {layer: [floats]} or a packed object with 'data'")
        layers = decode_packed(f, value, shape) if "data" in value else _parse_float_layers(f, value, shape)
        if "norm" in value:
            layers = normed(layers, hook, finite_number(f"{f}.norm", value["norm"]), _lookup(shape.site_norms),
                            f"{f}.norm")
        if layers:
            out[hook] = layers
    for key in site_keys:  # merged into the hook form: {hook: {layer: vector}}
        f = f"{field}.{key}"
        hook, layer = parse_site_key(f, key, shape)
        if layer in out.get(hook, {}):
            raise SteeringSpecError(f, f"site {hook}.{layer} is given twice in {field}")
        out[hook] = {**out.get(hook, {}), layer: parse_vector(f, obj[key], shape)}
    return out


def _lookup(norms: Norms | None) -> Any:
    return lambda hook, layer: None if norms is None else norms.get((hook, layer))


def _parse_module(obj: Any, shape: ModelShape) -> ModuleRef | None:
    if obj is None:
        return None
    if isinstance(obj, str):
        obj = {"name": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise SteeringSpecError(MODULE_FIELD, 'expected {"name": str, "scale" or "norm": float, "layers"?, "hooks"?}')
    extra = set(obj) - {"name", "scale", "norm", "layers", "hooks"}
    if extra:
        raise SteeringSpecError(MODULE_FIELD, f"unknown keys {sorted(extra)}")
    layers = hooks = None
    if obj.get("layers") is not None:
        try:
            layers = parse_layers(obj["layers"], shape.num_layers)
        except ValueError as e:
            raise SteeringSpecError(f"{MODULE_FIELD}.layers", str(e)) from None
    if obj.get("hooks") is not None:
        hooks = obj["hooks"]
        if not isinstance(hooks, list) or not hooks or not all(isinstance(h, str) for h in hooks):
            raise SteeringSpecError(f"{MODULE_FIELD}.hooks", "expected a non-empty list of hook points")
        for h in hooks:
            check_hook(f"{MODULE_FIELD}.hooks", h, shape)
        hooks = sorted(set(hooks))
    norm = None
    if obj.get("norm") is not None:
        if obj.get("scale") is not None:
            raise SteeringSpecError(f"{MODULE_FIELD}.norm", "give scale or norm, not both")
        norm = finite_number(f"{MODULE_FIELD}.norm", obj["norm"])
    return ModuleRef(obj["name"], finite_number(f"{MODULE_FIELD}.scale", obj.get("scale", 1.0)), norm,
                     None if layers is None else tuple(layers), None if hooks is None else tuple(hooks))


def parse_spec(fields: dict[str, Any], shape: ModelShape) -> SteeringSpec:
    """Validate the steering fields of one request (those absent are empty)."""
    tiers = {name: _parse_tier(name, fields.get(name), shape) for name in TIER_FIELDS}
    for name, tier in tiers.items():
        nbytes = sum(v.nbytes for layers in tier.values() for v in layers.values())
        if nbytes > shape.max_bytes:
            raise SteeringTooLarge(name, f"{nbytes} bytes of vectors exceeds the server's cap of {shape.max_bytes}")
    return SteeringSpec(tiers=tiers, module=_parse_module(fields.get(MODULE_FIELD), shape))
