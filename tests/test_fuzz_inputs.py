"""Generated malformed inputs against the running server (the shared SmolLM2 API server): every
target (completions, chat, ``vllm_xargs``, module registration as JSON and as files, SAE registration
by path) × every field ×
a set of corruptions. Each must be a 4xx whose error names the field; after each batch a known steered
and a known unsteered request still give their baseline tokens, and the server never restarted."""

from __future__ import annotations

import base64
import json
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from tests.conftest import API_KEY, MODULE_CAP, SAE_SLOT
from vllm_steer.client import pack

HIDDEN, LAYER, N_LAYERS = 576, 14, 30
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD_VEC = (np.sin(np.arange(HIDDEN)) * 40).astype(np.float32)
TIERS = ("steering_vectors", "prefill_steering_vectors", "decode_steering_vectors")
Case = tuple[str, dict, str]  # (id, steering fields, field the error must name)


def _packed(**over: Any) -> dict:
    return {**pack(GOOD_VEC[None], [LAYER]), **over}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _tier_cases(tier: str) -> Iterator[Case]:
    f = tier
    for bad in ([], "vectors", 5, True, [1.0] * HIDDEN):
        yield f"{tier}:type:{bad!r}"[:60], {tier: bad}, f
    for hook in ("mid_mlp", "", "POST_MLP", "post_mlp "):
        yield f"{tier}:hook:{hook!r}", {tier: {hook: {str(LAYER): GOOD_VEC.tolist()}}}, f"{f}.{hook}"
    for bad in ([1.0] * HIDDEN, "x", 3, 7.5):
        yield f"{tier}:hookval:{type(bad).__name__}", {tier: {"post_mlp": bad}}, f"{f}.post_mlp"
    h = f"{f}.post_mlp"
    for layer in ("-1", str(N_LAYERS), "99", "1.5", "abc", "", " 3", "1e1"):
        yield f"{tier}:layer:{layer!r}", {tier: {"post_mlp": {layer: GOOD_VEC.tolist()}}}, f"{h}.{layer}"
    for name, vals in (("short", [0.0] * 7), ("long", [0.0] * (HIDDEN + 1)), ("empty", []),
                       ("strings", ["a"] * HIDDEN), ("nested", [[0.0]] * HIDDEN), ("null", [None] * HIDDEN),
                       ("overflow", [1e400] * HIDDEN), ("mixed", [0.0] * (HIDDEN - 1) + ["x"]),
                       ("object", {"a": 1}), ("number", 3.0)):
        yield f"{tier}:values:{name}", {tier: {"post_mlp": {str(LAYER): vals}}}, f"{h}.{LAYER}"
    for name, over, field in (
        ("dtype-int8", {"dtype": "int8"}, "dtype"), ("dtype-num", {"dtype": 5}, "dtype"),
        ("dtype-null", {"dtype": None}, "dtype"), ("dtype-empty", {"dtype": ""}, "dtype"),
        ("shape-1d", {"shape": [HIDDEN]}, "shape"), ("shape-3d", {"shape": [1, 1, HIDDEN]}, "shape"),
        ("shape-str", {"shape": "1x576"}, "shape"), ("shape-neg", {"shape": [-1, HIDDEN]}, "shape"),
        ("shape-hidden", {"shape": [1, HIDDEN + 1]}, "shape"), ("shape-float", {"shape": [1.0, HIDDEN]}, "shape"),
        ("shape-bool", {"shape": [True, HIDDEN]}, "shape"), ("shape-null", {"shape": None}, "shape"),
        ("idx-len", {"layer_indices": [1, 2]}, "layer_indices"), ("idx-neg", {"layer_indices": [-1]}, "layer_indices"),
        ("idx-range", {"layer_indices": [N_LAYERS]}, "layer_indices"),
        ("idx-float", {"layer_indices": [1.5]}, "layer_indices"), ("idx-str", {"layer_indices": ["x"]}, "layer_indices"),
        ("idx-null", {"layer_indices": None}, "layer_indices"), ("idx-obj", {"layer_indices": {"0": 1}}, "layer_indices"),
        ("data-b64", {"data": "not base64!"}, "data"), ("data-num", {"data": 5}, "data"),
        ("data-list", {"data": [1, 2]}, "data"), ("data-empty", {"data": ""}, "data"),
        ("data-short", {"data": _b64(b"\0" * 10)}, "data"), ("data-long", {"data": _b64(b"\0" * (4 * HIDDEN + 4))}, "data"),
        ("data-nan", {"data": _b64(np.full(HIDDEN, np.nan, np.float32).tobytes())}, "data"),
        ("data-inf", {"data": _b64(np.full(HIDDEN, np.inf, np.float32).tobytes())}, "data"),
        ("data-null", {"data": None}, "data"),
        ("scales-len", {"scales": [1.0, 2.0]}, "scales"), ("scales-str", {"scales": ["a"]}, "scales"),
        ("scales-inf", {"scales": [1e400]}, "scales"), ("scales-type", {"scales": "x"}, "scales"),
        ("scales-nested", {"scales": [[1.0]]}, "scales"),
    ):
        yield f"{tier}:packed:{name}", {tier: {"post_mlp": _packed(**over)}}, f"{h}.{field}"
    dup = pack(np.stack([GOOD_VEC, GOOD_VEC]), [LAYER, LAYER])
    yield f"{tier}:packed:idx-dup", {tier: {"post_mlp": dup}}, f"{h}.layer_indices"
    big = pack(np.ones((25, HIDDEN), np.float32), list(range(25)))
    yield f"{tier}:packed:over-cap", {tier: {"post_mlp": big}}, f"{h}.data"
    # (after the cases above: module_cases takes every third, and a request over its cap is a module under its own)
    for name, over in (("norm-str", {"norm": "a"}), ("norm-inf", {"norm": 1e400}), ("norm-list", {"norm": [0.1]}),
                       ("norm-and-scales", {"norm": 0.1, "scales": [1.0]})):
        yield f"{tier}:packed:{name}", {tier: {"post_mlp": _packed(**over)}}, f"{h}.norm"
    # the shared server's steer.site_norms holds post_mlp sites only
    yield f"{tier}:norm:no-site-norm", {tier: {"pre_attn": {"norm": 0.1, str(LAYER): GOOD_VEC.tolist()}}}, f"{f}.pre_attn.norm"
    yield f"{tier}:norm:bool", {tier: {"post_mlp": {"norm": True, str(LAYER): GOOD_VEC.tolist()}}}, f"{h}.norm"


def _other_cases() -> Iterator[Case]:
    m = "steering_module"
    for name, bad, field in (("int", 5, m), ("list", [], m), ("name-int", {"name": 5}, m),
                             ("scale-str", {"name": "preloaded", "scale": "a"}, f"{m}.scale"),
                             ("scale-inf", {"name": "preloaded", "scale": 1e400}, f"{m}.scale"),
                             ("scale-bool", {"name": "preloaded", "scale": True}, f"{m}.scale"),
                             ("norm-str", {"name": "preloaded", "norm": "a"}, f"{m}.norm"),
                             ("norm-and-scale", {"name": "preloaded", "norm": 0.1, "scale": 2}, f"{m}.norm"),
                             ("extra", {"name": "preloaded", "boost": 1}, m),
                             ("unknown", {"name": "no-such-module"}, f"{m}.name"),
                             ("unknown-str", "no-such-module", f"{m}.name"),
                             ("layers-range", {"name": "preloaded", "layers": "0-99"}, f"{m}.layers"),
                             ("layers-text", {"name": "preloaded", "layers": "five"}, f"{m}.layers"),
                             ("layers-neg", {"name": "preloaded", "layers": [-1]}, f"{m}.layers"),
                             ("layers-float", {"name": "preloaded", "layers": [1.5]}, f"{m}.layers"),
                             ("layers-empty", {"name": "preloaded", "layers": []}, f"{m}.layers"),
                             ("layers-none-held", {"name": "preloaded", "layers": [0]}, f"{m}.layers"),
                             ("hooks-str", {"name": "preloaded", "hooks": "post_mlp"}, f"{m}.hooks"),
                             ("hooks-unknown", {"name": "preloaded", "hooks": ["mid"]}, f"{m}.hooks"),
                             ("hooks-none-held", {"name": "preloaded", "hooks": ["pre_attn"]}, f"{m}.hooks")):
        yield f"module:{name}", {m: bad}, field
    c = "capture"
    for name, bad, field in (("int", 5, c), ("list", [], c), ("empty", {}, c), ("instance", {"nope": {}}, f"{c}.nope"),
                             ("spec-int", {"fs": 5}, f"{c}.fs"), ("layers", {"fs": {"layers": [99]}}, f"{c}.fs"),
                             ("hooks", {"fs": {"hooks": ["mid"]}}, f"{c}.fs"),
                             ("positions", {"fs": {"positions": "sometimes"}}, f"{c}.fs"),
                             ("extra", {"fs": {"colour": "red"}}, f"{c}.fs")):
        yield f"capture:{name}", {c: bad}, field


def _sae_cases() -> Iterator[Case]:
    s, ok = "sae", {"feature": 3, "kind": "set", "value": 5.0}
    for name, bad, field in (("int", 5, s), ("str", "fz", s), ("empty-list", [], s), ("bool", True, s),
                             ("name-int", {"name": 5, "clamps": [ok]}, f"{s}.name"),
                             ("name-unknown", {"name": "nope", "clamps": [ok]}, f"{s}.name"),
                             ("extra", {"name": "fz", "clamps": [ok], "colour": 1}, s),
                             ("mode", {"name": "fz", "mode": "both", "clamps": [ok]}, f"{s}.mode"),
                             ("mode-int", {"name": "fz", "mode": 1, "clamps": [ok]}, f"{s}.mode"),
                             ("mode-reconstruct", {"name": "fz", "mode": "reconstruct"}, f"{s}.mode"),
                             ("phase", {"name": "fz", "phase": "always", "clamps": [ok]}, f"{s}.phase"),
                             ("site", {"name": "fz", "site": "post_mlp.3", "clamps": [ok]}, f"{s}.site"),
                             ("site-bad", {"name": "fz", "site": "x", "clamps": [ok]}, f"{s}.site"),
                             ("site-int", {"name": "fz", "site": 12, "clamps": [ok]}, f"{s}.site"),
                             ("no-clamps", {"name": "fz"}, f"{s}.clamps"),
                             ("clamps-int", {"name": "fz", "clamps": 5}, f"{s}.clamps"),
                             ("clamps-many", {"name": "fz", "clamps": [{**ok, "feature": i} for i in range(40)]},
                              f"{s}.clamps"),
                             ("list-second", [{"name": "fz", "clamps": [ok]}, {"name": "fz", "clamps": 5}],
                              f"{s}[1].clamps"),
                             ("list-same-site", [{"name": "fz", "clamps": [ok]}, {"name": "fz", "clamps": [ok]}],
                              f"{s}[1]"),
                             ("features-int", {"features": 5}, f"{s}.features"),
                             ("features-extra", {"features": [], "clamps": [ok]}, s),
                             ("feature-str", {"features": ["x"]}, f"{s}.features[0]"),
                             ("feature-sae", {"features": [{"sae": 1, "index": 3, "strength": 1.0}]}, f"{s}.features[0].sae"),
                             ("feature-index", {"features": [{"sae": "fz", "index": "3", "strength": 1.0}]},
                              f"{s}.features[0].index"),
                             ("feature-strength", {"features": [{"sae": "fz", "index": 3, "strength": 1e400}]},
                              f"{s}.features[0].strength"),
                             ("feature-site", {"features": [{"sae": "fz", "index": 3, "strength": 1.0, "site": "x"}]},
                              f"{s}.features[0].site"),
                             ("feature-phase", {"features": [{"sae": "fz", "index": 3, "strength": 1.0}], "phase": "x"},
                              f"{s}.phase")):
        yield f"sae:{name}", {s: bad}, field
    c = f"{s}.clamps[0]"
    for name, clamp, field in (("str", "x", c), ("extra", {**ok, "boost": 1}, c),
                               ("feature-str", {**ok, "feature": "3"}, f"{c}.feature"),
                               ("feature-float", {**ok, "feature": 3.0}, f"{c}.feature"),
                               ("feature-neg", {**ok, "feature": -1}, f"{c}.feature"),
                               ("feature-unclampable", {**ok, "feature": 40}, f"{c}.feature"),
                               ("feature-range", {**ok, "feature": 10**6}, f"{c}.feature"),
                               ("feature-null", {**ok, "feature": None}, f"{c}.feature"),
                               ("kind", {**ok, "kind": "mul"}, f"{c}.kind"), ("kind-int", {**ok, "kind": 1}, f"{c}.kind"),
                               ("value-str", {**ok, "value": "a"}, f"{c}.value"),
                               ("value-inf", {**ok, "value": 1e400}, f"{c}.value"),
                               ("value-null", {**ok, "value": None}, f"{c}.value"),
                               ("value-bool", {**ok, "value": True}, f"{c}.value"),
                               ("only", {**ok, "only_if_active": "yes"}, f"{c}.only_if_active"),
                               ("only-int", {**ok, "only_if_active": 1}, f"{c}.only_if_active")):
        yield f"sae:clamp:{name}", {s: {"name": "fz", "clamps": [clamp]}}, field
    yield "sae:clamp:dup", {s: {"name": "fz", "clamps": [ok, ok]}}, f"{s}.clamps[1].feature"


def _condition_cases() -> Iterator[Case]:
    f, vec = "steering_condition", {"steering_vectors": {"post_mlp": {str(LAYER): GOOD_VEC.tolist()}}}
    ok = {"site": "post_mlp.10", "probe": GOOD_VEC.tolist()}
    for name, bad, field in (("int", 5, f), ("list", [], f), ("str", "post_mlp.10", f),
                             ("no-site", {"probe": ok["probe"]}, f"{f}.site"), ("site-int", {**ok, "site": 10}, f"{f}.site"),
                             ("site-bad", {**ok, "site": "x"}, f"{f}.site"), ("site-hook", {**ok, "site": "mid.3"}, f"{f}.site"),
                             ("site-range", {**ok, "site": "post_mlp.99"}, f"{f}.site"),
                             ("site-late", {**ok, "site": "post_mlp.20"}, f"{f}.site"),
                             ("no-probe", {"site": "post_mlp.10"}, f"{f}.probe"),
                             ("probe-short", {**ok, "probe": [1.0] * 7}, f"{f}.probe"),
                             ("probe-str", {**ok, "probe": "x"}, f"{f}.probe"),
                             ("probe-inf", {**ok, "probe": [1e400] * HIDDEN}, f"{f}.probe"),
                             ("probe-module", {**ok, "probe": {"module": "no-such-module"}}, f"{f}.probe.module"),
                             ("probe-packed-dtype", {**ok, "probe": {"dtype": "x", "data": ""}}, f"{f}.probe.dtype"),
                             ("probe-packed-short", {**ok, "probe": {"dtype": "float32", "data": "AAAA"}},
                              f"{f}.probe.data"),
                             ("probe-packed-str", {**ok, "probe": {"dtype": "float32", "data": 5}}, f"{f}.probe.data"),
                             ("probe-module-site", {**ok, "probe": {"module": "preloaded"}}, f"{f}.probe.module"),
                             ("probe-extra", {**ok, "probe": {"module": "preloaded", "scale": 2}}, f"{f}.probe.scale"),
                             ("threshold", {**ok, "threshold": "a"}, f"{f}.threshold"),
                             ("threshold-inf", {**ok, "threshold": 1e400}, f"{f}.threshold"),
                             ("sharpness", {**ok, "sharpness": 0}, f"{f}.sharpness"),
                             ("sharpness-str", {**ok, "sharpness": "x"}, f"{f}.sharpness"),
                             ("mode", {**ok, "mode": 1}, f"{f}.mode"), ("phase", {**ok, "phase": "x"}, f"{f}.phase"),
                             ("extra", {**ok, "colour": "red"}, f"{f}.colour"),
                             ("stop-num", {**ok, "stop_when": 0.5}, f"{f}.stop_when"),
                             ("stop-no-above", {**ok, "stop_when": {"tokens": 2}}, f"{f}.stop_when.above"),
                             ("stop-above", {**ok, "stop_when": {"above": 1.5}}, f"{f}.stop_when.above"),
                             ("stop-above-nan", {**ok, "stop_when": {"above": float("nan")}}, f"{f}.stop_when.above"),
                             ("stop-tokens", {**ok, "stop_when": {"above": 0.5, "tokens": -1}}, f"{f}.stop_when.tokens"),
                             ("stop-tokens-big", {**ok, "stop_when": {"above": 0.5, "tokens": 10**9}},
                              f"{f}.stop_when.tokens"),
                             ("stop-tokens-float", {**ok, "stop_when": {"above": 0.5, "tokens": 2.0}},
                              f"{f}.stop_when.tokens"),
                             ("stop-extra", {**ok, "stop_when": {"above": 0.5, "n": 2}}, f"{f}.stop_when.n"),
                             ("stop-prefill", {**ok, "phase": "prefill", "stop_when": {"above": 0.5}}, f"{f}.stop_when")):
        yield f"condition:{name}", {**vec, f: bad}, field
    yield "condition:no-vectors", {f: ok}, f
    clamps = {"sae": {"name": "fz", "clamps": [{"feature": 3, "value": 1.0}]}}  # fz: post_mlp.12
    yield "condition:applies-to", {**vec, f: {**ok, "applies_to": "all"}}, f"{f}.applies_to"
    yield "condition:applies-to-list", {**vec, f: {**ok, "applies_to": ["vectors", "x"]}}, f"{f}.applies_to"
    yield "condition:applies-to-projections-none", {**vec, f: {**ok, "applies_to": "projections"}}, f
    yield "condition:applies-to-sae-none", {**vec, f: {**ok, "applies_to": "sae"}}, f
    yield ("condition:sae-before-probe", {**vec, **clamps, f: {**ok, "site": "post_mlp.13", "applies_to": "sae"}},
           f"{f}.site")
    yield "condition:probe-beside-sae", {**vec, **clamps, f: {**ok, "site": "pre_attn.13"}}, f"{f}.site"


def _projection_cases() -> Iterator[Case]:
    """Each projection field (the shared server runs steer.max_projections 2): every corruption of the base
    field, a few of each phase's (they share the parser)."""
    ab = {"direction": GOOD_VEC.tolist(), "mode": "ablate"}
    for f in ("steering_projections", "prefill_steering_projections", "decode_steering_projections"):
        site = f"{f}.post_mlp.{LAYER}"
        for name, bad, field in (
                ("type", [ab], f), ("hook", {"mid": {str(LAYER): [ab]}}, f"{f}.mid"),
                ("hookval", {"post_mlp": [ab]}, f"{f}.post_mlp"),
                ("layer", {"post_mlp": {"99": [ab]}}, f"{f}.post_mlp.99"),
                ("site-bad", {"post_mlp.x": [ab]}, f"{f}.post_mlp.x"), ("pre-attn-0", {"pre_attn.0": [ab]}, f"{f}.pre_attn.0"),
                ("ops-empty", {"post_mlp": {str(LAYER): []}}, site), ("ops-obj", {"post_mlp": {str(LAYER): ab}}, site),
                ("too-many", {"post_mlp": {str(LAYER): [ab] * 3}}, site),
                ("op-int", {"post_mlp": {str(LAYER): [5]}}, f"{site}[0]"),
                ("mode", {"post_mlp": {str(LAYER): [{**ab, "mode": "erase"}]}}, f"{site}[0].mode"),
                ("no-dir", {"post_mlp": {str(LAYER): [{"mode": "ablate"}]}}, f"{site}[0].direction"),
                ("dir-zero", {"post_mlp": {str(LAYER): [{**ab, "direction": [0.0] * HIDDEN}]}}, f"{site}[0].direction"),
                ("dir-short", {"post_mlp": {str(LAYER): [{**ab, "direction": [1.0] * 7}]}}, f"{site}[0].direction"),
                ("dir-inf", {"post_mlp": {str(LAYER): [{**ab, "direction": [1e400] * HIDDEN}]}}, f"{site}[0].direction"),
                ("dir-packed", {"post_mlp": {str(LAYER): [{**ab, "direction": {"dtype": "float32", "data": "AAAA"}}]}},
                 f"{site}[0].direction.data"),
                ("ablate-max", {"post_mlp": {str(LAYER): [{**ab, "max": 1.0}]}}, f"{site}[0].max"),
                ("cap-none", {"post_mlp": {str(LAYER): [{**ab, "mode": "cap"}]}}, f"{site}[0]"),
                ("cap-order", {"post_mlp": {str(LAYER): [{**ab, "mode": "cap", "min": 2, "max": 1}]}}, f"{site}[0].min"),
                ("cap-str", {"post_mlp": {str(LAYER): [{**ab, "mode": "cap", "max": "1"}]}}, f"{site}[0].max"),
                ("cap-inf", {"post_mlp": {str(LAYER): [{**ab, "mode": "cap", "min": 1e400}]}}, f"{site}[0].min")):
            if f == "steering_projections" or name in ("type", "too-many", "dir-zero", "cap-order"):
                yield f"proj:{f}:{name}", {f: bad}, field
    yield ("proj:over-max-with-base", {"steering_projections": {f"post_mlp.{LAYER}": [ab, ab]},
                                       "decode_steering_projections": {f"post_mlp.{LAYER}": [ab]}},
           f"decode_steering_projections.post_mlp.{LAYER}")


def completion_cases() -> list[Case]:
    return ([c for t in TIERS for c in _tier_cases(t)] + list(_other_cases()) + list(_sae_cases())
            + list(_condition_cases()) + list(_projection_cases()))


def _xargs(fields: dict) -> dict:
    return {"vllm_xargs": {k: json.dumps(v, allow_nan=True) for k, v in fields.items()}}


def module_cases() -> Iterator[tuple[str, dict | None, dict | None, str]]:
    """(id, JSON body or None, multipart dict or None, field)."""
    vec = {"steering_vectors": {"post_mlp": {str(LAYER): GOOD_VEC.tolist()}}}
    for name in ("a/b", "../x", "a\\b", "a\x00b", "a\nb", "x" * 10_000, "", " lead", "é", "hidden/"):
        yield f"mod:name:{name[:12]!r}", {"name": name, **vec}, None, "name"
    for bad in (5, None, [], {"n": 1}):
        yield f"mod:nametype:{bad!r}", {"name": bad, **vec}, None, "name"
    for tid, fields, field in [c for c in _tier_cases("steering_vectors")][::3]:
        yield f"mod:{tid}", {"name": "fz", **fields}, None, field
    yield "mod:no-vectors", {"name": "fz"}, None, "steering_vectors"
    yield "mod:description", {"name": "fz", **vec, "description": 5}, None, "description"
    yield "mod:replace", {"name": "fz", **vec, "replace": "perhaps"}, None, "replace"
    yield "mod:replace-num", {"name": "fz", **vec, "replace": 2}, None, "replace"
    for tid, fields, field in _condition_cases():
        if "sae" not in fields and "steering_vectors" in fields:
            yield f"mod:{tid}", {"name": "fz", **fields}, None, field
    hooks = ("pre_attn", "post_attn", "post_mlp")  # 3 hooks x 30 layers: 207,360 bytes > MODULE_CAP
    rows = pack(np.tile(GOOD_VEC, (N_LAYERS, 1)), list(range(N_LAYERS)))
    yield "mod:over-module-cap", {"name": "fz", "steering_vectors": {h: rows for h in hooks}}, None, "steering_vectors"
    yield ("mod:file:over-module-cap", None,
           {"file": ("v.safetensors", save({f"{h}.{l}": GOOD_VEC for h in hooks for l in range(N_LAYERS)}))}, "file")
    yield "mod:file:over-body-cap", None, {"file": ("v.safetensors", b"\0" * (2 * MODULE_CAP + (1 << 20) + 1))}, "file"
    st = save({"post_mlp.3": GOOD_VEC})
    for fname, payload in (("v.safetensors", st[: len(st) // 2]), ("v.safetensors", st[:8]),
                           ("v.safetensors", b"\xff" * 64), ("v.gguf", st), ("v.gguf", b"GGUF\x03\0\0\0" + b"\xff" * 40),
                           ("v.json", st), ("v.safetensors", b""), ("v", b"{}"),
                           ("v.safetensors", save({"post_mlp.x": GOOD_VEC})),
                           ("v.safetensors", save({"post_mlp.99": GOOD_VEC})),
                           ("v.safetensors", save({"post_mlp.3": np.stack([GOOD_VEC, GOOD_VEC])}))):
        yield f"mod:file:{fname}:{len(payload)}", None, {"file": (fname, payload)}, "file"


def sae_cases(root) -> Iterator[tuple[str, dict, str]]:
    """(id, POST /v1/steering/sae body, field): paths outside ``root`` (steer.sae_root) and malformed
    files inside it; none may be a 5xx, none may echo the files' bytes."""
    import os
    import struct

    from tests.sae_writers import random_sae, write_gemma_scope, write_json, write_manifest, write_sae_lens

    good = {"name": "fz-sae", "site": SAE_SLOT, "features": [1, 2]}
    d = root / "fuzz"
    for p in ("", "relative/dir", "/", "/dev/zero", "/dev/null", "/proc/self/environ", "/etc/passwd", "a\x00b",
              str(root / "nowhere"), str(root / ".." / ".."), str(root) + "/../" + "x" * 5000, "/" + "x/" * 3000):
        yield f"sae:path:{p[:16]!r}", {**good, "path": p}, "path"
    for bad in (5, None, [], {"a": 1}, True):
        yield f"sae:pathtype:{bad!r}", {**good, "path": bad}, "path"
    if not d.exists():
        gs = write_gemma_scope(str(d / "gs"), random_sae(HIDDEN, 16, "jumprelu", seed=1))
        npz = os.path.join(gs, "params.npz")
        for name, cut in (("half", 2), ("head", 50)):
            os.makedirs(d / name)
            (d / name / "params.npz").write_bytes(open(npz, "rb").read()[: os.path.getsize(npz) // cut])
        os.makedirs(d / "junk")
        (d / "junk" / "params.npz").write_bytes(b"SECRET" * 100)
        write_gemma_scope(str(d / "small"), random_sae(64, 16, "jumprelu", seed=1))  # d_model != the model's
        write_sae_lens(str(d / "lens"), random_sae(HIDDEN, 16, "relu", seed=1), hook_name="blocks.8.hook_resid_post")
        (d / "lens" / "sae_weights.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b'{"SECRET": 1}')
        write_sae_lens(str(d / "cfg"), random_sae(HIDDEN, 16, "relu", seed=1), hook_name="blocks.8.hook_resid_post")
        (d / "cfg" / "cfg.json").write_bytes(b'{"SECRET": \xff' + b"SECRET" * 50)
        write_manifest(str(d / "man"), {SAE_SLOT: random_sae(HIDDEN, 16, "relu", seed=1)}, "relu")
        write_json(str(d / "man" / "manifest.json"), {"format": "vllm-steer-sae", "version": 1, "activation": "relu",
                                                      "sites": {SAE_SLOT: "../../../../../../etc/passwd"}})
    for name in ("half", "head", "junk", "small", "lens", "cfg"):
        yield f"sae:file:{name}", {**good, "path": str(d / name)}, "path"
    yield "sae:file:man", {"name": "fz-sae", "features": [1, 2], "path": str(d / "man")}, "path"  # lists its site


def _error_names(r: httpx.Response, field: str, xargs: bool = False) -> bool:
    """The error names the field (in ``param`` or the message); inside ``vllm_xargs`` a JSON string
    the server cannot read (Infinity, NaN) is named by its entry, ``vllm_xargs.<field>``."""
    try:
        err = r.json()["error"]
    except Exception:  # noqa: BLE001
        return False
    param, msg = str(err.get("param") or ""), str(err.get("message") or "")
    names = [field] + ([f"vllm_xargs.{field.split('.')[0]}"] if xargs else [])
    return any(f in msg or param == f or param.endswith(f) or param.startswith(f) for f in names)


def _baseline(base: str, model: str) -> tuple[str, str]:
    def text(body: dict) -> str:
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    return text({}), text({"steering_vectors": {"post_mlp": {str(LAYER): GOOD_VEC.tolist()}}})


def _engine_pid(base: str) -> int:
    return httpx.get(f"{base}/v1/steering", timeout=30).json()["workers"][0]["pid"]


@pytest.fixture(scope="module")
def live(api_server):
    base, model = api_server[0], api_server[1]
    return base, model, _baseline(base, model), _engine_pid(base)


def _check_still_serving(live) -> None:
    base, model, baseline, pid = live
    assert _baseline(base, model) == baseline, "a known request's tokens changed after the batch"
    assert baseline[0] != baseline[1]
    assert _engine_pid(base) == pid, "the engine restarted"


@pytest.mark.parametrize("target", ["completions", "chat", "vllm_xargs"])
def test_every_malformed_steering_field_is_a_4xx_naming_it(live, target):
    base, model = live[0], live[1]
    cases = completion_cases()
    failures = []
    with httpx.Client(timeout=120) as client:
        for cid, fields, field in cases:
            if target == "completions":
                url, body = "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2, **fields}
            elif target == "chat":
                url, body = "/v1/chat/completions", {"model": model, "max_tokens": 2, **fields,
                                                     "messages": [{"role": "user", "content": "Hi"}]}
            else:
                url, body = "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2, **_xargs(fields)}
            raw = json.dumps(body, allow_nan=True).encode()
            r = client.post(base + url, content=raw, headers={"content-type": "application/json"})
            if not (400 <= r.status_code < 500 and _error_names(r, field, xargs=target == "vllm_xargs")):
                failures.append(f"{cid}: HTTP {r.status_code} (want 4xx naming {field!r}): {r.text[:200]}")
    assert len(cases) >= 100
    assert not failures, f"{len(failures)} of {len(cases)}:\n" + "\n".join(failures)
    _check_still_serving(live)


def test_every_malformed_module_registration_is_a_4xx_naming_it(live):
    base = live[0]
    failures, n = [], 0
    with httpx.Client(timeout=120) as client:
        for cid, body, files, field in module_cases():
            n += 1
            if files is not None:
                r = client.post(f"{base}/v1/steering/modules", files=files, data={"name": "fz-file"}, headers=AUTH)
            else:
                r = client.post(f"{base}/v1/steering/modules", content=json.dumps(body, allow_nan=True).encode(),
                                headers={**AUTH, "content-type": "application/json"})
            if not (400 <= r.status_code < 500 and _error_names(r, field)):
                failures.append(f"{cid}: HTTP {r.status_code} (want 4xx naming {field!r}): {r.text[:200]}")
    assert n >= 40
    assert not failures, f"{len(failures)} of {n}:\n" + "\n".join(failures)
    assert "fz" not in [m["name"] for m in httpx.get(f"{base}/v1/steering/modules", timeout=30).json()["data"]]
    _check_still_serving(live)


def test_every_malformed_sae_registration_is_a_4xx_naming_it(live, sae_root):
    """Paths outside steer.sae_root are one 403; malformed files inside it a 400 naming ``path``; no
    message carries the files' bytes."""
    base = live[0]
    failures, n = [], 0
    with httpx.Client(timeout=120) as client:
        for cid, body, field in sae_cases(sae_root):
            n += 1
            r = client.post(f"{base}/v1/steering/sae", json=body, headers=AUTH)
            if not (400 <= r.status_code < 500 and _error_names(r, field)) or "SECRET" in r.text:
                failures.append(f"{cid}: HTTP {r.status_code} (want 4xx naming {field!r}): {r.text[:200]}")
    assert n >= 20
    assert not failures, f"{len(failures)} of {n}:\n" + "\n".join(failures)
    assert "fz-sae" not in [s["name"] for s in httpx.get(f"{base}/v1/steering/sae", timeout=30).json()["data"]]
    _check_still_serving(live)
