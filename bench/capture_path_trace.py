#!/usr/bin/env python3
"""A capturing request's fixed time on a CPU-lane server (tiny llama, no GPU), issue 37: client TTFT, time to its last
token (E2EL) and from its last token to the stream's end (the capture result's wait: the response's last chunk
holds the driver result, pushed by the worker to this API process's inbox) of plain and capturing requests (the
``activations`` consumer, post_mlp of every layer, generated positions, reduce ``last``: the GPU arm
``capture_gen_n16``), one at a time and 16 at once, waves of each kind interleaved, plus mixed waves (half of each)
whose plain requests show what capturing neighbours cost them. With ``VLLM_STEER_TRACE_PATH=1`` the server's
per-stage stamps of the capturing requests (``frontend.path_trace``) are summarized too.
    PYTHONPATH=src:. .venv/bin/python bench/capture_path_trace.py [--waves 8 --tokens 32 --out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from tests.fixtures.models import tiny_model
from tests.server import openai_server

LAYERS = 2
CAPTURE = {"capture": {"activations": {"layers": list(range(LAYERS)), "hooks": ["post_mlp"],
                                       "positions": "all_generated", "reduce": "last"}}}
PROMPT = "the quick brown fox jumps over the lazy dog " * 6


async def _one(client: httpx.AsyncClient, base: str, extra: dict, tokens: int) -> dict:
    """Seconds from the send to the first token, the last token, and the stream's end."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True, **extra}
    t0 = time.perf_counter()
    first = last = None
    got_capture = False
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - t0
            event = json.loads(line[6:])
            if event.get("choices"):
                first = now if first is None else first
                last = now
            if "capture" in event:
                got_capture = "error" not in json.dumps(event["capture"])[:200]
    end = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token event")
    if extra and not got_capture:
        raise RuntimeError("a capturing request without its result")
    return {"ttft": first, "e2el": last, "end": end, "tail": end - last}


async def _run(base: str, waves: int, tokens: int) -> dict:
    out: dict[str, list[dict]] = {}
    forms = {"plain": {}, "capture": CAPTURE}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        for _ in range(4):  # warm-up
            for extra in forms.values():
                await _one(client, base, extra, tokens)
        for c in (1, 16):
            for _ in range(waves if c == 16 else waves * 4):
                for name, extra in forms.items():  # interleaved: a wave of each kind in turn
                    got = await asyncio.gather(*(_one(client, base, extra, tokens) for _ in range(c)))
                    out.setdefault(f"{name} c{c}", []).extend(got)
                if c == 16:  # half and half: the plain half shows what capturing neighbours cost
                    got = await asyncio.gather(*(_one(client, base, CAPTURE if i % 2 else {}, tokens)
                                                 for i in range(c)))
                    out.setdefault("mixed: plain c16", []).extend(got[0::2])
                    out.setdefault("mixed: capture c16", []).extend(got[1::2])
    return out


_TRACE = re.compile(r"vllm-steer trace: bytes=(\d+) (.*) \(ms since arrival\)")


def _stages(log: str) -> dict:
    rows = [{k: float(v) for k, v in (kv.split("=") for kv in m.group(2).split())} for m in _TRACE.finditer(log)]
    keys = sorted({k for r in rows for k in r}, key=lambda k: statistics.median(r[k] for r in rows if k in r))
    return {"n": len(rows), **{k: statistics.median(r[k] for r in rows if k in r) for k in keys}}


def main() -> None:
    global MODEL
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (default: compiled, as on the GPU)")
    ap.add_argument("--out")
    args = ap.parse_args()
    MODEL = str(tiny_model("llama"))
    extra_args = ["--enforce-eager"] if args.eager else []
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "server.log"
        with openai_server(MODEL, "--dtype", "float32", *extra_args, "--additional-config",
                           json.dumps({"steer": {"max_configs": 16, "capture": ["activations"]}}), log=log,
                           env={"VLLM_STEER_TRACE_PATH": os.environ.get("VLLM_STEER_TRACE_PATH", "1"),
                                "VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as (base, _):
            start = len(log.read_text())
            results = asyncio.run(_run(base, args.waves, args.tokens))
            text = log.read_text()[start:]
    print("ms, median [p10, p90]:  ttft | e2el (last token) | tail (last token -> stream end)")
    summary = {}
    for k, v in results.items():
        row = {}
        for m in ("ttft", "e2el", "tail"):
            q = np.percentile([x[m] for x in v], [10, 50, 90]) * 1e3
            row[m] = [round(float(x), 3) for x in q]
        summary[k] = row
        print(f"  {k:20s} n={len(v):3d} " + " | ".join(f"{row[m][1]:7.2f} [{row[m][0]:.2f}, {row[m][2]:.2f}]"
                                                      for m in ("ttft", "e2el", "tail")))
    stages = _stages(text)
    print("server stages of capturing requests (ms since arrival, median):", stages)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "stages_ms": stages, "raw": results}, indent=1))


if __name__ == "__main__":
    main()
