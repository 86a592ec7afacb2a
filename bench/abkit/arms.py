"""The A/B arms (server + kind of traffic), their request fields, bodies and steering modules. Kinds: ``plain``,
``module``, ``shared`` (one config for all), ``per_request`` (n configs), ``sae`` (clamp sets), ``cond`` (with /
without a steering_condition), ``project`` (n configs, each ablating one random unit direction at every layer's
post_mlp: ``steering_projections``, the direction packed); single-site (post_mlp of --site-layer, 16 vectors; hotwire adds at the end of layer L
= post_mlp at L): ``site_module`` (``ab_site_{i%16}``), ``site_inline``, ``hotwire`` (id ``v{i%16}``, vllm_xargs);
``capture`` (the ``activations`` consumer at 3 sites), ``capture_fs`` (the ``filesystem`` consumer: files on local
disk, checked and removed after each run). ``load`` overrides the phase's load (``prompt_len``, ``max_tokens``,
``requests``, ``concurrency``); ``ref`` names the arm an arm is compared with (default: stock)."""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np

from vllm_steer.client import pack

from .servers import (CLAMPED, EXTRACT_SERVER, MULTI_SUFFIX, PEER_SERVER, SAE_FEATURES, SAE_NAME, TC_PREFIX, log, sae_layers,
                      server_unavailable, site_vectors)

HOOKS = ("pre_attn", "post_attn", "post_mlp")
PREFILL_LOAD = {"prompt_len": 512, "max_tokens": 1, "requests": 256, "concurrency": 32}
MODULE_NAME = "ab_bench_module"

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
    # SAE clamping: 16 distinct clamp sets of 64 features at 4 layers
    "sae_idle": dict(server="sae", kind="plain"),
    "sae_delta_n16": dict(server="sae", kind="sae", mode="delta", n_configs=16),
    "sae_serial_idle": dict(server="sae_serial", kind="plain"),
    "sae_serial_delta_n16": dict(server="sae_serial", kind="sae", mode="delta", n_configs=16),
    "sae_full_idle": dict(server="sae_full", kind="plain"),
    # transcoders (issue 39): a clamp set of CLAMPED features on each of the 4 layers' transcoders (post_attn sites)
    "transcoder_idle": dict(server="transcoder", kind="plain"),
    "transcoder_n16": dict(server="transcoder", kind="sae", mode="delta", n_configs=16, transcoder=True),
    "sae_reconstruct_n16": dict(server="sae_full", kind="sae", mode="reconstruct", n_configs=16),
    # a TopK SAE (k 64) at the same 4 sites: idle, and 16 clamp sets in delta mode (issue 39's TopK target)
    "sae_topk_idle": dict(server="sae_topk", kind="plain"),
    "sae_topk_n16": dict(server="sae_topk", kind="sae", mode="delta", n_configs=16),
    # single-site work: the peer plugin hotwire, vllm-steer by module name and inline
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
    # directional projections (steer.max_projections 1): idle, and 16 configs each ablating one random unit
    # direction at every layer's post_mlp (compare with per_request_n16 on the steer server, same run)
    "project_idle": dict(server="steer_proj", kind="plain"),
    "project_n16": dict(server="steer_proj", kind="project", n_configs=16),
    # the same on servers running the late kernel path (issue 38; VLLM_STEER_NORM_EARLY=0, the default before
    # EARLY), interleaved with the default ones in one run: per_request_n16_late against per_request_n16,
    # project_n16_late against per_request_n16_late (the target's pair on the late path)
    "enabled_idle_late": dict(server="steer_late", kind="plain", ref="enabled_idle"),
    "per_request_n16_late": dict(server="steer_late", kind="per_request", n_configs=16, ref="per_request_n16"),
    "project_idle_late": dict(server="steer_proj_late", kind="plain", ref="project_idle"),
    "project_n16_late": dict(server="steer_proj_late", kind="project", n_configs=16, ref="per_request_n16_late"),
    # issue 43 (QUANT=fp8): the same traffic on steer_fp8u (VLLM_STEER_FP8_NORM_QUANT=0: the norm + FP8 quant not
    # fused back), against its twin on steer (fused back: the default)
    "enabled_idle_fp8u": dict(server="steer_fp8u", kind="plain", ref="enabled_idle"),
    "per_request_n16_fp8u": dict(server="steer_fp8u", kind="per_request", n_configs=16, ref="per_request_n16"),
    # issue 40 (the arfuse steps, TP=2 with FlashInfer): stock with vLLM's all-reduce + RMSNorm fusion off, against
    # the fused default (what a steered norm gives up: enabled_idle - stock_nofuse is our own cost beside it)
    "stock_nofuse": dict(server="stock_nofuse", kind="plain", ref="stock"),
    # issue 40's give-back C (steer_arnorm: VLLM_STEER_AR_NORM=1): the all-reduce inside the steered norm at TP >= 2
    "enabled_idle_arnorm": dict(server="steer_arnorm", kind="plain", ref="stock"),
    "per_request_n16_arnorm": dict(server="steer_arnorm", kind="per_request", n_configs=16, ref="stock"),
    # every steered norm a programmatic dependent launch (steer_pdl / steer_capture_pdl: VLLM_STEER_NORM_PDL=1),
    # against stock like their twins (the same trials: the twin's row is the A/B)
    "enabled_idle_pdl": dict(server="steer_pdl", kind="plain", ref="stock"),
    "per_request_n16_pdl": dict(server="steer_pdl", kind="per_request", n_configs=16, ref="stock"),
    "capture_idle_pdl": dict(server="steer_capture_pdl", kind="plain", ref="stock"),
    # capture (steer.capture: activations): idle, and every request reading post_mlp of 3 layers at every
    # generated token (rows copied to the host each step, reduced to the last one per site)
    "capture_idle": dict(server="steer_capture", kind="plain"),
    "capture_gen_n16": dict(server="steer_capture", kind="capture"),
    # the heavy capture: every request writes post_mlp of every layer at every position to local disk
    "capture_fs_all": dict(server="steer_capture_fs", kind="capture_fs", layers="all", positions="all"),
    "capture_fs_all_nosync": dict(server="steer_capture_fs", kind="capture_fs", instance="fs_nosync", layers="all",
                                  positions="all"),
    # the same, each response not waiting for its files (`"wait": false`): they are published behind it
    "capture_fs_all_nowait": dict(server="steer_capture_fs", kind="capture_fs", instance="fs_nosync", layers="all",
                                  positions="all", wait=False),
    # prefill capture against vLLM's own extract_hidden_states (4 layers, prompt 512, 1 token, 256 requests at c32):
    # rows to files (filesystem consumer), rows to host memory only (activations, reduce mean), vLLM's connector
    "prefill_stock": dict(server="stock", kind="plain", load=PREFILL_LOAD, ref="prefill_stock"),
    # the capture server's prompts capturing nothing: what an enabled server's prefill costs (its steered norms'
    # eager launches: NOTES "Enabled servers' TTFT") apart from capture's own work
    "prefill_capture_idle": dict(server="steer_capture_fs", kind="plain", load=PREFILL_LOAD, ref="prefill_stock"),
    "prefill_capture_fs": dict(server="steer_capture_fs", kind="capture_fs", layers=4, positions="all_prompt",
                               load=PREFILL_LOAD, ref="prefill_stock"),
    "prefill_capture_fs_nosync": dict(server="steer_capture_fs", kind="capture_fs", instance="fs_nosync", layers=4,
                                      positions="all_prompt", load=PREFILL_LOAD, ref="prefill_stock"),
    "prefill_capture_fs_nowait": dict(server="steer_capture_fs", kind="capture_fs", layers=4, positions="all_prompt",
                                      wait=False, load=PREFILL_LOAD, ref="prefill_stock"),  # fsynced, not waited for
    "prefill_capture_mem": dict(server="steer_capture_fs", kind="capture", layers=4, positions="all_prompt",
                                reduce="mean", load=PREFILL_LOAD, ref="prefill_stock"),
    "prefill_extract_hs": dict(server=EXTRACT_SERVER, kind="extract_hs", load=PREFILL_LOAD, ref="prefill_stock"),
}
# the same prefill capture as before s37 (server steer_capture_fs_pre), and with only the notifier and the reader not
# waiting for the next launch (_nogate)
for _arm in ("prefill_capture_fs_nowait", "prefill_capture_mem"):
    for _suffix in ("pre", "nogate"):
        ARMS[f"{_arm}_{_suffix}"] = {**ARMS[_arm], "server": f"steer_capture_fs_{_suffix}"}
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
        if why := server_unavailable(ARMS[a]["server"], args):
            log(f"[{what}] skipping arm {a}: {why}")
        else:
            out.append(a)
    return out


def steering_configs(n: int, seed: int, shape: dict, std: float, pack_dtype: str, binary: bool = False,
                     first_layer: int = 0) -> list[dict]:
    """n distinct ``steering_vectors``: every hook and layer from ``first_layer``, packed (``binary``: raw bytes)."""
    rng = np.random.default_rng(seed)
    layers = list(range(first_layer, shape["layers"]))
    return [{h: pack((rng.standard_normal((len(layers), shape["hidden"]), dtype=np.float32) * std),
                     layers, pack_dtype, binary=binary) for h in HOOKS} for _ in range(n)]


def projection_configs(n: int, seed: int, shape: dict) -> list[dict]:
    """n distinct ``steering_projections``: each one random unit direction (float32, packed in base64: no JSON
    floats to parse) ablated at post_mlp of every layer."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        v = rng.standard_normal(shape["hidden"]).astype(np.float32)
        op = {"direction": {"dtype": "float32", "data": base64.b64encode((v / np.linalg.norm(v)).tobytes()).decode()},
              "mode": "ablate"}
        out.append({"post_mlp": {str(layer): [op] for layer in range(shape["layers"])}})
    return out


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, vocab - 2, size=(n, length)).tolist()


def expects_steering_field(arm: dict) -> bool:
    """Whether this arm's responses must carry vllm-steer's ``steering`` field (hotwire's carry none)."""
    return arm["kind"] not in ("plain", "hotwire", "capture", "capture_fs", "extract_hs")


def module_name(i: int) -> str:
    return f"ab_site_{i}"


def hotwire_field(i: int, layer: int, scale: float = 1.0) -> dict:
    return {"vllm_xargs": {"hotwire": json.dumps({"id": f"v{i}", "layer": layer, "scale": scale})}}


def steer_vectors(vec, layer: int, pack_dtype: str, scale: float = 1.0) -> dict:
    """vllm-steer's ``steering_vectors`` for one vector at ``post_mlp`` of ``layer`` (and its packed ``scales``)."""
    return {"post_mlp": pack(vec.reshape(1, -1), [layer], pack_dtype, scales=None if scale == 1.0 else [scale])}


def ctx_site(ctx: dict) -> tuple[int, object]:  # (site layer, site vectors) of a suite run
    return ctx.setdefault("site", (ctx["site_layer"], site_vectors(ctx["shape"], ctx["std"])))


def arm_fields(arm: dict, n_requests: int, seed: int, ctx: dict) -> list[dict | None]:
    """The steering fields of an arm's requests (None: none); request i of a single-site arm uses vector i % n."""
    kind, n = arm["kind"], arm.get("n_configs")
    if kind in ("hotwire", "site_module", "site_inline"):
        layer, vecs = ctx_site(ctx)
        scale = arm.get("scale", 1.0)
        if kind == "hotwire":
            return [hotwire_field(i % n, layer, scale) for i in range(n_requests)]
        if kind == "site_module":
            return [{"steering_module": {"name": module_name(i % n), "scale": scale}} for i in range(n_requests)]
        # scaled before packing: the request stays on the packed fast path (no ``scales`` field)
        cfgs = [steer_vectors(vecs[j] * scale, layer, ctx["pack_dtype"]) for j in range(n)]
        return [{"steering_vectors": cfgs[i % n]} for i in range(n_requests)]
    if kind == "plain":
        return [None] * n_requests
    if kind == "module":
        return [{"steering_module": {"name": MODULE_NAME, "scale": 1.0}}] * n_requests
    if kind == "shared":
        cfg = ctx.setdefault("shared_cfg", steering_configs(1, 777, ctx["shape"], ctx["std"], ctx["pack_dtype"])[0])
        return [{"steering_vectors": cfg}] * n_requests
    if kind == "sae":  # n distinct clamp sets: CLAMPED features SET at each of the 4 sites
        rng = np.random.default_rng(seed)
        tc = arm.get("transcoder", False)  # a transcoder per layer, at its MLP-input norm (post_attn)
        cfgs = [[{"name": f"{TC_PREFIX}{layer}" if tc else SAE_NAME, "site": f"{'post_attn' if tc else 'post_mlp'}.{layer}",
                  "mode": arm["mode"],
                  "clamps": [{"feature": int(f), "kind": "set", "value": float(v)} for f, v in
                             zip(rng.choice(SAE_FEATURES, CLAMPED, replace=False), rng.uniform(1, 8, CLAMPED))]}
                 for layer in sae_layers(ctx["shape"]["layers"])] for _ in range(n)]
        return [{"sae": cfgs[i % len(cfgs)]} for i in range(n_requests)]
    if kind == "cond":
        cfgs = steering_configs(n, seed, ctx["shape"], ctx["std"], ctx["pack_dtype"], first_layer=1)
        probe = np.random.default_rng(seed + 1).standard_normal(ctx["shape"]["hidden"])
        packed = (probe / np.linalg.norm(probe)).astype(np.float32).tobytes()  # packed: no 4096 JSON floats to parse
        condition = {"site": "pre_attn.1", "probe": {"dtype": "float32", "data": base64.b64encode(packed).decode()},
                     "threshold": 0.0}
        extra = {"steering_condition": condition} if arm.get("condition", True) else {}
        return [{"steering_vectors": cfgs[i % len(cfgs)], **extra} for i in range(n_requests)]
    if kind == "project":
        return [{"steering_projections": cfg} for cfg in
                (projection_configs(n, seed, ctx["shape"])[i % n] for i in range(n_requests))]
    if kind in ("capture", "capture_fs"):
        spec = {"layers": capture_layers(arm, ctx["shape"]["layers"]), "hooks": ["post_mlp"],
                "positions": arm.get("positions", "all_generated")}
        if kind == "capture_fs":
            wait = {"wait": arm["wait"]} if "wait" in arm else {}
            return [{"capture": {arm.get("instance", "filesystem"): {**spec, **wait}}}] * n_requests
        return [{"capture": {"activations": {**spec, "reduce": arm.get("reduce", "last")}}}] * n_requests
    if kind == "extract_hs":
        return [None] * n_requests
    if kind == "per_request":
        cfgs = steering_configs(n or ctx["wide"], seed, ctx["shape"], ctx["std"], ctx["pack_dtype"],
                                binary=arm.get("wire") == "msgpack")
        return [{"steering_vectors": cfgs[i % len(cfgs)]} for i in range(n_requests)]
    raise ValueError(kind)


def capture_layers(arm: dict, num_layers: int) -> list[int] | str:
    """The layers a capture arm reads: ``"all"``, ``n`` spread evenly ending at the last, or 3 (L/4, L/2, 3L/4)."""
    layers = arm.get("layers", 3)
    if layers == "all":
        return "all"
    if layers == 3:
        return [num_layers * k // 4 for k in (1, 2, 3)]
    return sorted({max(0, num_layers * (k + 1) // layers - 1) for k in range(layers)})


def build_bodies(prompts, fields, max_tokens: int, wire: str = "json") -> list[bytes]:
    """Request bodies: JSON, or msgpack (``wire="msgpack"``, sent as application/msgpack)."""
    import msgspec

    out = []
    for p, f in zip(prompts, fields):
        body = {"model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(f or {})}
        out.append(msgspec.msgpack.encode(body) if wire == "msgpack"
                   else json.dumps(body, separators=(",", ":")).encode())
    return out


def arm_modules(arm: dict, ctx: dict) -> dict[str, dict]:
    """The steering modules an arm's requests name: module name -> its ``steering_vectors``."""
    if arm["kind"] == "module":
        return {MODULE_NAME: steering_configs(1, 4242, ctx["shape"], ctx["std"], ctx["pack_dtype"])[0]}
    if arm["kind"] == "site_module":
        layer, vecs = ctx_site(ctx)
        return {module_name(i): steer_vectors(vecs[i], layer, ctx["pack_dtype"]) for i in range(arm["n_configs"])}
    return {}


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")
