"""Extraction: contrastive pairs -> steering vectors, read from the engine itself.

``extract(target, pairs, ...)`` sends each side of each pair through the model (a running server's
URL, or an in-process ``vllm.LLM``) with the built-in ``activations`` capture consumer, and computes
a direction per hook and layer (``methods``). The result saves as a module file or registers as a
named module, with each site's typical residual norm over the same texts (``core.site_norms``: the
file's ``site_norms`` metadata, what ``steering_module: {"norm": x}`` reads). ``vllm-steer extract``
(``vllm_steer.cli``) is the same from the shell; ``calibrate`` and ``sweep`` (this package) measure norms
for other vectors and show where a strength breaks the text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.layer_selection import parse_layers
from vllm_steer.core.site_names import tl_hook
from vllm_steer.core.site_norms import METADATA_KEY, Norms, as_json, measure
from vllm_steer.extract.files import EMITS, Vectors, file_kind, gguf_bytes, safetensors_bytes
from vllm_steer.extract.methods import METHODS, direction
from vllm_steer.extract.pairs import ExtractError, Pair, as_pair, read_jsonl
from vllm_steer.extract.sources import Text, capture_field, source_of
from vllm_steer.client_types import Module
from vllm_steer.http_client import Client, SteeringAPIError

__all__ = ["Extraction", "ExtractError", "Pair", "extract"]


@dataclass
class Extraction:
    """Per-hook, per-layer vectors (``vectors["post_mlp"][14]``: ``[hidden]`` float32) and how they were made."""

    vectors: Vectors
    method: str
    reduce: str
    pairs: int
    model: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    emit: str = "add"  # "ablate": the module ablates each direction at its site (steer.max_projections)
    site_norms: Norms | None = None  # typical residual norm per site over the same texts (core.site_norms)

    def metadata(self) -> dict[str, str]:
        what = "ablating the directions of " if self.emit == "ablate" else ""
        out = {"description": f"vllm-steer extract: {what}{self.method} over {self.pairs} pairs ({self.reduce} token)",
               "method": self.method, "reduce": self.reduce, "pairs": str(self.pairs), "model": self.model,
               "emit": self.emit}
        if self.site_norms:
            out[METADATA_KEY] = json.dumps(as_json(self.site_norms))
        return out

    def file_bytes(self, kind: str = "safetensors") -> bytes:
        if kind == "gguf":
            if self.emit == "ablate":  # llama.cpp / repeng would add them
                raise ExtractError("--emit ablate writes .safetensors (project.<site> tensors); a GGUF control "
                                   "vector is added by llama.cpp and repeng (register one with as_ablation instead)")
            return gguf_bytes(self.vectors, self.model)
        return safetensors_bytes(self.vectors, self.metadata(), self.emit)

    def save(self, path: str | Path) -> Path:
        """Write a ``.safetensors`` or ``.gguf`` module file (by suffix)."""
        data = self.file_bytes(file_kind(path))
        tmp = Path(f"{path}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return Path(path)

    def register(self, base_url: str, name: str, api_key: str | None = None, replace: bool = False,
                 timeout: float = 120.0) -> Module:
        """Register as the named module ``name`` on a server (``POST /v1/steering/modules``, a file upload)."""
        with Client(base_url, api_key=api_key, timeout=timeout) as c:
            try:
                return c.register_module(name, file=(f"{name}.safetensors", self.file_bytes()), replace=replace,
                                         description=self.metadata()["description"])
            except SteeringAPIError as e:
                raise ExtractError(f"registering module {name!r} failed ({e.status}): {e.detail}") from None


def _layers(layers: Any) -> list[int] | str:
    try:
        out = parse_layers(sorted({int(l) for l in layers}) if isinstance(layers, (list, tuple, range, set)) else layers)
    except ValueError as e:
        raise ExtractError(f"layers: {e}") from None
    return "all" if out is None else out


def extract(target: Any, pairs: Iterable[Any] | str | Path, *, layers: Any = "all",
            hooks: Iterable[str] = ("post_mlp",), method: str = "mean_diff", reduce: str = "last",
            chat: bool = False, normalize: bool = False, model: str | None = None, api_key: str | None = None,
            instance: str = "activations", progress: Callable[[int, int], None] | None = None,
            emit: str = "add") -> Extraction:
    """Steering vectors from contrastive ``pairs`` (a JSONL path, or Pairs / dicts / 2-tuples).

    ``target``: a server URL (``http://host:8000``) or a ``vllm.LLM``, either with ``"activations"`` in
    its ``steer.capture``. ``method``: ``mean_diff`` (CAA) or ``pca`` (repeng's PCA of paired differences,
    unit norm). ``reduce``: ``last`` (the last token's residual, CAA and repeng) or ``mean`` (over the
    whole text). ``normalize``: scale each vector to unit norm. ``chat``: apply the model's chat template.
    ``instance``: the consumer's instance name on the server, when the operator named it otherwise.
    ``emit``: ``add`` (a module adding the vectors) or ``ablate`` (a module removing each direction from the
    stream at its site, ``h - (h.v)v``: e.g. a refusal direction by diff-of-means; the server needs
    ``steer.max_projections`` >= 1)."""
    if emit not in EMITS:
        raise ExtractError(f"emit: expected one of {list(EMITS)}, got {emit!r}")
    if method not in METHODS:
        raise ExtractError(f"method: expected one of {list(METHODS)}, got {method!r}")
    if reduce not in ("last", "mean"):
        raise ExtractError(f"reduce: expected 'last' or 'mean', got {reduce!r}")
    hooks = [tl_hook(h) or h for h in hooks]  # hook_resid_post (TransformerLens) is post_mlp
    bad = [h for h in hooks if h not in HOOK_NAMES]
    if not hooks or bad:
        raise ExtractError(f"hooks: expected some of {list(HOOK_NAMES)} (or hook_resid_pre|mid|post), got {bad or hooks}")
    if isinstance(pairs, (str, Path)):
        pairs = read_jsonl(pairs)
    pairs = [as_pair(p, f"pairs[{i}]") for i, p in enumerate(pairs)]
    if not pairs:
        raise ExtractError("pairs: no pairs given")
    if method == "pca" and len(pairs) < 2:
        raise ExtractError("pairs: pca needs at least two pairs")
    source = source_of(target, model=model, api_key=api_key)
    texts = [Text(side, p.prompt, chat) for p in pairs for side in (p.positive, p.negative)]
    t0 = time.monotonic()
    rows = source.activations(texts, capture_field(_layers(layers), hooks, reduce, instance), progress)
    # the typical norms are of last-token rows (core.site_norms): a mean extraction reads them once more
    last_rows = rows if reduce == "last" else source.activations(
        texts, capture_field(_layers(layers), hooks, "last", instance))
    sites = list(rows[0])
    vectors: Vectors = {}
    for site in sites:
        pos = np.stack([r[site] for r in rows[0::2]])
        neg = np.stack([r[site] for r in rows[1::2]])
        v = direction(method, pos, neg)
        if normalize:
            n = float(np.linalg.norm(v))
            v = v / n if n > 0 else v
        hook, layer = site.rsplit(".", 1)
        vectors.setdefault(hook, {})[int(layer)] = v
    return Extraction(vectors, method, reduce, len(pairs), getattr(source, "model", "") or "",
                      {"requests": len(texts) * (1 if reduce == "last" else 2),
                       "seconds": round(time.monotonic() - t0, 3)}, emit, measure(last_rows))
