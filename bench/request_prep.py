"""Microbenchmark: request preparation on the API side, floats vs packed (the seed's shape).

Times what the server does per request before the engine sees it: JSON body parse, validation,
tier resolution, hashing and packing into the engine payload (SteeringFrontend.engine_extra_args),
for 34 layers x 2560 hidden on 3 hooks. CPU only; no engine, no GPU.

    python bench/request_prep.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from vllm_steer.client import pack
from vllm_steer.frontend.prepare import SteeringFrontend

LAYERS, HIDDEN, HOOKS = 34, 2560, ("pre_attn", "post_attn", "post_mlp")


def fake_vllm_config() -> SimpleNamespace:
    mc = SimpleNamespace(dtype=torch.bfloat16, hf_text_config=SimpleNamespace(num_hidden_layers=LAYERS),
                         get_hidden_size=lambda: HIDDEN)
    return SimpleNamespace(model_config=mc, additional_config={"steer": {"max_request_bytes": 1 << 30}})


def bodies() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    vecs = {h: rng.standard_normal((LAYERS, HIDDEN)).astype(np.float32) for h in HOOKS}
    layers = list(range(LAYERS))
    floats = {"steering_vectors": {h: {str(l): vecs[h][l].tolist() for l in layers} for h in HOOKS}}
    out = {"floats": json.dumps(floats).encode()}
    for dt in ("float32", "bfloat16"):
        out[f"packed-{dt}"] = json.dumps({"steering_vectors": {h: pack(vecs[h], layers, dt) for h in HOOKS}}).encode()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    fe = SteeringFrontend(fake_vllm_config())
    results = {}
    for name, body in bodies().items():
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            extra = json.loads(body)  # what the server's JSON parsing costs, per request
            fe.engine_extra_args(extra)
            times.append(time.perf_counter() - t0)
        results[name] = (statistics.median(times) * 1e3, len(body))
    base = results["floats"][0]
    print(f"request preparation, {LAYERS} layers x {HIDDEN} x {len(HOOKS)} hooks, model dtype bf16 "
          f"(median of {args.repeat}):")
    print("| form | body bytes | median ms | speedup vs floats |\n| --- | --- | --- | --- |")
    for name, (ms, size) in results.items():
        print(f"| {name} | {size:,} | {ms:.2f} | {base / ms:.1f}x |")


if __name__ == "__main__":
    main()
