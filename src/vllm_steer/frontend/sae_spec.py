"""Parse and validate a request's ``sae`` field against the server's SAEs (``core.sae_catalog``).

``"sae": {"name", "site"?, "mode"?: "delta" | "reconstruct", "phase"?: "both" | "prefill" | "decode",
"clamps": [{"feature", "kind": "set" | "add" | "scale", "value", "only_if_active"?}]}``, or a list of such
objects (one per SAE, site and phase; a transcoder is named like an SAE, its site post_attn.L for layer L's MLP).
Several SAEs at one site all read the same stream there and their edits add (``core.sae_catalog.site_regions``).
Every problem raises SteeringSpecError naming the field, e.g.
``sae.clamps[3].feature``. Out come the wire entries (``core.sae_rows``) of each phase.

Neuronpedia's steering shape is sugar over it: ``"sae": {"features": [{"sae", "index", "strength",
"site"?}], "phase"?}``. Each feature becomes an ``add`` clamp of ``strength``, which in delta mode moves
the stream by exactly ``strength x W_dec[index]`` (Neuronpedia's additive steering), at every token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_catalog import SaeEntry
from vllm_steer.core.sae_files import SaeFileError, parse_site
from vllm_steer.core.sae_rows import ADD, DELTA, ONLY_IF_ACTIVE, RECONSTRUCT, SCALE, SET, SaeWire, wire_entry
from vllm_steer.core.vectors import SAE_FIELD
from vllm_steer.frontend.spec import finite_number

_MODES = {"delta": DELTA, "reconstruct": RECONSTRUCT}
_KINDS = {"set": SET, "add": ADD, "scale": SCALE}
_PHASES = {"both": (True, True), "prefill": (True, False), "decode": (False, True)}
_ENTRY_KEYS = {"name", "site", "mode", "phase", "clamps"}
_CLAMP_KEYS = {"feature", "kind", "value", "only_if_active"}
_FEATURE_KEYS = {"sae", "index", "strength", "site"}


def _choice(field: str, raw: Any, options: dict, default: str) -> Any:
    value = default if raw is None else raw
    if not isinstance(value, str) or value not in options:
        raise SteeringSpecError(field, f"expected one of {list(options)}, got {raw!r}")
    return options[value]


def _object(field: str, raw: Any, keys: set[str], shape: str) -> dict:
    """``raw`` if it is an object with only ``keys``; SteeringSpecError naming ``field`` else."""
    if not isinstance(raw, dict):
        raise SteeringSpecError(field, f"expected {shape}")
    extra = set(raw) - keys
    if extra:
        raise SteeringSpecError(field, f"unknown keys {sorted(extra)}")
    return raw


def _site(field: str, raw: Any, entry: SaeEntry) -> tuple[str, int]:
    if raw is None:
        if len(entry.sites) != 1:
            raise SteeringSpecError(field, f"SAE {entry.name!r} has several sites: name one of "
                                           f"{sorted(f'{h}.{l}' for h, l in entry.sites)}")
        return next(iter(entry.sites))
    if not isinstance(raw, str):
        raise SteeringSpecError(field, f"expected a site 'hook.layer', got {raw!r}")
    try:
        site = parse_site(raw, field)
    except SaeFileError as e:
        raise SteeringSpecError(field, e.detail) from None
    if site not in entry.sites:
        raise SteeringSpecError(field, f"SAE {entry.name!r} has no site {raw!r}")
    return site


def _clamps(field: str, raw: Any, entry: SaeEntry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slots, codes, values) of a clamp list."""
    if not isinstance(raw, list):
        raise SteeringSpecError(field, "expected a list of {feature, kind, value, only_if_active}")
    if len(raw) > len(entry.features):
        raise SteeringSpecError(field, f"{len(raw)} clamps, but SAE {entry.name!r} has {len(entry.features)} "
                                       "clampable features")
    slots, codes, values = [], [], []
    seen: set[int] = set()
    for i, clamp in enumerate(raw):
        f = f"{field}[{i}]"
        _object(f, clamp, _CLAMP_KEYS, "{feature, kind, value, only_if_active}")
        feature = clamp.get("feature")
        if type(feature) is not int:
            raise SteeringSpecError(f"{f}.feature", f"expected a feature id (an integer), got {feature!r}")
        if feature not in entry.slot_of:
            raise SteeringSpecError(f"{f}.feature", f"feature {feature} is not clampable on SAE {entry.name!r} "
                                                    "(steer.sae.<name>.features)")
        if feature in seen:
            raise SteeringSpecError(f"{f}.feature", f"feature {feature} clamped twice")
        seen.add(feature)
        kind = _choice(f"{f}.kind", clamp.get("kind"), _KINDS, "set")
        value = finite_number(f"{f}.value", clamp.get("value"))
        only = clamp.get("only_if_active", False)
        if not isinstance(only, bool):
            raise SteeringSpecError(f"{f}.only_if_active", f"expected true or false, got {only!r}")
        slots.append(entry.slot_of[feature])
        codes.append(kind | (ONLY_IF_ACTIVE if only else 0))
        values.append(value)
    return np.asarray(slots, np.int32), np.asarray(codes, np.int32), np.asarray(values, np.float32)


def _from_features(raw: dict, catalog: dict[str, SaeEntry]) -> list[dict]:
    """The clamp entries of Neuronpedia's ``{"features": [...]}`` shape (one per SAE and site)."""
    _object(SAE_FIELD, raw, {"features", "phase"}, '{"features": [{"sae", "index", "strength", "site"?}], "phase"?}')
    features = raw["features"]
    if not isinstance(features, list) or not features:
        raise SteeringSpecError(f"{SAE_FIELD}.features", "expected a non-empty list of {sae, index, strength, site?}")
    groups: dict[tuple[str, tuple[str, int]], list[dict]] = {}
    for i, item in enumerate(features):
        f = f"{SAE_FIELD}.features[{i}]"
        _object(f, item, _FEATURE_KEYS, "{sae, index, strength, site?}")
        name = item.get("sae")
        if not isinstance(name, str) or name not in catalog:
            raise SteeringSpecError(f"{f}.sae", f"unknown SAE {name!r} (this server has {sorted(catalog)})")
        entry, index = catalog[name], item.get("index")
        if type(index) is not int or index not in entry.slot_of:
            raise SteeringSpecError(f"{f}.index", f"feature {index!r} is not clampable on SAE {name!r} "
                                                  "(steer.sae.<name>.features)")
        site = _site(f"{f}.site", item.get("site"), entry)
        clamps = groups.setdefault((name, site), [])
        if any(c["feature"] == index for c in clamps):
            raise SteeringSpecError(f"{f}.index", f"feature {index} of SAE {name!r} given twice")
        clamps.append({"feature": index, "kind": "add", "value": finite_number(f"{f}.strength", item.get("strength"))})
    _choice(f"{SAE_FIELD}.phase", raw.get("phase"), _PHASES, "both")
    phase = {"phase": raw["phase"]} if raw.get("phase") is not None else {}
    return [{"name": name, "site": f"{h}.{l}", **phase, "clamps": clamps} for (name, (h, l)), clamps in groups.items()]


def parse_sae(raw: Any, catalog: dict[str, SaeEntry]) -> tuple[list[SaeWire], list[SaeWire]]:
    """(prefill entries, decode entries) of a request's ``sae`` field (None: none)."""
    if raw is None:
        return [], []
    if not catalog:
        raise SteeringSpecError(SAE_FIELD, "this server has no SAE (start it with steer.sae, or register one: POST /v1/steering/sae)")
    if isinstance(raw, dict) and "features" in raw:
        raw = _from_features(raw, catalog)
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise SteeringSpecError(SAE_FIELD, "expected an object or a non-empty list of objects")
    phases: tuple[list[SaeWire], list[SaeWire]] = ([], [])
    taken: set[tuple[int, tuple[str, int], str]] = set()  # (phase, site, name): several SAEs (and a transcoder)
    # may share a site, each once per phase
    for i, item in enumerate(items):
        field = f"{SAE_FIELD}[{i}]" if isinstance(raw, list) else SAE_FIELD
        _object(field, item, _ENTRY_KEYS, '{"name", "clamps", "mode"?, "phase"?, "site"?}')
        name = item.get("name")
        if not isinstance(name, str) or name not in catalog:
            raise SteeringSpecError(f"{field}.name", f"unknown SAE {name!r} (this server has {sorted(catalog)})")
        entry = catalog[name]
        site = _site(f"{field}.site", item.get("site"), entry)
        mode = _choice(f"{field}.mode", item.get("mode"), _MODES, "delta")
        if mode == RECONSTRUCT and not entry.config.reconstruct:
            raise SteeringSpecError(f"{field}.mode", f"SAE {name!r} was not loaded for reconstruct "
                                                     "(steer.sae.<name>.reconstruct: true)")
        pre, dec = _choice(f"{field}.phase", item.get("phase"), _PHASES, "both")
        clamps = item.get("clamps", [] if mode == RECONSTRUCT else None)
        slots, codes, values = _clamps(f"{field}.clamps", clamps, entry)
        if mode == DELTA and not len(slots):
            continue  # no clamp, no change
        wire = wire_entry(name, site[0], site[1], mode, slots, codes, values)
        for p, on in enumerate((pre, dec)):
            if on:
                if (p, site, name) in taken:
                    raise SteeringSpecError(field, f"SAE {name!r} clamps site {site[0]}.{site[1]} twice in the "
                                                   f"{('prefill', 'decode')[p]} phase")
                taken.add((p, site, name))
                phases[p].append(wire)
    return phases
