"""hotwire against vllm-steer on the same single-site work: the ``peer`` phase and a CPU self-test.

peer (GPU; the hotwire server is CUDA only): one greedy request (temperature 0, PEER_TOKENS tokens,
one prompt of token ids) steered with site vector ``v3`` at the site layer on ``hotwire`` (its id in
``vllm_xargs``) and on ``steer`` (the identical vector inline at ``post_mlp``), and the same prompt
unsteered on each. It records and logs the token ids, whether the steered outputs match each other,
whether each differs from its unsteered output and whether the unsteered outputs match.
--peer-scale (default 1) scales the vector on both (hotwire's ``scale``, vllm-steer's packed
``scales``): with random dummy weights the residual stream is far smaller than a --std 0.05 vector,
so at scale 1 both steered outputs can collapse to one repeated token, which matches trivially; a
small scale (e.g. 0.02) makes the comparison sharper.

_selftest (CPU, no server): the single-site arms' fields and bodies, the module registrations, the
hotwire server's environment and command, and its vector files read back through hotwire's own
loader and request parser (``hotwire._state``, from the --peer-wheel site) when the wheel is there.
"""

from __future__ import annotations

import json

from .arms import ARMS, arm_fields, arm_modules, build_bodies, expects_steering_field, make_prompts, seed_of
from .client import http_json
from .common import log
from .servers import PEER_SERVER, server_unavailable
from .site_vectors import N_SITE, ctx_site, hotwire_field, hotwire_id, module_name, steer_vectors

PEER_VECTOR = 3
PEER_TOKENS = 32
SITE_ARMS = ("hotwire_idle", "hotwire_ids16", "site_named16", "site_inline16")


def peer_requests(ctx: dict, scale: float = 1.0) -> dict[str, tuple[str, dict]]:
    """name -> (server, body) of the four requests; one prompt, greedy, token ids returned."""
    layer, vecs = ctx_site(ctx)
    prompt = make_prompts(1, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of("peer"))[0]
    base = {"model": "bench", "prompt": prompt, "max_tokens": PEER_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    inline = {"steering_vectors": steer_vectors(vecs[PEER_VECTOR], layer, ctx["pack_dtype"], scale)}
    return {"hotwire_steered": (PEER_SERVER, {**base, **hotwire_field(PEER_VECTOR, layer, scale)}),
            "steer_steered": ("steer", {**base, **inline}),
            "hotwire_plain": (PEER_SERVER, base),
            "steer_plain": ("steer", base)}


def completion(server, body: dict) -> dict:
    """Token ids and steering field of one non-streaming completion."""
    st, resp = http_json("POST", server.base + "/v1/completions", body, timeout=300)
    if st != 200 or not isinstance(resp, dict):
        raise RuntimeError(f"{server.name}: HTTP {st}: {str(resp)[:500]}")
    return {"token_ids": resp["choices"][0].get("token_ids"), "steering": resp.get("steering")}


def first_difference(a: list, b: list) -> int | None:
    """Index of the first differing token (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def verdict(out: dict) -> dict:
    ids = {k: v["token_ids"] for k, v in out.items()}
    v = {"steered_match": ids["hotwire_steered"] == ids["steer_steered"],
         "steered_first_difference": first_difference(ids["hotwire_steered"], ids["steer_steered"]),
         "hotwire_differs_from_unsteered": ids["hotwire_steered"] != ids["hotwire_plain"],
         "steer_differs_from_unsteered": ids["steer_steered"] != ids["steer_plain"],
         "unsteered_match": ids["hotwire_plain"] == ids["steer_plain"],
         "steer_reported_steering": bool(out["steer_steered"]["steering"])}
    v["ok"] = all(v[k] for k in ("steered_match", "hotwire_differs_from_unsteered", "steer_differs_from_unsteered",
                                 "unsteered_match"))
    return v


def peer_phase(pool, ctx: dict, results: dict, save) -> None:
    args = ctx["args"]
    why = server_unavailable(PEER_SERVER, args)
    if why:
        log(f"[peer] skipped: {why}")
        results["peer"] = {"skipped": why}
        save()
        return
    pool.ensure([PEER_SERVER, "steer"])
    out = {}
    for name, (server, body) in peer_requests(ctx, args.peer_scale).items():
        out[name] = completion(pool.get(server), body)
        log(f"[peer] {name:<16} {out[name]['token_ids']}")
    v = verdict(out)
    results["peer"] = {"vector": hotwire_id(PEER_VECTOR), "layer": ctx_site(ctx)[0], "scale": args.peer_scale,
                       "tokens": PEER_TOKENS, "outputs": out, **v}
    log("[peer] " + "; ".join(f"{k} {val}" for k, val in v.items()))
    save()


# --------------------------------------------------------------------------- self-test (CPU)


def _check_fields(ctx: dict) -> None:
    layer, vecs = ctx_site(ctx)
    n = 2 * N_SITE + 3
    hw = arm_fields(ARMS["hotwire_ids16"], n, 0, ctx)
    for i, f in enumerate(hw):
        raw = f["vllm_xargs"]["hotwire"]
        assert isinstance(raw, str) and json.loads(raw) == {"id": f"v{i % 16}", "layer": layer, "scale": 1.0}, raw
    named = arm_fields(ARMS["site_named16"], n, 0, ctx)
    assert [f["steering_module"]["name"] for f in named] == [module_name(i % 16) for i in range(n)]
    inline = arm_fields(ARMS["site_inline16"], n, 0, ctx)
    for i, f in enumerate(inline):
        assert f["steering_vectors"] == steer_vectors(vecs[i % 16], layer, ctx["pack_dtype"])
    mods = arm_modules(ARMS["site_named16"], ctx)
    assert list(mods) == [module_name(i) for i in range(16)]
    assert all(mods[module_name(i)] == steer_vectors(vecs[i], layer, ctx["pack_dtype"]) for i in range(16))
    body = json.loads(build_bodies([[1, 2, 3]], hw[:1], 4)[0])
    assert body["vllm_xargs"] == hw[0]["vllm_xargs"] and body["prompt"] == [1, 2, 3]


def _check_packed(ctx: dict) -> None:
    """The packed site vector decodes to the vector (float32: exactly) at [layer]."""
    import base64

    import numpy as np

    layer, vecs = ctx_site(ctx)
    packed = steer_vectors(vecs[5], layer, "float32")["post_mlp"]
    assert packed["layer_indices"] == [layer] and packed["shape"] == [1, ctx["shape"]["hidden"]]
    got = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.float32)
    assert np.array_equal(got, vecs[5]) and "scales" not in packed
    assert steer_vectors(vecs[5], layer, "float32", 0.5)["post_mlp"]["scales"] == [0.5]
    assert json.loads(hotwire_field(5, layer, 0.5)["vllm_xargs"]["hotwire"])["scale"] == 0.5


def _check_arms() -> None:
    for a in SITE_ARMS:
        assert a in ARMS, a
    assert not expects_steering_field(ARMS["hotwire_ids16"]) and not expects_steering_field(ARMS["hotwire_idle"])
    assert expects_steering_field(ARMS["site_named16"]) and expects_steering_field(ARMS["site_inline16"])


def _check_server(args, ctx: dict, workdir) -> object:
    """The hotwire server's env and command as Pool would start it; returns its site folder (or None)."""
    from .servers import Pool, Server

    assert server_unavailable(PEER_SERVER, args) is None
    pool = Pool(args, workdir / "model", workdir)
    s = Server(PEER_SERVER, pool.ports[PEER_SERVER], args, workdir / "model", workdir)
    pool.prepare(s)
    env, cmd = s.env(), s.command()
    assert env["VLLM_PLUGINS"] == "hotwire" and env["VLLM_CACHE_ROOT"].endswith("-hotwire")
    assert env["PYTHONPATH"].split(":")[0] == str(s.pythonpath_first)
    assert env["HOTWIRE_VECTORS"] == str(workdir / "hotwire_vectors") and env["HOTWIRE_SLOTS"] == "32"
    assert "--additional-config" not in cmd and str(pool.ports[PEER_SERVER]) in cmd
    files = sorted(p.name for p in (workdir / "hotwire_vectors").glob("*.pt"))
    assert files == sorted(f"v{i}.pt" for i in range(N_SITE)), files
    return s.pythonpath_first


def _check_hotwire_reads(site, ctx: dict, folder) -> None:
    """hotwire's own loader and parser on our files and fields: each id's slot holds its vector."""
    import sys

    import torch

    sys.path.insert(0, str(site))
    try:
        from hotwire import _state
    finally:
        sys.path.remove(str(site))
    layer, vecs = ctx_site(ctx)
    shape = ctx["shape"]
    st = _state.SteerState(shape["layers"], shape["hidden"], 64, torch.device("cpu"), torch.float32, N_SITE)
    st.load_store(str(folder))
    assert sorted(st.store) == sorted(hotwire_id(i) for i in range(N_SITE))
    for i, f in enumerate(arm_fields(ARMS["hotwire_ids16"], N_SITE, 0, ctx)):
        (spec,) = _state.parse_spec(f["vllm_xargs"]["hotwire"])
        slot = st.slot_for(spec["id"], int(spec["layer"]), float(spec.get("scale", 1.0)))
        assert slot is not None and int(spec["layer"]) == layer
        assert torch.equal(st.bank.bank[slot], torch.from_numpy(vecs[i])), spec


def _check_pairing() -> None:
    from .stats import paired_pct

    arm = {"trials": [{"trial": 0, "throughput": 110.0}, {"trial": 2, "throughput": 90.0}]}
    ref = {"trials": [{"trial": 0, "throughput": 100.0}, {"trial": 1, "throughput": 50.0},
                      {"trial": 2, "throughput": 100.0}]}
    p = paired_pct(arm, ref, "throughput")
    assert p["trials"] == [0, 2] and [round(x, 6) for x in p["pct"]] == [10.0, -10.0] and not p["significant"]


def _selftest(args) -> None:
    """Everything of the single-site work that can be checked without a GPU."""
    import copy
    import tempfile
    from pathlib import Path

    from .model_dir import SHAPES
    from .site_vectors import site_layer

    with tempfile.TemporaryDirectory() as tmp:
        a = copy.copy(args)
        a.shape, a.launcher, a.workdir = "tiny", "gpu", tmp  # gpu: the hotwire server is available
        shape = SHAPES["tiny"]
        ctx = {"shape": shape, "std": a.std, "pack_dtype": "bfloat16", "site_layer": site_layer(a.site_layer, shape)}
        assert ctx["site_layer"] == 1
        _check_arms()
        _check_fields(ctx)
        _check_packed(ctx)
        _check_pairing()
        if not a.peer_wheel:
            log("[selftest] no --peer-wheel: hotwire's server set-up and loader not checked")
            return
        site = _check_server(a, ctx, Path(tmp))
        _check_hotwire_reads(site, ctx, Path(tmp) / "hotwire_vectors")
        log(f"[selftest] hotwire: {N_SITE} vector files read back by hotwire._state, specs parsed, slots hold the "
            f"vectors (layer {ctx['site_layer']})")
    log("[selftest] single-site arms ok")
