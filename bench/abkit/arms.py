"""The A/B arms (server + kind of traffic), their request bodies and steering configs.

Kinds: ``plain`` (no steering field), ``module`` (a registered steering module by name),
``shared`` (one steering_vectors config for every request), ``per_request`` (n distinct configs).
Every arm served by ``steer`` has a twin ``<arm>_old`` on ``steer_old`` (the previous release).
"""

from __future__ import annotations

import hashlib
import json

from .client import http_json
from .common import log
from .servers import MULTI_SUFFIX, OLD_SERVER, server_unavailable

HOOKS = ("pre_attn", "post_attn", "post_mlp")
MODULE_NAME = "ab_bench_module"
OLD_SUFFIX = "_old"

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
    # graph check: the same steered arm on the --enforce-eager server
    "eager_per_request_n16": dict(server="eager", kind="per_request", n_configs=16),
    # SAE clamping (abkit/sae_files.py): 16 distinct clamp sets of 64 features at 4 layers
    "sae_idle": dict(server="sae", kind="plain"),
    "sae_delta_n16": dict(server="sae", kind="sae", mode="delta", n_configs=16),
    "sae_full_idle": dict(server="sae_full", kind="plain"),
    "sae_reconstruct_n16": dict(server="sae_full", kind="sae", mode="reconstruct", n_configs=16),
}
for _arm in [a for a, v in ARMS.items() if v["server"] == "steer"]:
    ARMS[f"{_arm}{OLD_SUFFIX}"] = {**ARMS[_arm], "server": OLD_SERVER}
    ARMS[f"{_arm}{MULTI_SUFFIX}"] = {**ARMS[_arm], "server": "steer" + MULTI_SUFFIX}
for _arm in ("stock", "stock_c256"):
    ARMS[f"{_arm}{MULTI_SUFFIX}"] = {**ARMS[_arm], "server": "stock" + MULTI_SUFFIX}
AB_ARMS = ["stock", "disabled", "enabled_idle", "named_shared", "all_steered_shared", "per_request_n4",
           "per_request_n16", "stock_c256", "disabled_c256", "k256"]
LONG_ARMS = ["stock", "per_request_n16", "per_request_n16_old"]  # run at --long-max-tokens in the ab phase
SWEEP_ARMS = ["stock", "enabled_idle", "per_request_n16"]


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


def steering_configs(n: int, seed: int, shape: dict, std: float, pack_dtype: str, binary: bool = False) -> list[dict]:
    """n distinct ``steering_vectors`` fields: all three hooks on every layer, packed (base64, or
    raw bytes with ``binary`` for msgpack bodies)."""
    import numpy as np

    from vllm_steer.client import pack

    rng = np.random.default_rng(seed)
    layers = list(range(shape["layers"]))
    out = []
    for _ in range(n):
        out.append({h: pack((rng.standard_normal((len(layers), shape["hidden"]), dtype=np.float32) * std),
                            layers, pack_dtype, binary=binary) for h in HOOKS})
    return out


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab - 2, size=(n, length)).tolist()


def arm_fields(arm: dict, n_requests: int, seed: int, ctx: dict) -> list[dict | None]:
    kind = arm["kind"]
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


def ensure_module(server, ctx: dict) -> None:
    """Register the bench's steering module on ``server`` once (POST /v1/steering/modules)."""
    if server.name in ctx["modules_done"]:
        return
    vecs = steering_configs(1, 4242, ctx["shape"], ctx["std"], ctx["pack_dtype"])[0]
    st, body = http_json("POST", server.base + "/v1/steering/modules",
                         {"name": MODULE_NAME, "steering_vectors": vecs, "replace": True}, timeout=120)
    if st not in (200, 201):
        raise RuntimeError(f"module registration failed: {st} {body}")
    log(f"module {MODULE_NAME} registered on {server.name}: {json.dumps(body)[:300]}")
    ctx["modules_done"].add(server.name)


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")
