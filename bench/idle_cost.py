#!/usr/bin/env python3
"""Idle cost of the plugin: a server with steering (and capture) enabled serving plain requests, against stock vLLM.

Starts one OpenAI server per arm (``stock``: ``VLLM_PLUGINS=none``; ``steer``: ``{"steer": {"max_configs": 272}}``;
``steer_capture``: the A/B suite's ``steer_capture`` block, the ``activations`` consumer on), each in turn, and sends
``--requests`` plain streaming completions (no steering field) at ``--concurrency``: TTFT / end-to-end medians and
output tokens/s per arm and round (arms interleaved over ``--rounds``). With ``--profile`` every process of the server
runs cProfile (``bench/idle_profile/sitecustomize.py``) and the report lists, per process (API server, engine core,
capture host), the vllm_steer functions that ran, with calls and own time per request and per engine step (own time:
the function's and the builtins it called directly; cProfile slows everything, so read the counts and the shares,
not the absolute times). A function of ours called per step while nothing is steered is what this bench is for.
CPU lane (the tiny llama fixture, eager):
    python3 bench/idle_cost.py --arms stock,steer_capture --requests 200 --concurrency 8 [--profile] [--out F.json]
GPU: ``--model DIR --gpu`` (no --enforce-eager, no CPU env), e.g. the A/B suite's 8b dummy-weight model directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import marshal
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.server import free_port, wait_healthy  # noqa: E402
ARMS = {
    "stock": None,
    "steer": {"steer": {"max_configs": 272}},
    "steer_capture": {"steer": {"max_configs": 272, "capture": ["activations"]}},
}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1", "TORCHDYNAMO_DISABLE": "1"}
OURS = f"{os.sep}vllm_steer{os.sep}"


class Server:
    def __init__(self, arm: str, model: str, gpu: bool, log: Path, profile_dir: Path | None,
                 extra: list[str] = ()) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **({} if gpu else CPU_ENV), "VLLM_PLUGINS": "none" if ARMS[arm] is None else "steer"}
        if profile_dir is not None:
            env["VLLM_STEER_IDLE_PROFILE"] = str(profile_dir)
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "idle_profile"), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "vllm_steer.launcher", "serve", model, "--host", "127.0.0.1", "--port",
               str(self.port), "--max-model-len", "512", "--max-num-seqs", "64"]
        if not gpu:
            cmd += ["--enforce-eager", "--dtype", "float32"]
        cmd += list(extra)
        if ARMS[arm] is not None:
            cmd += ["--additional-config", json.dumps(ARMS[arm])]
        self.fh = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_healthy(self.base, self.proc, 600, lambda: f"{arm}: see {log}")
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.fh.close()


async def _one(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int) -> tuple:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens += 1
    return ttft, time.perf_counter() - t0, tokens


async def load(base: str, model: str, n: int, concurrency: int, max_tokens: int, prompt_len: int) -> dict:
    words = " ".join(f"t{i % 500}" for i in range(prompt_len))
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def go(i: int):
            async with sem:
                return await _one(client, base, model, f"t{i} {words}", max_tokens)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(go(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"ttft_ms_median": 1e3 * statistics.median(d[0] for d in done),
            "e2e_ms_median": 1e3 * statistics.median(d[1] for d in done),
            "tpot_ms_median": 1e3 * statistics.median((d[1] - d[0]) / max(1, d[2] - 1) for d in done),
            "output_tok_s": sum(d[2] for d in done) / wall, "wall_s": wall}


# ---- profiles ----------------------------------------------------------------------------------------
def _load_prof(path: Path) -> dict:
    with open(path, "rb") as fh:
        return marshal.load(fh)


def _role(stats: dict) -> str:
    called = {(Path(f[0]).name, f[2]) for f, v in stats.items() if v[1]}
    if ("core.py", "step") in called or ("core.py", "step_with_batch_queue") in called:
        return "engine_core"
    if ("gpu_model_runner.py", "execute_model") in called or ("model_runner.py", "execute_model") in called:
        return "worker"
    if ("capture_host.py", "_loop") in called:
        return "capture_host"
    if ("request_body.py", "__call__") in called or ("async_llm.py", "add_request") in called:
        return "api_server"
    return "other"


def _count(stats: dict, name: str, file_part: str) -> int:
    return sum(v[1] for f, v in stats.items() if f[2] == name and file_part in f[0])


def _ours(stats: dict) -> list[dict]:
    """Per vllm_steer function: calls, own time (its own plus builtins it called directly, not vLLM's Python)."""
    own: dict = {}
    for func, (cc, nc, tt, ct, callers) in stats.items():
        if OURS in func[0]:
            own.setdefault(func, [0, 0.0])
            own[func][0] += nc
            own[func][1] += tt
        elif func[0] == "~":  # a builtin: its time goes to the function of ours that called it
            for caller, c in callers.items():
                if OURS in caller[0]:
                    own.setdefault(caller, [0, 0.0])
                    own[caller][1] += c[2]
    rows = [{"function": f"{Path(f[0]).parent.name}/{Path(f[0]).name}:{f[1]} {f[2]}", "calls": n, "own_s": t}
            for f, (n, t) in own.items()]
    return sorted(rows, key=lambda r: -r["own_s"])


def profile_report(prof_dir: Path, requests: int) -> dict:
    """Per process of the server: our functions' calls and own CPU time, per request and per engine step."""
    out, loaded = {}, {}
    for path in sorted(prof_dir.glob("*.snap")):
        stats = loaded[path] = _load_prof(path)
    steps = max((_count(s, "step", "v1/engine/core.py") + _count(s, "step_with_batch_queue", "v1/engine/core.py")
                 for s in loaded.values()), default=0)
    for path, stats in loaded.items():
        role = _role(stats)
        if role == "other":
            continue
        total = sum(v[2] for v in stats.values())
        rows = _ours(stats)
        mine = sum(r["own_s"] for r in rows)
        out.setdefault(role, []).append({
            "pid": path.stem, "steps": steps, "requests": requests, "profiled_s": total, "ours_s": mine,
            "ours_share": mine / total if total else 0.0,
            "ours_us_per_request": 1e6 * mine / requests if requests else None,
            "ours_us_per_step": 1e6 * mine / steps if steps else None,
            "functions": rows[:40]})
    return out


def _print_profile(arm: str, report: dict) -> None:
    for role, procs in report.items():
        for p in procs:
            print(f"  [{arm}] {role} pid {p['pid']}: steps {p['steps']}, ours {1e3 * p['ours_s']:.1f} ms of "
                  f"{1e3 * p['profiled_s']:.0f} ms profiled ({100 * p['ours_share']:.2f}%), "
                  f"{p['ours_us_per_request']:.1f} us/request"
                  + (f", {p['ours_us_per_step']:.1f} us/step" if p["ours_us_per_step"] else ""))
            for r in p["functions"][:15]:
                per = f"{r['calls'] / p['requests']:.2f}/req" + (f", {r['calls'] / p['steps']:.2f}/step" if p["steps"] else "")
                print(f"      {r['calls']:7d} calls ({per})  {1e3 * r['own_s']:8.2f} ms  {r['function']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="stock,steer_capture")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny llama test fixture)")
    ap.add_argument("--gpu", action="store_true", help="no CPU env, no --enforce-eager")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--load-format", default=None, help="e.g. dummy for the A/B suite's weightless model directory")
    ap.add_argument("--gpu-mem", type=float, default=None, help="--gpu-memory-utilization")
    args = ap.parse_args()
    extra = (["--load-format", args.load_format] if args.load_format else []) + \
        (["--gpu-memory-utilization", str(args.gpu_mem)] if args.gpu_mem else [])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a `timeout` stops the server too (the finally below)
    model = args.model
    if model is None:
        from tests.fixtures.models import tiny_model

        model = str(tiny_model("llama"))
    work = Path(tempfile.mkdtemp(prefix="idle_cost_"))
    result: dict = {"args": vars(args), "rounds": []}
    arms = args.arms.split(",")
    for rnd in range(args.rounds):
        row = {}
        for arm in arms:
            prof = work / f"prof_{arm}_{rnd}" if args.profile else None
            server = Server(arm, model, args.gpu, work / f"{arm}_{rnd}.log", prof, extra)
            try:
                asyncio.run(load(server.base, model, args.warmup, args.concurrency, args.max_tokens, args.prompt_len))
                if prof is not None:  # count from here: drop what start-up and the warm-up ran
                    time.sleep(3)
                    for f in prof.glob("*.prof"):
                        f.rename(f.with_suffix(".warm"))
                m = asyncio.run(load(server.base, model, args.requests, args.concurrency, args.max_tokens,
                                     args.prompt_len))
                if prof is not None:
                    time.sleep(6)  # one more periodic dump after the load
                    warm = {f.stem: _load_prof(f) for f in prof.glob("*.warm")}
                    for f in prof.glob("*.prof"):
                        _subtract(f, f.with_suffix(".snap"), warm.get(f.stem))
                    m["profile"] = profile_report(prof, args.requests)
            finally:
                server.stop()
            row[arm] = m
            print(f"round {rnd} {arm}: TTFT {m['ttft_ms_median']:.1f} ms, TPOT {m['tpot_ms_median']:.2f} ms, "
                  f"E2E {m['e2e_ms_median']:.0f} ms, {m['output_tok_s']:.0f} tok/s", flush=True)
            if "profile" in m:
                _print_profile(arm, m["profile"])
        result["rounds"].append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"logs in {work}")


def _subtract(path: Path, dst: Path, before: dict | None) -> None:
    """Write to ``dst`` the profile of ``path`` less ``before`` (the same process's stats after the warm-up)."""
    now = _load_prof(path)
    before = before or {}
    out = {}
    for func, (cc, nc, tt, ct, callers) in now.items():
        b = before.get(func)
        if b is None:
            out[func] = (cc, nc, tt, ct, callers)
            continue
        calls = {k: tuple(x - y for x, y in zip(v, b[4].get(k, (0, 0, 0.0, 0.0)))) for k, v in callers.items()}
        out[func] = (cc - b[0], nc - b[1], tt - b[2], ct - b[3], calls)
    with open(dst, "wb") as fh:
        marshal.dump(out, fh)


if __name__ == "__main__":
    main()
