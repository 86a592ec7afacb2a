"""The A/B arms (server + kind of traffic), their request bodies and steering configs.

Kinds: ``plain`` (no steering field), ``module`` (a registered steering module by name),
``shared`` (one steering_vectors config for every request), ``per_request`` (n distinct configs),
``sae`` (SAE clamp sets); single-site kinds (one steered site, ``post_mlp`` of --site-layer, the 16
vectors of site_vectors.py): ``site_module`` (request i names module ``ab_site_{i%16}``, registered
once per server), ``site_inline`` (request i carries vector i%16 inline), ``hotwire`` (request i names
id ``v{i%16}`` in ``vllm_xargs`` on the hotwire server: hotwire responses carry no steering field, so
the field check treats it like ``plain``).
"""

from __future__ import annotations

import hashlib
import json

from .client import http_json
from .common import log
from .servers import MULTI_SUFFIX, PEER_SERVER, server_unavailable
from .site_vectors import ctx_site, hotwire_field, module_name, steer_vectors

HOOKS = ("pre_attn", "post_attn", "post_mlp")
MODULE_NAME = "ab_bench_module"
UNMARKED_KINDS = ("plain", "hotwire")  # responses carry no steering field
MODULE_KINDS = ("module", "site_module")  # requests name registered modules

ARMS = {
    "stock": dict(server="stock", kind="plain"),
    "disabled": dict(server="disabled", kind="plain"),
    "enabled_idle": dict(server="steer", kind="plain"),
    "enabled_idle_one": dict(server="steer_one", kind="plain"),  # ablation: one steered norm, every patch on
    "named_shared": dict(server="steer", kind="module"),
    "all_steered_shared": dict(server="steer", kind="shared"),
    "per_request_n4": dict(server="steer", kind="per_request", n_configs=4),
    "per_request_n16": dict(server="steer", kind="per_request", n_configs=16),
    # the wide load: 256 requests at concurrency 256
    "stock_c256": dict(server="stock", kind="plain", wide=True),
    "disabled_c256": dict(server="disabled", kind="plain", wide=True),
    "k256": dict(server="steer", kind="per_request", n_configs=None, wide=True),  # --wide distinct configs
    # the binary wire form: msgpack bodies with raw vector bytes (no base64, no JSON parse of vectors)
    "per_request_n16_msgpack": dict(server="steer", kind="per_request", n_configs=16, wire="msgpack"),
    "k256_msgpack": dict(server="steer", kind="per_request", n_configs=None, wide=True, wire="msgpack"),
    # SAE clamping (abkit/sae_files.py): 16 distinct clamp sets of 64 features at 4 layers
    "sae_idle": dict(server="sae", kind="plain"),
    "sae_delta_n16": dict(server="sae", kind="sae", mode="delta", n_configs=16),
    "sae_serial_idle": dict(server="sae_serial", kind="plain"),
    "sae_serial_delta_n16": dict(server="sae_serial", kind="sae", mode="delta", n_configs=16),
    "sae_full_idle": dict(server="sae_full", kind="plain"),
    "sae_reconstruct_n16": dict(server="sae_full", kind="sae", mode="reconstruct", n_configs=16),
    # single-site work (site_vectors.py): the peer plugin hotwire, vllm-steer by module name and inline
    "hotwire_idle": dict(server=PEER_SERVER, kind="plain"),
    "hotwire_ids16": dict(server=PEER_SERVER, kind="hotwire", n_configs=16),
    "site_named16": dict(server="steer", kind="site_module", n_configs=16),
    "site_inline16": dict(server="steer", kind="site_inline", n_configs=16),
    # the same work with the vectors scaled by 1e-4: every piece of steering runs, but the generated
    # tokens stay (nearly) those of stock, so output-dependent costs (detokenizing other tokens) drop out
    "hotwire_ids16_tiny": dict(server=PEER_SERVER, kind="hotwire", n_configs=16, scale=1e-4),
    "site_named16_tiny": dict(server="steer", kind="site_module", n_configs=16, scale=1e-4),
    "site_inline16_tiny": dict(server="steer", kind="site_inline", n_configs=16, scale=1e-4),
    # conditional steering (steer.conditions): every hook of layers 1.. (at or after the probe at
    # pre_attn.1), 16 configs; with a soft condition each, and the same vectors without one
    "cond_idle": dict(server="steer_cond", kind="plain"),
    "cond_n16": dict(server="steer_cond", kind="cond", n_configs=16, condition=True),
    "cond_off_n16": dict(server="steer_cond", kind="cond", n_configs=16, condition=False),
}
for _arm in [a for a, v in ARMS.items() if v["server"] == "steer"]:
    ARMS[f"{_arm}{MULTI_SUFFIX}"] = {**ARMS[_arm], "server": "steer" + MULTI_SUFFIX}
for _arm in ("stock", "stock_c256"):
    ARMS[f"{_arm}{MULTI_SUFFIX}"] = {**ARMS[_arm], "server": "stock" + MULTI_SUFFIX}
AB_ARMS = ["stock", "disabled", "enabled_idle", "named_shared", "all_steered_shared", "per_request_n4",
           "per_request_n16", "stock_c256", "disabled_c256", "k256"]
LONG_ARMS = ["stock", "per_request_n16"]  # run at --long-max-tokens in the ab phase


def usable_arms(names: list[str], args, what: str) -> list[str]:
    """The arms of ``names`` whose server can run here; the others are skipped with a log line."""
    out = []
    for a in names:
        if a not in ARMS:
            raise SystemExit(f"unknown arm {a!r} in {what} (known: {', '.join(ARMS)})")
        why = server_unavailable(ARMS[a]["server"], args)
        if why:
            log(f"[{what}] skipping arm {a}: {why}")
            continue
        out.append(a)
    return out


def steering_configs(n: int, seed: int, shape: dict, std: float, pack_dtype: str, binary: bool = False,
                     first_layer: int = 0) -> list[dict]:
    """n distinct ``steering_vectors`` fields: all three hooks on every layer from ``first_layer``, packed
    (base64, or raw bytes with ``binary`` for msgpack bodies)."""
    import numpy as np

    from vllm_steer.client import pack

    rng = np.random.default_rng(seed)
    layers = list(range(first_layer, shape["layers"]))
    out = []
    for _ in range(n):
        out.append({h: pack((rng.standard_normal((len(layers), shape["hidden"]), dtype=np.float32) * std),
                            layers, pack_dtype, binary=binary) for h in HOOKS})
    return out


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab - 2, size=(n, length)).tolist()


def expects_steering_field(arm: dict) -> bool:
    """Whether this arm's responses must carry vllm-steer's ``steering`` field."""
    return arm["kind"] not in UNMARKED_KINDS


def site_fields(arm: dict, n_requests: int, ctx: dict) -> list[dict]:
    """Request i of a single-site arm uses site vector i % n_configs."""
    layer, vecs = ctx_site(ctx)
    n, kind, scale = arm["n_configs"], arm["kind"], arm.get("scale", 1.0)
    if kind == "hotwire":
        return [hotwire_field(i % n, layer, scale) for i in range(n_requests)]
    if kind == "site_module":
        return [{"steering_module": {"name": module_name(i % n), "scale": scale}} for i in range(n_requests)]
    # scaled before packing: the request stays on the packed fast path (no ``scales`` field)
    cfgs = [steer_vectors(vecs[j] * scale, layer, ctx["pack_dtype"]) for j in range(n)]
    return [{"steering_vectors": cfgs[i % n]} for i in range(n_requests)]


def arm_fields(arm: dict, n_requests: int, seed: int, ctx: dict) -> list[dict | None]:
    kind = arm["kind"]
    if kind in ("hotwire", "site_module", "site_inline"):
        return site_fields(arm, n_requests, ctx)
    if kind == "plain":
        return [None] * n_requests
    if kind == "module":
        return [{"steering_module": {"name": MODULE_NAME, "scale": 1.0}}] * n_requests
    if kind == "shared":
        cfg = ctx.setdefault("shared_cfg", steering_configs(1, 777, ctx["shape"], ctx["std"], ctx["pack_dtype"])[0])
        return [{"steering_vectors": cfg}] * n_requests
    if kind == "sae":
        from .sae_files import sae_fields

        cfgs = sae_fields(arm["n_configs"], seed, ctx["shape"]["layers"], arm["mode"])
        return [{"sae": cfgs[i % len(cfgs)]} for i in range(n_requests)]
    if kind == "cond":
        import numpy as np

        cfgs = steering_configs(arm["n_configs"], seed, ctx["shape"], ctx["std"], ctx["pack_dtype"], first_layer=1)
        probe = np.random.default_rng(seed + 1).standard_normal(ctx["shape"]["hidden"])
        condition = {"site": "pre_attn.1", "probe": (probe / np.linalg.norm(probe)).tolist(), "threshold": 0.0}
        extra = {"steering_condition": condition} if arm.get("condition", True) else {}
        return [{"steering_vectors": cfgs[i % len(cfgs)], **extra} for i in range(n_requests)]
    if kind == "per_request":
        cfgs = steering_configs(arm["n_configs"] or ctx["wide"], seed, ctx["shape"], ctx["std"], ctx["pack_dtype"],
                                binary=arm.get("wire") == "msgpack")
        return [{"steering_vectors": cfgs[i % len(cfgs)]} for i in range(n_requests)]
    raise ValueError(kind)


def build_bodies(prompts, fields, max_tokens: int, wire: str = "json") -> list[bytes]:
    """Request bodies: JSON, or msgpack (``wire="msgpack"``, sent as application/msgpack)."""
    import msgspec

    out = []
    for p, f in zip(prompts, fields):
        body = {"model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if f:
            body.update(f)
        out.append(msgspec.msgpack.encode(body) if wire == "msgpack" else json.dumps(body, separators=(",", ":")).encode())
    return out


def arm_modules(arm: dict, ctx: dict) -> dict[str, dict]:
    """The steering modules an arm's requests name: module name -> its ``steering_vectors``."""
    if arm["kind"] == "module":
        return {MODULE_NAME: steering_configs(1, 4242, ctx["shape"], ctx["std"], ctx["pack_dtype"])[0]}
    if arm["kind"] == "site_module":
        layer, vecs = ctx_site(ctx)
        return {module_name(i): steer_vectors(vecs[i], layer, ctx["pack_dtype"]) for i in range(arm["n_configs"])}
    return {}


def ensure_modules(server, arm: dict, ctx: dict) -> None:
    """Register the arm's steering modules on ``server`` once per server and kind
    (POST /v1/steering/modules, replace=true)."""
    key = (server.name, arm["kind"])
    if arm["kind"] not in MODULE_KINDS or key in ctx["modules_done"]:
        return
    mods = arm_modules(arm, ctx)
    for name, vecs in mods.items():
        st, body = http_json("POST", server.base + "/v1/steering/modules",
                             {"name": name, "steering_vectors": vecs, "replace": True}, timeout=120)
        if st not in (200, 201):
            raise RuntimeError(f"module {name} registration failed: {st} {body}")
    log(f"modules {', '.join(mods)} registered on {server.name}; last: {json.dumps(body)[:300]}")
    ctx["modules_done"].add(key)


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")
