#!/usr/bin/env python3
"""Host cost of one steered request per stage at a model shape (no engine): decode the body (JSON / msgpack),
prepare it (front end, the payload encoded for one engine request), its trip to the engine core (vLLM's clone
of the params, its msgpack encode and decode of them), the engine core's read of the payload, the worker's table
write (payload decoded, rows written; CUDA if any), a wave of 16 in the 4-thread pool vs one by one, and the API
process's whole share (``_api_process``: the real middleware and a handler doing vLLM's part: CPU, wall, a wave of
16), and the content-bound floor of a packed body (``_floor``: base64 decode of its blocks, one BLAKE3 over the
rows, one copy of them); forms: packed bf16 / float32, float lists, a module reference, and an unsteered body
(stock's share). Every form sends the same body again and again (the same vectors with every request, which the
front end decodes, checks and hashes once); "new vectors each request" sends packed bf16 JSON of vectors never
sent before (its API-process columns only: the other columns are its first body's).
    python3 bench/request_path_cost.py [--layers 32 --hidden 4096 --repeat 30 --out FILE.json]
``--ablate ROUNDS`` instead measures what the new-vectors row's content work costs in place (``_ablate``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import msgspec
import numpy as np
import pybase64
import torch
from vllm import SamplingParams
from blake3 import blake3
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_steer.client import pack
from vllm_steer.core.payload import payload_of
from vllm_steer.frontend.module_registration import module_from_json, prepare
from vllm_steer.frontend.module_store import STORE
from vllm_steer.frontend.prepare import SteeringFrontend
from vllm_steer.frontend.prepared import for_request
from vllm_steer.runtime.tables import SteeringTables
from vllm_steer.server import request_body

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.asgi_drive import completion_scope, post, reply_ok  # noqa: E402

HOOKS = ("pre_attn", "post_attn", "post_mlp")


def _bodies(layers: int, hidden: int, rng: np.random.Generator) -> dict[str, tuple[bytes, bool]]:
    ids = list(range(layers))

    def vecs():
        return {h: rng.standard_normal((layers, hidden), dtype=np.float32) * 0.05 for h in HOOKS}

    out = {"unsteered, JSON": (json.dumps({"model": "m", "prompt": [1] * 256, "max_tokens": 128,
                                           "stream": True}).encode(), False)}
    for dt in ("bfloat16", "float32"):
        packed = {h: pack(v, ids, dt) for h, v in vecs().items()}
        base = {"model": "m", "prompt": [1] * 256, "max_tokens": 128, "stream": True}
        out[f"packed {dt}, JSON"] = (json.dumps({**base, "steering_vectors": packed}).encode(), False)
        binary = {h: {**p, "data": base64.b64decode(p["data"])} for h, p in packed.items()}
        out[f"packed {dt}, msgpack"] = (msgspec.msgpack.encode({**base, "steering_vectors": binary}), True)
    floats = {h: {str(l): v[l].tolist() for l in ids} for h, v in vecs().items()}
    out["floats, JSON"] = (json.dumps({"prompt": [1] * 256, "steering_vectors": floats}).encode(), False)
    out["module ref, JSON"] = (json.dumps({"prompt": [1] * 256, "steering_module": {"name": "m"}}).encode(), False)
    # conditional (steer.conditions): packed bf16 at layers 1.. (at or after the probe), the probe as floats / packed
    gated = {h: pack(v[1:], ids[1:], "bfloat16") for h, v in vecs().items()}
    probe = rng.standard_normal(hidden).astype(np.float32)
    for form, value in (("floats", probe.tolist()),
                        ("packed", {"dtype": "float32", "data": base64.b64encode(probe.tobytes()).decode()})):
        cond = {"site": "pre_attn.1", "probe": value}
        body = {"prompt": [1] * 256, "steering_vectors": gated, "steering_condition": cond}
        out[f"packed bfloat16 + condition, probe {form}, JSON"] = (json.dumps(body).encode(), False)
    # projections (steer.max_projections 1) as the A/B's project_n16 sends them: one float32 unit direction,
    # ablated at post_mlp of every layer (each layer its own base64 copy)
    v = rng.standard_normal(hidden).astype(np.float32)
    op = {"direction": {"dtype": "float32", "data": base64.b64encode((v / np.linalg.norm(v)).tobytes()).decode()},
          "mode": "ablate"}
    body = {"prompt": [1] * 256, "steering_projections": {"post_mlp": {str(l): [op] for l in ids}}}
    out["projections, 32 sites float32, JSON"] = (json.dumps(body).encode(), False)
    return out


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _floor(body: bytes, msgpack: bool, repeat: int) -> float:
    """Ms of what a packed body's content costs at least: its blocks' base64 decoded (a JSON body; from fresh
    copies of the text, as a request brings), one BLAKE3 over the rows, one copy of them (0: no packed block)."""
    obj = msgspec.msgpack.decode(body) if msgpack else msgspec.json.decode(body)
    blocks = [p["data"] for tier in ("steering_vectors", "prefill_steering_vectors", "decode_steering_vectors")
              for p in (obj.get(tier) or {}).values() if isinstance(p, dict) and "data" in p]
    if not blocks:
        return 0.0
    times = []
    for _ in range(repeat):
        texts = [bytearray(b.encode() if isinstance(b, str) else b) for b in blocks]
        t0 = time.perf_counter()
        rows = [pybase64.b64decode(t, validate=True) for t in texts] if not msgpack else texts
        h = blake3()
        for r in rows:
            h.update(r)
        h.digest()
        b"".join(rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _fresh_bodies(layers: int, hidden: int) -> Callable[[], bytes]:
    """Packed bf16 JSON bodies of vectors never sent before, one per call (made outside the timed part)."""
    rng, ids = np.random.default_rng(1), list(range(layers))
    base = {"model": "m", "prompt": [1] * 256, "max_tokens": 128, "stream": True}

    def make() -> bytes:
        vecs = {h: pack(rng.standard_normal((layers, hidden), dtype=np.float32) * 0.05, ids, "bfloat16") for h in HOOKS}
        return json.dumps({**base, "steering_vectors": vecs}).encode()

    return make


def _api_process(fe, body: bytes, msgpack: bool, repeat: int,
                 fresh: Callable[[], bytes] | None = None) -> tuple[float, float, float]:
    """The API process's whole share of one request, through the real request middleware and a handler doing
    what vLLM's does with the body it gets (FastAPI's JSON parse, the pydantic request, ``to_sampling_params``,
    ``process_inputs``' preparation and clone, the msgpack encode for the engine core): (CPU ms of the
    process, all threads, per request one by one; wall ms per request one by one; wall ms of a wave of 16
    sent at once). ``fresh``: a new body for each request instead of ``body`` again."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_steer.frontend.prepare import _ALL_FIELDS, _prepared
    from vllm_steer.server.openai_fields import endpoint_attached, patch_openai_requests

    patch_openai_requests()
    endpoint_attached()
    encoder = MsgpackEncoder()

    async def vllm_handler(scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        request = CompletionRequest.model_validate(json.loads(b"".join(chunks)))
        params = request.to_sampling_params(8, {})
        extra = params.extra_args
        if extra and any(k in extra for k in _ALL_FIELDS):
            params.extra_args = _prepared(fe, extra, "req-0").extra_args
        encoder.encode(params.clone())
        await reply_ok(send)

    middleware = request_body.SteeringRequestMiddleware(vllm_handler)
    scope = completion_scope(fe, body, msgpack)

    def next_body() -> bytes:
        return fresh() if fresh is not None else body

    async def one(sent: bytes) -> None:
        await post(middleware, scope, sent)

    async def run() -> tuple[float, float, float]:
        for _ in range(3):
            await one(next_body())
        cpu, wall = [], []
        for _ in range(repeat):
            sent = next_body()
            c0, t0 = time.process_time(), time.perf_counter()
            await one(sent)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
        waves = []
        for _ in range(max(3, repeat // 5)):
            sent = [next_body() for _ in range(16)]
            t0 = time.perf_counter()
            await asyncio.gather(*(one(b) for b in sent))
            waves.append(time.perf_counter() - t0)
        return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3, statistics.median(waves) * 1e3

    return asyncio.run(run())


def _ablate(fe, layers: int, hidden: int, rounds: int, repeat: int) -> dict[str, list[float]]:
    """API-process CPU ms of the new-vectors row with its content work stubbed out stage by stage (BLAKE3: a
    constant digest; the row checks: rows taken unchecked; base64: zeros of the decoded length, so with the checks
    off only), in one process, interleaved in rounds (between processes this box's noise is ~10%); the same body
    again for reference."""
    from vllm_steer.core import layout
    from vllm_steer.server import base64_lift

    real = layout.rows_digest, layout.raw_rows, base64_lift.pybase64
    zeros: dict[int, bytes] = {}

    def decoded_zeros(text, validate=True):
        n = len(text) // 4 * 3 - bytes(text[-2:]).count(b"=")
        return zeros.setdefault(n, bytes(n))

    stubs = {"BLAKE3": ("rows_digest", lambda raw: bytes(32)),
             "row checks": ("raw_rows", lambda raw, ids, dtype, d: (tuple(ids), raw)),
             "base64": ("pybase64", SimpleNamespace(b64decode=decoded_zeros))}
    cases = {"new vectors": (), "BLAKE3 off": ("BLAKE3",), "row checks off": ("row checks",),
             "both off": ("BLAKE3", "row checks"), "both and base64 off": ("BLAKE3", "row checks", "base64")}
    fresh = _fresh_bodies(layers, hidden)
    body = fresh()
    out: dict[str, list[float]] = {}
    try:
        for r in range(rounds):
            for name in list(cases) if r % 2 == 0 else list(cases)[::-1]:
                layout.rows_digest, layout.raw_rows, base64_lift.pybase64 = real
                for stage in cases[name]:
                    attr, stub = stubs[stage]
                    setattr(base64_lift if attr == "pybase64" else layout, attr, stub)
                out.setdefault(name, []).append(_api_process(fe, body, False, repeat, fresh)[0])
            layout.rows_digest, layout.raw_rows, base64_lift.pybase64 = real
            out.setdefault("same body again", []).append(_api_process(fe, body, False, repeat)[0])
    finally:
        layout.rows_digest, layout.raw_rows, base64_lift.pybase64 = real
    print(f"new vectors' API-process CPU, content stages stubbed, {rounds} rounds of {repeat} (ms, median [min-max]; "
          "change: median of per-round differences)")
    print("| case | API process: CPU | change |\n| --- | --- | --- |")
    for name, ms in out.items():
        delta = statistics.median(a - b for a, b in zip(ms, out["new vectors"]))
        print(f"| {name} | {statistics.median(ms):.3f} [{min(ms):.3f}-{max(ms):.3f}] | {delta:+.3f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag, default in (("--layers", 32), ("--hidden", 4096), ("--repeat", 30)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out")
    ap.add_argument("--ablate", type=int, default=0, metavar="ROUNDS")
    args = ap.parse_args()
    mc = SimpleNamespace(dtype=torch.bfloat16, hf_text_config=SimpleNamespace(num_hidden_layers=args.layers),
                         get_hidden_size=lambda: args.hidden)
    fe = SteeringFrontend(SimpleNamespace(model_config=mc, additional_config={"steer": {"max_configs": 272,
                                                                                               "conditions": True,
                                                                                               "max_projections": 1}}))
    rng = np.random.default_rng(0)
    mod = {h: pack(rng.standard_normal((args.layers, args.hidden), dtype=np.float32) * 0.05,
                   list(range(args.layers)), "bfloat16") for h in HOOKS}
    STORE.publish(prepare(module_from_json({"name": "m", "steering_vectors": mod}, fe.shape), True))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tables = SteeringTables({h: list(range(args.layers)) for h in HOOKS}, 64, args.hidden, 16,
                            torch.bfloat16, device)
    row = iter(range(10**9))

    def write(params: SamplingParams) -> None:
        steering = payload_of(params)
        for key in steering.keys:
            if key in steering.configs:
                tables.write_row(1 + next(row) % 63, steering.configs[key])

    def prepare_one(fields: dict) -> dict | None:
        return for_request(fe.engine_extra_args(dict(fields)), {}, "req-0").extra_args

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(SamplingParams)

    def transport(extra: dict | None) -> SamplingParams:
        """What vLLM does with the params between the API process and the engine core's scheduler."""
        return decoder.decode(encoder.encode(SamplingParams(max_tokens=8, extra_args=extra).clone()))

    if args.ablate:
        ablation = _ablate(fe, args.layers, args.hidden, args.ablate, args.repeat)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"layers": args.layers, "hidden": args.hidden, "cpu": _cpu_name(), "ablation": ablation},
                          fh, indent=1)
        return
    pool, results = ThreadPoolExecutor(4), []
    print(f"per request, {args.layers} layers x {args.hidden} x {len(HOOKS)} hooks, model bf16, tables on {device}, "
          f"median of {args.repeat} (ms)")
    print("| request | body bytes | decode | prepare | to the engine | engine core read | engine write "
          "| wave of 16: one by one | wave of 16: pool of 4 | API process: CPU | API process: wall "
          "| API process: wave of 16 | floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    forms = {name: (body, msgpack, None) for name, (body, msgpack) in _bodies(args.layers, args.hidden, rng).items()}
    fresh = _fresh_bodies(args.layers, args.hidden)
    forms = {**dict(list(forms.items())[:2]), "packed bfloat16, JSON, new vectors each request": (fresh(), False, fresh),
             **dict(list(forms.items())[2:])}
    for name, (body, msgpack, new_body) in forms.items():
        fields = request_body.steering_fields(dict(request_body._decode(body, msgpack)))
        t_dec = _median_ms(lambda: request_body._decode(body, msgpack), args.repeat)
        t_prep = _median_ms(lambda: prepare_one(fields), args.repeat)
        extra = prepare_one(fields)
        t_trip = _median_ms(lambda: transport(extra), args.repeat)
        params = transport(extra)
        t_core = _median_ms(lambda: payload_of(params).keys, args.repeat) if extra else 0.0
        steering = payload_of(params)
        t_write = _median_ms(lambda: write(params), args.repeat) if steering is not None and steering.configs else 0.0
        if device.type == "cuda":
            torch.cuda.synchronize()
        wave = [body] * 16
        t_serial = _median_ms(lambda: [request_body._prepare(fe, b, msgpack) for b in wave], max(3, args.repeat // 5))
        t_pool = _median_ms(lambda: list(pool.map(lambda b: request_body._prepare(fe, b, msgpack), wave)),
                            max(3, args.repeat // 5))
        api_cpu, api_wall, api_wave = _api_process(fe, body, msgpack, args.repeat, new_body)
        floor = _floor(body, msgpack, args.repeat)
        results.append({"request": name, "body_bytes": len(body), "decode_ms": t_dec, "prepare_ms": t_prep,
                        "to_engine_ms": t_trip, "engine_core_read_ms": t_core, "engine_write_ms": t_write,
                        "wave16_serial_ms": t_serial, "wave16_pool4_ms": t_pool, "api_cpu_ms": api_cpu,
                        "api_wall_ms": api_wall, "api_wave16_ms": api_wave, "floor_ms": floor})
        print(f"| {name} | {len(body):,} | {t_dec:.2f} | {t_prep:.2f} | {t_trip:.3f} | {t_core:.3f} | {t_write:.2f} "
              f"| {t_serial:.1f} | {t_pool:.1f} | {api_cpu:.2f} | {api_wall:.2f} | {api_wave:.1f} | {floor:.2f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"layers": args.layers, "hidden": args.hidden, "device": str(device),
                       "cpu": _cpu_name(), "results": results}, fh, indent=1)


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return "?"


if __name__ == "__main__":
    main()
