"""Typical residual norms per site, and the ``norm`` strength unit built on them.

A site's typical norm is the **mean, over a set of texts, of the L2 norm of the residual stream at the
site at each text's last prompt token** (the stream steering adds to, before it is steered: what capture
reads). The last prompt token is where the next token is computed from, so it stands for the positions
steering acts on, and it skips the first token, whose residual is an outlier in many models.
``vllm-steer extract`` stores them over its texts, ``vllm-steer calibrate`` over a prompt set.

``"norm": x`` (instead of ``scale``) scales a vector ``v`` at site S to ``x * N(S)`` in L2 norm: the factor
``x * N(S) / |v|`` is computed in float64 and multiplies ``v`` in float32 (``norm_factor``); a zero vector
stays zero; a negative ``x`` points the vector the other way. ``x = 0.1``: a tenth of the stream's typical size.

Where they are written: a JSON file (``FORMAT``; ``{"site_norms": {"post_mlp.14": 9.8, ...}, ...}``, what
calibrate writes) and the ``site_norms`` metadata key of a module's safetensors file (a JSON string of
the same mapping, what extract writes). Where they are read at serve time: the module a request names
(its file's or its registration's ``site_norms``), else the server's ``steer.site_norms`` file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.site_names import parse_site_name

FORMAT = "vllm-steer-site-norms/1"
METADATA_KEY = "site_norms"  # the safetensors metadata key of a module file
STATISTIC = "mean over texts of the L2 norm of the residual at the site at the text's last prompt token"
HOW_TO_GET = ("measure them with `vllm-steer calibrate --server URL --hooks {hook} -o norms.json`, then start the "
              "server with steer.site_norms naming that file, or register the module with them (site_norms)")

Norms = dict[tuple[str, int], float]  # (hook, layer) -> typical residual L2 norm


def parse_norms(raw: Any, field: str, num_layers: int | None = None) -> Norms:
    """``{"post_mlp.14": 9.8, ...}`` (or a whole calibrate file, which holds it under ``site_norms``) ->
    Norms; SteeringSpecError naming ``field`` (``field.<site>``) for anything else."""
    if isinstance(raw, dict) and isinstance(raw.get(METADATA_KEY), dict):
        raw = raw[METADATA_KEY]
    if not isinstance(raw, dict) or not raw:
        raise SteeringSpecError(field, 'expected {"<site>": <typical residual L2 norm>, ...} (what vllm-steer '
                                       'calibrate writes)')
    out: Norms = {}
    for key, value in raw.items():
        f = f"{field}.{key}"
        try:
            hook, layer = parse_site_name(str(key))
        except ValueError as e:
            raise SteeringSpecError(f, str(e)) from None
        if num_layers is not None and not 0 <= layer < num_layers:
            raise SteeringSpecError(f, f"layer {layer} out of range: the model has {num_layers} layers")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise SteeringSpecError(f, f"expected a positive finite number, got {value!r}")
        out[(hook, layer)] = float(value)
    return out


def as_json(norms: Norms) -> dict[str, float]:
    """Norms as the files hold them: ``{"post_mlp.14": 9.8}``, by layer then hook."""
    return {f"{h}.{l}": round(float(v), 6) for (h, l), v in sorted(norms.items(), key=lambda kv: (kv[0][1], kv[0][0]))}


def read_file(path: str | Path, field: str = "steer.site_norms", num_layers: int | None = None) -> Norms:
    """The norms in a calibrate JSON file or in a module's safetensors metadata (``site_norms``)."""
    p = Path(path)
    data = p.read_bytes()
    if p.suffix == ".safetensors":
        meta = _safetensors_metadata(data, str(p))
        if METADATA_KEY not in meta:
            raise SteeringSpecError(field, f"{p}: the file's metadata has no {METADATA_KEY!r} (extract writes it)")
        text = meta[METADATA_KEY]
    else:
        text = data.decode("utf-8", errors="replace")
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise SteeringSpecError(field, f"{p}: not JSON: {str(e)[:200]}") from None
    return parse_norms(raw, field, num_layers)


def _safetensors_metadata(data: bytes, where: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (read without the tensors)."""
    if len(data) < 8:
        raise SteeringSpecError("site_norms", f"{where}: not a safetensors file")
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise SteeringSpecError("site_norms", f"{where}: not a safetensors file") from None
    return header.get("__metadata__") or {}


def measure(rows: Iterable[dict[str, np.ndarray]]) -> Norms:
    """Per site, the mean L2 norm of the rows (one ``{site: vector}`` per text, ``"post_mlp.3"`` keys)."""
    sums: dict[str, list[float]] = {}
    for per_text in rows:
        for site, v in per_text.items():
            sums.setdefault(site, []).append(float(np.linalg.norm(np.asarray(v, np.float64))))
    return {parse_site_name(s): float(np.mean(ns)) for s, ns in sums.items()}


def file_object(norms: Norms, model: str, texts: int, source: str) -> dict:
    """The JSON object a norms file holds (``FORMAT``)."""
    return {"format": FORMAT, "model": model, "statistic": STATISTIC, "texts": texts, "source": source,
            METADATA_KEY: as_json(norms)}


def norm_factor(vec: np.ndarray, target: float) -> np.float32:
    """The factor giving ``vec`` the L2 norm ``target`` (0 for a zero vector), computed in float64."""
    n = float(np.linalg.norm(np.asarray(vec, np.float64)))
    return np.float32(target / n) if n > 0 else np.float32(0.0)


def normed(layers: dict[int, np.ndarray], hook: str, norm: float, lookup: Callable[[str, int], float | None],
           field: str, where: str = "in this server's steer.site_norms") -> dict[int, np.ndarray]:
    """``{layer: vector}`` of one hook, each vector scaled to ``norm`` times its site's typical norm; a site
    without one is a SteeringSpecError naming ``field`` that says how to get them."""
    out = {}
    for layer, v in layers.items():
        typical = lookup(hook, layer)
        if typical is None:
            raise SteeringSpecError(field, f"no typical residual norm for site {hook}.{layer} {where}, so a "
                                           f"'norm' strength cannot be turned into a scale there: {HOW_TO_GET.format(hook=hook)}; "
                                           "or give 'scale' instead")
        out[layer] = (v * norm_factor(v, norm * typical)).astype(np.float32, copy=False)
    return out
