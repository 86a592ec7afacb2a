#!/usr/bin/env python3
"""Per-request API-side cost of a steered request at the 8B shape (CPU only, no engine).

What the OpenAI server does for one request before the engine sees it, in steps:
  json    json.loads of the HTTP body (vLLM parses it; the packed vectors are a base64 string)
  front   SteeringFrontend.engine_extra_args (validate, decode base64, resolve tiers, hash, payload)
  ipc     msgspec msgpack encoding of the resulting extra_args (the engine-core IPC carries it)
For: inline packed bf16 and float32 (3 hooks x 32 layers x 4096), and a named-module reference.

    python3 bench/frontend_cost.py [--layers 32 --hidden 4096 --repeat 20]
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

HOOKS = ("pre_attn", "post_attn", "post_mlp")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    mc = SimpleNamespace(dtype=torch.bfloat16, hf_text_config=SimpleNamespace(num_hidden_layers=args.layers),
                         get_hidden_size=lambda: args.hidden)
    cfg = SimpleNamespace(model_config=mc, additional_config={"steer": {"max_configs": 272}})
    fe = SteeringFrontend(cfg)
    rng = np.random.default_rng(0)
    layers = list(range(args.layers))
    bodies = {}
    for dt in ("bfloat16", "float32"):
        vecs = {h: pack(rng.standard_normal((args.layers, args.hidden), dtype=np.float32) * 0.05, layers, dt)
                for h in HOOKS}
        bodies[f"inline packed {dt}"] = json.dumps({"prompt": [1] * 256, "steering_vectors": vecs}).encode()
    # a registered module, referenced by name
    from vllm_steer.frontend.module_registration import module_from_json, prepare
    from vllm_steer.frontend.module_store import STORE

    mod_vecs = {h: pack(rng.standard_normal((args.layers, args.hidden), dtype=np.float32) * 0.05, layers, "bfloat16")
                for h in HOOKS}
    STORE.publish(prepare(module_from_json({"name": "m", "steering_vectors": mod_vecs}, fe.shape), True))
    bodies["named module ref"] = json.dumps({"prompt": [1] * 256,
                                              "steering_module": {"name": "m", "scale": 1.0}}).encode()
    try:
        import msgspec

        enc = msgspec.msgpack.Encoder()
    except ImportError:
        enc = None
    print(f"API-side cost per request, {args.layers} layers x {args.hidden} x {len(HOOKS)} hooks, model bf16, "
          f"median of {args.repeat} (ms):")
    print("| request | body bytes | json.loads | engine_extra_args | msgpack of payload | payload bytes | total |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, body in bodies.items():
        tj, tf, tm = [], [], []
        nbytes = 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            obj = json.loads(body)
            t1 = time.perf_counter()
            extra = {k: v for k, v in obj.items() if k != "prompt"}
            new_extra, _pk, _dk = fe.engine_extra_args(extra)
            t2 = time.perf_counter()
            if enc is not None:
                nbytes = len(enc.encode(new_extra))
            t3 = time.perf_counter()
            tj.append(t1 - t0)
            tf.append(t2 - t1)
            tm.append(t3 - t2)
        med = [statistics.median(x) * 1e3 for x in (tj, tf, tm)]
        print(f"| {name} | {len(body):,} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {nbytes:,} | {sum(med):.2f} |")


if __name__ == "__main__":
    main()
