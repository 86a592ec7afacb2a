"""Module files -> tiers of vectors: safetensors and GGUF control vectors.

safetensors: tensors named by a site (``core.site_names``: ``<hook>.<layer>`` or TransformerLens'
``blocks.<layer>.hook_resid_pre|mid|post``) for both phases, or ``prefill.<site>`` / ``decode.<site>``,
each ``[hidden]``; a site named twice in one tier is refused; metadata ``description`` (optional).
Projections (``steer.max_projections``): ``[prefill.|decode.]project.<site>`` ``[K, hidden]`` (or ``[hidden]``)
directions, ablated unless ``project.<site>.bounds`` ``[K, 2]`` gives each its [lo, hi] (+-inf: unbounded),
as ``steering_projections`` in a request (``frontend.projection_spec``).

GGUF control vectors (llama.cpp ``cvector-generator``, repeng ``export_gguf``): tensors
``direction.N``. Convention, as llama.cpp applies them: ``direction.N`` is added to the output of
decoder layer N (0-based; llama.cpp never writes ``direction.0``), i.e. our ``post_mlp`` at layer N.
"""

from __future__ import annotations

import os
import re
import tempfile

import numpy as np

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.site_names import parse_site_name
from vllm_steer.core.vectors import TIER_FIELDS, Vectors
from vllm_steer.frontend.spec import ModelShape, check_finite, check_layer

_TIER_PREFIX = {"": "steering_vectors", "prefill.": "prefill_steering_vectors", "decode.": "decode_steering_vectors"}
_PHASE = re.compile(r"(prefill\.|decode\.)?(.*)", re.S)
_GGUF_NAME = re.compile(r"^direction\.(\d+)$")
_PROJ_FIELD = {"": "steering_projections", "prefill.": "prefill_steering_projections",
               "decode.": "decode_steering_projections"}
_PROJ = re.compile(r"(prefill\.|decode\.)?project\.(.*?)(\.bounds)?", re.S)


def _add(tiers: dict[str, Vectors], tier: str, hook: str, layer_raw: str | int, arr: np.ndarray, shape: ModelShape, field: str) -> None:
    layer = check_layer(field, layer_raw, shape)
    if hook not in shape.hooks:
        raise SteeringSpecError(field, f"hook point {hook!r} is not enabled on this server")
    vec = np.asarray(arr, dtype=np.float32).reshape(-1)
    if vec.shape[0] != shape.hidden_size:
        raise SteeringSpecError(field, f"expected {shape.hidden_size} values (hidden size), got {vec.shape[0]}")
    check_finite(field, vec)
    layers = tiers[tier].setdefault(hook, {})
    if layer in layers:
        raise SteeringSpecError(field, f"site {hook}.{layer} is named twice in the file")
    layers[layer] = vec


def _projections(tensors: dict[str, np.ndarray]) -> dict:
    """The ``project.`` tensors of a file as request projection fields (checked by the caller, as a request's)."""
    found: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        phase, site, bounds = _PROJ.fullmatch(name).groups()
        found.setdefault((phase or "", site), {})["bounds" if bounds else "dirs"] = arr
    out: dict = {}
    for (phase, site), parts in found.items():
        name = f"{phase}project.{site}"
        if "dirs" not in parts:
            raise SteeringSpecError(f"file.{name}.bounds", f"bounds without directions ({name})")
        dirs = np.asarray(parts["dirs"], dtype=np.float32)
        dirs = dirs[None] if dirs.ndim == 1 else dirs
        bounds = parts.get("bounds")
        if dirs.ndim != 2 or (bounds is not None and (np.shape(bounds) != (dirs.shape[0], 2)
                                                       or np.isnan(np.asarray(bounds, dtype=np.float64)).any())):
            raise SteeringSpecError(f"file.{name}", "expected directions [K, hidden] and bounds [K, 2] (no NaN)")
        ops = []
        for k, v in enumerate(dirs):
            if bounds is None or (bounds[k][0] == 0 and bounds[k][1] == 0):
                ops.append({"direction": v.tolist(), "mode": "ablate"})
            else:
                lo, hi = (float(b) for b in bounds[k])
                ops.append({"direction": v.tolist(), "mode": "cap", **({"min": lo} if np.isfinite(lo) else {}),
                            **({"max": hi} if np.isfinite(hi) else {})})
        out.setdefault(_PROJ_FIELD[phase], {})[site] = ops
    return out


def read_safetensors(data: bytes, shape: ModelShape) -> tuple[dict[str, Vectors], dict[str, str], dict]:
    """(tiers, metadata, projection fields) of a safetensors file's bytes."""
    from safetensors import safe_open
    from safetensors.numpy import load

    try:
        tensors = load(data)
    except Exception as e:  # safetensors raises its own error types
        raise SteeringSpecError("file", f"not a readable safetensors file: {e}") from None
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        with safe_open(f.name, "np") as st:
            metadata = dict(st.metadata() or {})
    tiers: dict[str, Vectors] = {t: {} for t in TIER_FIELDS}
    projections = _projections({n: a for n, a in tensors.items() if _PROJ.fullmatch(n)})
    for name, arr in tensors.items():
        if _PROJ.fullmatch(name):
            continue
        phase, site = _PHASE.fullmatch(name).groups()
        try:
            hook, layer = parse_site_name(site)
        except ValueError as e:
            raise SteeringSpecError(f"file.{name}", f"tensor names must be [prefill.|decode.]<site>: {e}") from None
        _add(tiers, _TIER_PREFIX[phase or ""], hook, layer, arr, shape, f"file.{name}")
    if not any(tiers.values()) and not projections:
        raise SteeringSpecError("file", "no steering tensors in the file")
    return tiers, metadata, projections


def read_gguf_control_vector(data: bytes, shape: ModelShape) -> tuple[dict[str, Vectors], dict[str, str]]:
    """(tiers, metadata) of a GGUF control vector: ``direction.N`` -> post_mlp at layer N."""
    import gguf

    fd, path = tempfile.mkstemp(suffix=".gguf")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:
            raise SteeringSpecError("file", f"not a readable GGUF file: {e}") from None
        tiers: dict[str, Vectors] = {t: {} for t in TIER_FIELDS}
        for t in reader.tensors:
            m = _GGUF_NAME.match(t.name)
            if not m:
                continue
            _add(tiers, "steering_vectors", "post_mlp", m.group(1), np.array(t.data), shape, f"file.{t.name}")
        meta = {}
        hint = reader.get_field("controlvector.model_hint")
        if hint is not None:
            meta["model_hint"] = bytes(hint.parts[hint.data[0]]).decode(errors="replace")
    finally:
        os.unlink(path)
    if not any(tiers.values()):
        raise SteeringSpecError("file", "no direction.N tensors in the GGUF file")
    return tiers, meta
