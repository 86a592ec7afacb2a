#!/usr/bin/env python3
"""Where a steered request's fixed time goes in the API process, on a CPU-lane server (tiny llama, no GPU):
client TTFT of unsteered / named-module / inline one-site requests, one at a time and 16 at once, and the
server's per-stage stamps (``VLLM_STEER_TRACE_PATH=1``, frontend.path_trace) of the steered ones.
    PYTHONPATH=. .venv/bin/python bench/request_path_trace.py [--waves 6 --out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from tests.fixtures.models import tiny_model
from tests.server import openai_server

HIDDEN, LAYERS = 128, 2


async def _ttft(client: httpx.AsyncClient, base: str, extra: dict) -> float:
    body = {"model": MODEL, "prompt": "the quick brown fox jumps", "max_tokens": 2, "stream": True, **extra}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no event")
    return first


async def _run(base: str, forms: dict, waves: int) -> dict:
    out = {}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        for _ in range(4):  # warm-up (caches of the module payload, tokenizer, engine)
            for extra in forms.values():
                await _ttft(client, base, extra)
        for c in (1, 16):
            for name, extra in forms.items():
                times = []
                for _ in range(waves if c == 16 else waves * 4):
                    times += await asyncio.gather(*(_ttft(client, base, extra) for _ in range(c)))
                out[f"{name} c{c}"] = times
    return out


_TRACE = re.compile(r"vllm-steer trace: bytes=(\d+) (.*) \(ms since arrival\)")


def _stages(log: str) -> list[dict]:
    rows = []
    for m in _TRACE.finditer(log):
        rows.append({k: float(v) for k, v in (kv.split("=") for kv in m.group(2).split())} | {"bytes": int(m.group(1))})
    return rows


def main() -> None:
    global MODEL
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--out")
    args = ap.parse_args()
    MODEL = str(tiny_model("llama"))
    rng = np.random.default_rng(0)
    vec = (rng.standard_normal(HIDDEN) * 0.1).tolist()
    forms = {"unsteered": {}, "named": {"steering_module": {"name": "m"}},
             "inline": {"steering_vectors": {"post_mlp.1": vec}}}
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "server.log"
        with openai_server(MODEL, "--dtype", "float32", "--enforce-eager", "--additional-config",
                           json.dumps({"steer": {"max_configs": 16}}), log=log,
                           env={"VLLM_STEER_TRACE_PATH": "1"}) as (base, _):
            r = httpx.post(f"{base}/v1/steering/modules", json={"name": "m", "steering_vectors": {
                "post_mlp": {str(l): vec for l in range(LAYERS)}}}, timeout=60)
            assert r.status_code == 201, r.text
            start = len(log.read_text())
            results = asyncio.run(_run(base, forms, args.waves))
            text = log.read_text()[start:]
    print("client TTFT, ms (median [p10, p90])")
    for k, v in results.items():
        q = np.percentile(v, [10, 50, 90]) * 1e3
        print(f"  {k:16s} n={len(v):3d} {q[1]:7.2f} [{q[0]:.2f}, {q[2]:.2f}]")
    rows = _stages(text)
    print(f"server stages of steered requests (ms since arrival, median over {len(rows)}; the runs' order: "
          "named c1, inline c1, named c16, inline c16)")
    n1 = args.waves * 4
    groups = {"named c1": rows[8:8 + n1], "inline c1": rows[8 + n1:8 + 2 * n1],
              "named c16": rows[8 + 2 * n1:8 + 2 * n1 + 16 * args.waves], "inline c16": rows[8 + 2 * n1 + 16 * args.waves:]}
    summary = {}
    for g, rs in groups.items():
        keys = [k for k in rs[0] if k != "bytes"] if rs else []
        summary[g] = {k: statistics.median(r[k] for r in rs if k in r) for k in keys}
        print(f"  {g:11s} " + " ".join(f"{k}={v:.2f}" for k, v in summary[g].items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"ttft_s": results, "stages_ms": summary}, indent=1))


if __name__ == "__main__":
    main()
