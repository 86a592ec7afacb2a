"""Steering vectors as the front end and the workers both handle them: the request field names,
the ``{hook: {layer: float32 vector}}`` type, and the tier arithmetic.

``effective_phases`` is the one place the arithmetic lives: the front end hashes its result and
the worker rebuilds a named module's rows with it, so both agree to the bit.
"""

from __future__ import annotations

import numpy as np

TIER_FIELDS = ("steering_vectors", "prefill_steering_vectors", "decode_steering_vectors")
MODULE_FIELD = "steering_module"
CAPTURE_FIELD = "capture"
SAE_FIELD = "sae"
CONDITION_FIELD = "steering_condition"
# directional projections (ablate / cap) per phase, like the vector tiers (frontend.projection_spec)
PROJECTION_FIELDS = ("steering_projections", "prefill_steering_projections", "decode_steering_projections")
GATES_VECTORS, GATES_SAE, GATES_PROJECTIONS = 1, 2, 4  # what a condition scales (its ``applies_to``), as bits of its wire form
REQUEST_FIELDS = TIER_FIELDS + (MODULE_FIELD, CAPTURE_FIELD, SAE_FIELD, CONDITION_FIELD) + PROJECTION_FIELDS

# hook -> layer -> float32 vector [D]
Vectors = dict[str, dict[int, np.ndarray]]


class PackedLayers(dict):
    """{layer: vector} whose vectors are the rows of one float32 block, in ``order``: what the
    packed wire form decodes to, so ``stack_rows`` can hand out the block instead of a copy."""

    def __init__(self, block: np.ndarray, order: list[int]) -> None:
        super().__init__((layer, block[i]) for i, layer in enumerate(order))
        self.block = block
        self.order = order


def stack_rows(layers: dict[int, np.ndarray], ids: list[int]) -> np.ndarray:
    """``np.stack([layers[i] for i in ids])``, without the copy for a whole packed block."""
    if isinstance(layers, PackedLayers) and layers.order == ids:
        return layers.block
    return np.stack([layers[i] for i in ids])


def merge(*parts: Vectors) -> Vectors:
    """Sum vector sets (per hook, per layer), in float32."""
    out: Vectors = {}
    for part in parts:
        for hook, layers in part.items():
            dst = out.setdefault(hook, {})
            for layer, vec in layers.items():
                dst[layer] = vec if layer not in dst else dst[layer] + vec
    return out


def scaled(vectors: Vectors, scale: float) -> Vectors:
    if scale == 1.0:
        return vectors
    s = np.float32(scale)
    return {h: {l: v * s for l, v in ls.items()} for h, ls in vectors.items()}


def nonzero(vectors: Vectors) -> Vectors:
    """Drop all-zero vectors and empty hooks (an all-zero config is no steering at all)."""
    out: Vectors = {}
    for hook, layers in vectors.items():
        if not layers:
            continue
        ids = list(layers)
        keep = stack_rows(layers, ids).any(axis=1)  # one pass per hook
        kept = layers if keep.all() else {l: layers[l] for l, k in zip(ids, keep) if k}
        if kept:
            out[hook] = kept
    return out


def selected(tiers: dict[str, Vectors], layers: list[int] | None, hooks: list[str] | None) -> dict[str, Vectors]:
    """A module's tiers cut to the ``layers`` and ``hooks`` a reference selects (None: all)."""
    if layers is None and hooks is None:
        return tiers
    keep_l = None if layers is None else set(layers)
    out: dict[str, Vectors] = {}
    for tier, vectors in tiers.items():
        cut = {h: {l: v for l, v in ls.items() if keep_l is None or l in keep_l}
               for h, ls in vectors.items() if hooks is None or h in hooks}
        out[tier] = {h: ls for h, ls in cut.items() if ls}
    return out


def effective_phases(
    tiers: dict[str, Vectors], module_tiers: dict[str, Vectors] | None = None, scale: float = 1.0
) -> tuple[Vectors, Vectors]:
    """(prefill, decode) effective vectors: (module tiers x scale) + request tiers, base + phase."""
    base, pre, dec = (tiers.get(f, {}) for f in TIER_FIELDS)
    if module_tiers is None and not pre and not dec:
        both = nonzero(base)
        return both, both  # the same object: callers hash it once
    if module_tiers is not None:
        m_base, m_pre, m_dec = (module_tiers.get(f, {}) for f in TIER_FIELDS)
        base = merge(scaled(m_base, scale), base)
        pre = merge(scaled(m_pre, scale), pre)
        dec = merge(scaled(m_dec, scale), dec)
    return nonzero(merge(base, pre)), nonzero(merge(base, dec))
