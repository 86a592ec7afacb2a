"""``steering_condition``: steer a request only on the tokens where a probe fires (``steer.conditions``).

The field (beside the steering fields)::

    {"site": "post_mlp.12",
     "probe": [hidden floats] | {"dtype", "data"} | {"module": name, "site"?: "post_mlp.14"},
     "threshold": 0.0, "sharpness": 1.0, "mode": "soft", "phase": "both", "applies_to": "vectors",
     "stop_when": {"above": 0.9, "tokens": 3}}

Per token, ``g = sigmoid(sharpness * (h . probe - threshold))`` (``mode: soft``, the default) or
``g = h . probe > threshold`` (``hard``), ``h`` the residual stream at ``site`` before any steering there (what
capture reads there). In the gated phases (``phase``: ``both``, the default, ``prefill`` or ``decode``;
the other phase's steering applies unconditionally) what ``applies_to`` names is scaled by its token's
``g`` at every site of the same forward pass: ``vectors`` (the default) every vector add, ``sae`` every
SAE clamp's move of the stream (``s + g * (clamped(s) - s)``: ``g = 0`` leaves the site as if unclamped,
``g = 1`` is the plain clamp), ``both`` both, ``projections`` every directional projection's move
(``s + g * (projected(s) - s)``), or a list of those three names; what it does not name applies
unconditionally. A probe
``{"dtype": "float32" | "float16" | "bfloat16", "data": base64}`` is the vector packed (as packed
steering vectors are; no JSON number to parse). A probe ``{"module": name}`` is that named module's
vector at the probe site (or at its own ``site``), read when the request arrives. Sites before ``site``
have no gate yet: a request with a gated vector or clamp there is refused (400 naming
``steering_condition.site``), as are a condition with nothing to gate in its phases, a probe at
``pre_attn.0`` or at (or beside, in the same norm) a site with an SAE, and any condition under pipeline
parallelism (the gate does not cross stages). The condition is part of the config key, so rows and
prefix-cache salt differ from the same steering without it.

``stop_when`` (optional) finishes the request once ``tokens`` consecutive generated tokens were each
sampled from a position whose gate was above ``above`` (the last prompt position, which samples the
first token, counts when the prefill phase is gated): ``finish_reason`` ``"stop_when"``, the gate of
the last of them in ``stop_reason`` (``core.stops``). It needs the decode phase gated, and it is not
part of the key: the rows and the prefix cache are those of the same condition without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from blake3 import blake3

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.hooks import HOOK_NAMES, site_order
from vllm_steer.core.site_names import parse_site_name
from vllm_steer.core.vectors import CONDITION_FIELD, GATES_PROJECTIONS, GATES_SAE, GATES_VECTORS
from vllm_steer.frontend.spec import ModelShape, check_layer, finite_number, parse_packed_vector, parse_vector

_DOMAIN = b"vllm-steer-condition-v1\0"
_KEYS = {"site", "probe", "threshold", "sharpness", "mode", "phase", "applies_to", "stop_when"}
_STOP_KEYS = {"above", "tokens"}
MAX_STOP_TOKENS = 4096
_MODES = {"soft": 0, "hard": 1}
PHASES = ("both", "prefill", "decode")
_PROBE_KEYS = {"module", "site"}
APPLIES_TO = {"vectors": GATES_VECTORS, "sae": GATES_SAE, "both": GATES_VECTORS | GATES_SAE,
              "projections": GATES_PROJECTIONS}
_GATEABLE = ("vectors", "sae", "projections")  # the names a list form of ``applies_to`` may hold

# [hook, layer, threshold, sharpness, hard (0/1), probe as float32 bytes, applies_to bits]: plain types for msgspec
ConditionWire = list


def parse_condition(raw: Any, shape: ModelShape, modules: Any = None) -> tuple[ConditionWire, str, list | None]:
    """(wire form, gated phase, ``stop_when`` as [above, tokens] or None) of a request's condition;
    SteeringSpecError naming the field of any problem. ``modules``: name -> module
    (``frontend.module_store``), for a probe read from one."""
    f = CONDITION_FIELD
    if not isinstance(raw, dict):
        raise SteeringSpecError(f, 'expected {"site", "probe", "threshold"?, "sharpness"?, "mode"?, "phase"?}')
    extra = sorted(set(raw) - _KEYS)
    if extra:
        raise SteeringSpecError(f"{f}.{extra[0]}", f"unknown key (keys: {sorted(_KEYS)})")
    for key in ("site", "probe"):
        if key not in raw:
            raise SteeringSpecError(f"{f}.{key}", "required")
    hook, layer = _site(f"{f}.site", raw["site"], shape)
    if (hook, layer) == ("pre_attn", 0):
        raise SteeringSpecError(f"{f}.site", "pre_attn.0 (the embeddings) cannot be a probe site")
    if isinstance(raw["probe"], dict) and ("data" in raw["probe"] or "dtype" in raw["probe"]):
        probe = parse_packed_vector(f"{f}.probe", raw["probe"], shape)
    elif isinstance(raw["probe"], dict):
        probe = module_probe(raw["probe"], (hook, layer), shape, modules or {})
    else:
        probe = parse_vector(f"{f}.probe", raw["probe"], shape)
    threshold = finite_number(f"{f}.threshold", raw.get("threshold", 0.0))
    sharpness = finite_number(f"{f}.sharpness", raw.get("sharpness", 1.0))
    if sharpness <= 0:
        raise SteeringSpecError(f"{f}.sharpness", f"expected a number > 0, got {sharpness!r}")
    mode = raw.get("mode", "soft")
    if mode not in _MODES:
        raise SteeringSpecError(f"{f}.mode", f"expected one of {sorted(_MODES)}, got {mode!r}")
    phase = raw.get("phase", "both")
    if phase not in PHASES:
        raise SteeringSpecError(f"{f}.phase", f"expected one of {list(PHASES)}, got {phase!r}")
    wire = [hook, layer, threshold, sharpness, _MODES[mode], (probe + np.float32(0)).tobytes(),
            applies_bits(raw.get("applies_to", "vectors"))]
    return wire, phase, parse_stop(raw.get("stop_when"), phase)


def applies_bits(applies: Any) -> int:
    """The wire bits of ``applies_to``: one name of APPLIES_TO, or a non-empty list of _GATEABLE names."""
    f = f"{CONDITION_FIELD}.applies_to"
    if isinstance(applies, list):
        if not applies or not all(isinstance(a, str) and a in _GATEABLE for a in applies) \
                or len(set(applies)) != len(applies):
            raise SteeringSpecError(f, f"expected a non-empty list of distinct names from {list(_GATEABLE)}, "
                                       f"got {applies!r}")
        return sum(APPLIES_TO[a] for a in applies)
    if not isinstance(applies, str) or applies not in APPLIES_TO:
        raise SteeringSpecError(f, f"expected one of {list(APPLIES_TO)} (or a list of {list(_GATEABLE)}), "
                                   f"got {applies!r}")
    return APPLIES_TO[applies]


def parse_stop(raw: Any, phase: str) -> list | None:
    """[above, tokens] of ``stop_when`` (None: absent)."""
    if raw is None:
        return None
    f = f"{CONDITION_FIELD}.stop_when"
    if not isinstance(raw, dict):
        raise SteeringSpecError(f, 'expected {"above": gate in [0, 1), "tokens"?: consecutive tokens (1)}')
    extra = sorted(set(raw) - _STOP_KEYS)
    if extra:
        raise SteeringSpecError(f"{f}.{extra[0]}", f"unknown key (keys: {sorted(_STOP_KEYS)})")
    if "above" not in raw:
        raise SteeringSpecError(f"{f}.above", "required")
    above = finite_number(f"{f}.above", raw["above"])
    if not 0.0 <= above < 1.0:
        raise SteeringSpecError(f"{f}.above", f"expected a gate value in [0, 1), got {above!r}")
    tokens = raw.get("tokens", 1)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_STOP_TOKENS:
        raise SteeringSpecError(f"{f}.tokens", f"expected an integer in [1, {MAX_STOP_TOKENS}], got {tokens!r}")
    if phase == "prefill":
        raise SteeringSpecError(f, f"stop_when reads the gate of generated tokens: {CONDITION_FIELD}.phase must "
                                   "gate decode ('both' or 'decode')")
    return [above, tokens]


def _site(field: str, site: Any, shape: ModelShape) -> tuple[str, int]:
    """(hook, layer) of a site name enabled on this server; SteeringSpecError naming ``field``."""
    try:
        hook, layer = parse_site_name(site) if isinstance(site, str) else (None, None)
    except ValueError as e:
        raise SteeringSpecError(field, str(e)) from None
    if hook is None:
        raise SteeringSpecError(field, "expected a site name such as 'post_mlp.12'")
    if hook not in shape.hooks:
        raise SteeringSpecError(field, f"hook point {hook!r} is not enabled on this server "
                                       f"(steer.hooks={list(shape.hooks)})")
    return hook, check_layer(field, layer, shape)


def module_probe(raw: dict, probe_site: tuple[str, int], shape: ModelShape, modules: Any) -> np.ndarray:
    """The probe ``{"module": name, "site"?}``: the module's vector at ``site`` (default: the probe
    site), the same in every tier that has one there."""
    f = f"{CONDITION_FIELD}.probe"
    extra = sorted(set(raw) - _PROBE_KEYS)
    if extra:
        raise SteeringSpecError(f"{f}.{extra[0]}", f"unknown key (keys: {sorted(_PROBE_KEYS)})")
    name = raw.get("module")
    module = modules.get(name) if isinstance(name, str) else None
    if module is None:
        raise SteeringSpecError(f"{f}.module", f"unknown steering module {name!r}")
    hook, layer = _site(f"{f}.site", raw["site"], shape) if "site" in raw else probe_site
    found = [t[hook][layer] for t in module.tiers.values() if t and layer in t.get(hook, {})]
    if not found:
        raise SteeringSpecError(f"{f}.site" if "site" in raw else f"{f}.module",
                                f"module {name!r} has no vector at {hook}.{layer}")
    if any(not np.array_equal(v, found[0]) for v in found[1:]):
        raise SteeringSpecError(f"{f}.module", f"module {name!r} has different vectors at {hook}.{layer} in its "
                                               "phases: which one probes is ambiguous")
    return np.asarray(found[0], dtype=np.float32)


def module_condition(raw: Any, module: Any, shape: ModelShape, modules: Any, enabled: bool) -> dict:
    """A named module's own condition (``steering_condition`` in its registration): checked now
    against the module's vectors (a probe may name the module itself), kept as given, and applied to
    every request that names the module without a condition of its own."""
    if not enabled:
        raise SteeringSpecError(CONDITION_FIELD, "conditional steering is off on this server "
                                                 "(start it with steer.conditions: true)")
    wire, phase, _ = parse_condition(raw, shape, {**modules, module.name: module})
    if not wire[6] & GATES_VECTORS:
        raise SteeringSpecError(f"{CONDITION_FIELD}.applies_to",
                                "a module's condition gates its vectors: 'vectors' or 'both' (a request's own "
                                "condition may gate only SAE clamps)")
    tiers = ("steering_vectors",) + tuple(f"{p}_steering_vectors" for p in ("prefill", "decode") if phase in (p, "both"))
    sites = {(h, l) for t in tiers for h, ls in (module.tiers.get(t) or {}).items() for l in ls}
    check_sites(wire, sites, set(), set(), phase)
    return dict(raw)


def condition_summary(raw: dict | None) -> dict | None:
    """A module's condition as its listing shows it: an inline probe as its length, not its floats."""
    if raw is None:
        return None
    probe = raw["probe"]
    if isinstance(probe, dict) and "data" in probe:
        return {**raw, "probe": {"dtype": probe.get("dtype"), "packed": True}}
    return {**raw, "probe": dict(probe) if isinstance(probe, dict) else {"floats": len(probe)}}


def check_sites(wire: ConditionWire, sites: set[tuple[str, int]], clamp_sites: set[tuple[str, int]],
                sae_sites: set[tuple[str, int]], phase: str = "both",
                proj_sites: set[tuple[str, int]] = frozenset()) -> None:
    """What the condition gates (``sites``: its phases' vector sites, ``clamp_sites``: their SAE clamps'
    sites, ``proj_sites``: their projections' sites; each only if ``applies_to`` names it) exists and lies
    at or after the probe site, and the probe is not folded into a norm that applies an SAE (``sae_sites``:
    sites with an SAE or reserved for one; such norms read the gate, the probe's norm computes it)."""
    field = f"{CONDITION_FIELD}.site"
    gated = ((sites if wire[6] & GATES_VECTORS else set()) | (clamp_sites if wire[6] & GATES_SAE else set())
             | (proj_sites if wire[6] & GATES_PROJECTIONS else set()))
    if not gated:
        where = "" if phase == "both" else f" in its {phase} phase ({CONDITION_FIELD}.phase)"
        names = [n for n, bit in (("steering vectors", GATES_VECTORS), ("SAE clamps", GATES_SAE),
                                  ("projections", GATES_PROJECTIONS)) if wire[6] & bit]
        what = " or ".join(names)
        raise SteeringSpecError(CONDITION_FIELD, f"a condition scales {what} ({CONDITION_FIELD}.applies_to): the "
                                                 f"request has none{where}")
    probe = site_order(wire[0], wire[1])  # the probe site's position in the forward pass
    early = sorted((site_order(h, l), h, l) for h, l in gated if site_order(h, l) < probe)
    if early:
        _, h, l = early[0]
        raise SteeringSpecError(field, f"the request steers {h}.{l}, before the probe site {wire[0]}.{wire[1]}: "
                                       "there is no gate there yet (probe at or before every gated site)")
    if norm_partners(wire[0], wire[1]) & sae_sites:
        raise SteeringSpecError(field, f"the probe site {wire[0]}.{wire[1]} shares its norm with an SAE site: "
                                       "probe a site whose norm applies no SAE")


def norm_partners(hook: str, layer: int) -> set[tuple[str, int]]:
    """The sites folded into the same norm as ``hook.layer`` (``runtime.families``), itself included:
    post_mlp.L-1 and pre_attn.L share layer L's input norm."""
    if hook == "post_mlp":
        return {(hook, layer), ("pre_attn", layer + 1)}
    if hook == "pre_attn" and layer > 0:
        return {(hook, layer), ("post_mlp", layer - 1)}
    return {(hook, layer)}


def condition_key(vector_key: str, wire: ConditionWire) -> str:
    """The key of a phase's vectors (``vector_key``) under a condition."""
    h = blake3(_DOMAIN + vector_key.encode() + b"\0")
    h.update(f"{wire[0]}\0{wire[1]}\0{int(wire[4])}\0{int(wire[6])}\0".encode())
    h.update(np.asarray(wire[2:4], dtype="<f8").tobytes() + wire[5])
    return h.hexdigest()[:32]


assert HOOK_NAMES == ("pre_attn", "post_attn", "post_mlp")  # norm_partners and site_order rely on it
