"""``steering_projections`` (``prefill_`` / ``decode_``, per phase like the vector tiers): directional operations
on the residual stream, per site, applied by the steered norm after the SAE clamps and before the vectors.

The field maps a hook point to ``{layer: [op, ...]}``, or a site name (``"post_mlp.12"``,
``"blocks.12.hook_resid_post"``) to ``[op, ...]``; an op is

    {"direction": [hidden floats] | {"dtype", "data"}, "mode": "ablate"}
    {"direction": ..., "mode": "cap", "min"?: a, "max"?: b}      (a <= b; an absent bound is unbounded)

``direction`` is normalised here (``v = d / |d|``; zero or non-finite: 400). Per token, each op of the
site in order: ``p = h . v``, ``h += (clamp(p, lo, hi) - p) v``; ablate is ``lo = hi = 0`` (``h - (h . v) v``).
A phase's ops at a site are the ``steering_projections`` ones, then its own tier's; at most
``steer.max_projections`` per site (400 naming the field past it); none at ``pre_attn.0`` (the
embeddings' norm is steered by an add outside the op). Every problem raises
SteeringSpecError naming the field.

Wire form (``core.payload.SteerPayload.projections``): per phase a list of ``[hook, layer, dirs, bounds]``
(float32 bytes ``[K, D]`` and ``[K, 2]``) in site order; ``projection_key`` re-keys the phase's config with
them (its own BLAKE3 domain: a projected config never shares a row or a prefix-cache salt with another).
"""

from __future__ import annotations

import math

from typing import Any

import numpy as np
from blake3 import blake3

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.vectors import PROJECTION_FIELDS
from vllm_steer.frontend.spec import (ModelShape, check_hook, check_layer, finite_number, parse_packed_vector,
                                     parse_site_key, parse_vector)

_DOMAIN = b"vllm-steer-projections-v2\0"  # v2: each site's directions enter as their BLAKE3 digest
MODES = ("ablate", "cap")
_KEYS = {"ablate": {"direction", "mode"}, "cap": {"direction", "mode", "min", "max"}}

_ABLATE_BOUNDS = np.zeros(2, np.float32).tobytes()  # one ablation's (lo, hi)
ProjWire = list  # [hook, layer, dirs (float32 bytes [K, D]), bounds (float32 bytes [K, 2]: lo, hi)]
Site = tuple[str, int]


Ops = dict[Site, tuple[str, list[tuple[np.ndarray, float, float]]]]  # site -> (field naming it, [(v, lo, hi)])


def parse_projections(fields: dict[str, Any], shape: ModelShape, max_projections: int,
                      module: tuple[dict, tuple[int, ...] | None, tuple[str, ...] | None] | None = None,
                      ) -> tuple[list[ProjWire], list[ProjWire]]:
    """(prefill, decode) wire entries of a request's projection fields (absent ones: none). ``module``: the
    projection fields of the module the request names (``SteeringModule.projections``, checked when it was
    registered) with the request's layer / hook selection: its ops at a site come before the request's."""
    given = [f for f in PROJECTION_FIELDS if fields.get(f) is not None]
    if not given and not (module and module[0]):
        return [], []
    if max_projections <= 0:
        raise SteeringSpecError(given[0] if given else "steering_module.name",
                                "directional projections are off on this server (start it with "
                                "steer.max_projections >= 1)")
    memo: dict = {}  # one direction given at many sites (a refusal direction at every layer) is read once
    tiers = [_parse_field(f, fields.get(f), shape, memo) for f in PROJECTION_FIELDS]
    if module and module[0]:
        raw, layers, hooks = module
        for i, f in enumerate(PROJECTION_FIELDS):
            own = _parse_field(f, raw.get(f), shape, memo)
            own = {s: v for s, v in own.items() if (layers is None or s[1] in layers) and (hooks is None or s[0] in hooks)}
            tiers[i] = {s: (tiers[i][s][0] if s in tiers[i] else "steering_module.name",
                            own.get(s, ("", []))[1] + tiers[i].get(s, ("", []))[1]) for s in set(own) | set(tiers[i])}
    base, pre, dec = tiers
    blocks: dict = {}  # one site's dirs bytes per distinct op list: a direction at every layer is copied once
    prefill = _phase(base, pre, PROJECTION_FIELDS[1], max_projections, blocks)
    if not pre and not dec:  # the common tier alone: both phases are the same entries (one list, compared at once)
        return prefill, prefill
    return prefill, _phase(base, dec, PROJECTION_FIELDS[2], max_projections, blocks)


def module_projections(fields: dict[str, Any], shape: ModelShape, max_projections: int) -> dict | None:
    """A module registration's projection fields, checked as a request's would be (SteeringSpecError naming
    the field), kept as given (None: none)."""
    out = {f: fields[f] for f in PROJECTION_FIELDS if fields.get(f) is not None}
    if out:
        parse_projections(out, shape, max_projections)
    return out or None


def ablations_of(tiers: dict[str, Any]) -> dict:
    """A module's vectors as ablation directions at their sites, tier by tier (``steering_vectors`` ->
    ``steering_projections``, ...): how a GGUF / repeng control vector is used to remove its direction."""
    from vllm_steer.core.vectors import TIER_FIELDS

    out: dict = {}
    for tier, proj_field in zip(TIER_FIELDS, PROJECTION_FIELDS):
        for hook, layers in (tiers.get(tier) or {}).items():
            for layer, v in layers.items():
                if np.any(v):
                    out.setdefault(proj_field, {})[f"{hook}.{layer}"] = [{"direction": packed(v), "mode": "ablate"}]
    return out


def packed(v: np.ndarray) -> dict:
    """A direction in the packed form requests take (float32, base64): exact and compact in JSON."""
    import base64

    return {"dtype": "float32", "data": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()}


def summary(fields: dict | None) -> dict | None:
    """A module's projections as its listing shows them: per field, per site, the ops' modes."""
    if not fields:
        return None
    out: dict = {}
    for f, obj in fields.items():
        for key, value in obj.items():
            sites = [(key, value)] if "." in key else [(f"{key}.{l}", v) for l, v in value.items()]
            for site, ops in sites:
                out.setdefault(f, {})[site] = [op.get("mode") for op in ops]
    return out


def _phase(base: Ops, own: Ops, own_field: str, k_max: int, blocks: dict) -> list[ProjWire]:
    """One phase's entries: per site the base tier's ops, then the phase's own, in site order. ``blocks``: the
    dirs bytes already built in this request, by the op directions' identities (``_parse_op``'s memo gives one
    array to a direction given at many sites), so those sites share one bytes object (``projection_key`` hashes
    it once)."""
    out = []
    for site in sorted(set(base) | set(own), key=lambda s: (HOOK_NAMES.index(s[0]), s[1])):
        ops = base.get(site, ("", []))[1] + own.get(site, ("", []))[1]
        if len(ops) > k_max:
            field = own[site][0] if site in own else base[site][0]
            where = f" (with {PROJECTION_FIELDS[0]}'s)" if site in own and site in base else ""
            raise SteeringSpecError(field, f"{len(ops)} directions at {site[0]}.{site[1]}{where}, over this "
                                           f"server's steer.max_projections ({k_max})")
        ids = tuple(id(v) for v, _, _ in ops)  # the arrays live in ``ops`` (and the memo) for the whole request
        dirs = blocks.get(ids)
        if dirs is None:
            dirs = blocks[ids] = b"".join(v.tobytes() for v, _, _ in ops)  # unit float32 directions (unit_direction)
        bounds = _ABLATE_BOUNDS if len(ops) == 1 and ops[0][1] == ops[0][2] == 0.0 else \
            (np.asarray([(lo, hi) for _, lo, hi in ops], dtype=np.float32) + np.float32(0.0)).tobytes()  # -0 as 0
        out.append([site[0], site[1], dirs, bounds])
    return out


def _parse_field(field: str, obj: Any, shape: ModelShape, memo: dict) -> Ops:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SteeringSpecError(field, "expected an object mapping hook points (or site names) to projections")
    out: Ops = {}
    for key, value in obj.items():
        f = f"{field}.{key}"
        if isinstance(key, str) and "." in key:  # a site name: [op, ...]
            sites = [(parse_site_key(f, key, shape), f, value)]
        else:
            check_hook(f, key, shape)
            if not isinstance(value, dict):
                raise SteeringSpecError(f, "expected {layer: [projections]}")
            sites = [((key, check_layer(f"{f}.{l}", l, shape)), f"{f}.{l}", v) for l, v in value.items()]
        for site, sf, ops in sites:
            if site == ("pre_attn", 0):
                raise SteeringSpecError(sf, "pre_attn.0 (the embeddings) takes vectors only: project at a later "
                                            "site")
            if site in out:
                raise SteeringSpecError(sf, f"site {site[0]}.{site[1]} is given twice in {field}")
            out[site] = (sf, _parse_ops(sf, ops, shape, memo))
    return out


def _parse_ops(field: str, ops: Any, shape: ModelShape, memo: dict) -> list[tuple[np.ndarray, float, float]]:
    if not isinstance(ops, list) or not ops:
        raise SteeringSpecError(field, 'expected a non-empty list of {"direction", "mode": "ablate" | "cap", '
                                       '"min"?, "max"?}')
    return [_parse_op(f"{field}[{i}]", op, shape, memo) for i, op in enumerate(ops)]


def _parse_op(field: str, op: Any, shape: ModelShape, memo: dict) -> tuple[np.ndarray, float, float]:
    """(unit direction, lo, hi) of one op; ``memo``: packed directions already read in this request."""
    if not isinstance(op, dict):
        raise SteeringSpecError(field, 'expected {"direction", "mode": "ablate" | "cap", "min"?, "max"?}')
    mode = op.get("mode")
    if mode not in MODES:
        raise SteeringSpecError(f"{field}.mode", f"expected one of {list(MODES)}, got {mode!r}")
    extra = sorted(set(op) - _KEYS[mode])
    if extra:
        raise SteeringSpecError(f"{field}.{extra[0]}", f"unknown key for mode {mode!r} (keys: {sorted(_KEYS[mode])})")
    if "direction" not in op:
        raise SteeringSpecError(f"{field}.direction", "required")
    raw = op["direction"]
    # str or bytes (a msgpack bin, or a lifted JSON string: ``server.base64_lift``): hashed once per object
    key = (raw.get("dtype"), raw["data"]) if isinstance(raw, dict) and isinstance(raw.get("data"), (str, bytes)) \
        else None
    v = memo.get(key) if key is not None else None
    if v is None:
        v = unit_direction(f"{field}.direction", raw, shape)
        if key is not None:
            memo[key] = v
    if mode == "ablate":
        return v, 0.0, 0.0
    lo = finite_number(f"{field}.min", op["min"]) if op.get("min") is not None else -np.inf
    hi = finite_number(f"{field}.max", op["max"]) if op.get("max") is not None else np.inf
    if op.get("min") is None and op.get("max") is None:
        raise SteeringSpecError(field, "a cap needs a bound: min, max or both")
    if lo > hi:
        raise SteeringSpecError(f"{field}.min", f"min {lo!r} is above max {hi!r}")
    return v, lo, hi


def unit_direction(field: str, raw: Any, shape: ModelShape) -> np.ndarray:
    """``raw`` (floats, or packed ``{"dtype", "data"}``) normalised to unit length in float32; a zero (or
    non-finite) direction is refused."""
    d = parse_packed_vector(field, raw, shape) if isinstance(raw, dict) else parse_vector(field, raw, shape)
    d64 = d.astype(np.float64)
    norm = math.sqrt(float(np.dot(d64, d64)))
    if not math.isfinite(norm) or norm == 0.0:
        raise SteeringSpecError(field, "a direction must be non-zero (and finite)")
    return (d64 / norm).astype(np.float32)


def entry_sites(entries: list[ProjWire]) -> set[Site]:
    return {(e[0], int(e[1])) for e in entries}


def projection_key(key: str | None, entries: list[ProjWire]) -> str | None:
    """The key of a phase's config (``key``: its vectors and clamps, None: none) plus its projections;
    without projections, ``key`` itself."""
    if not entries:
        return key
    h = blake3(_DOMAIN + (key or "").encode() + b"\0")
    digests: dict[int, bytes] = {}  # a site's directions by the bytes object's identity (``_phase`` shares them)
    for hook, layer, dirs, bounds in entries:
        d = digests.get(id(dirs))
        if d is None:
            d = digests[id(dirs)] = blake3(dirs).digest()
        h.update(f"{hook}\0{layer}\0{len(bounds) // 8}\0".encode() + d + bytes(bounds))
    return h.hexdigest()[:32]
