#!/usr/bin/env python3
"""A/B suite of vllm-steer through the OpenAI server path, in one entry point (issue 7).

Every arm talks HTTP to a real ``vllm.entrypoints.openai.api_server`` (or, on CPU, the same
server through ``python -m vllm_steer.launcher serve``) with a small async streaming client
(aiohttp, ``stream: true``, ``ignore_eos: true``, prompts of random token ids as a list of ints).

Servers (each its own process, all alive together so trials of different servers interleave):
  stock      VLLM_PLUGINS=none, no steer block
  disabled   VLLM_PLUGINS=steer, no steer block
  steer      VLLM_PLUGINS=steer, --additional-config '{"steer": {"max_configs": 272}}'
             serves every steered arm (enabled_idle, named_shared, all_steered_shared,
             per_request_n4, per_request_n16, k256): one start-up, one compile.
  steer_inline  the steer server with "apply": "inline" (plain torch ops that Inductor fuses
             into the neighbouring add+RMSNorm kernels): arms named ``<steered arm>_inline``
  eager      the steer server's exact config plus --enforce-eager (graph check only)
All servers share one VLLM_CACHE_ROOT (stock and disabled have the same compile key).

Phases (``--phases``, comma separated, run in this order):
  kernel  Triton kernel microbench vs index_select+add and vs a device-to-device copy (subprocess)
  ab      the A/B arms at concurrency 16 (--max-tokens) and the 256-wide load (stock/disabled/k256)
  sweep   max_tokens sweep for stock / enabled_idle / per_request_n16
  eager   per_request_n16 on the steer server vs the same arm on the --enforce-eager server
  start   only start servers (--servers), e.g. with --keep-servers before a later call
  graph   torch.profiler (vLLM's /start_profile) around a few requests on the stock, disabled and
          steer servers: counts kernels whose name contains "apply_steering"
Results: JSON under $OUT (written after every trial), a progress line per arm and trial.
``--report FILE...`` merges result JSONs into a markdown table (+ a PNG of the deltas).

GPU (vLLM + plugin installed, see bench/RESULTS.md):
    python3 bench/ab_suite.py --shape 8b --phases kernel,ab --keep-servers
    python3 bench/ab_suite.py --shape 8b --phases sweep,eager,graph --reuse-servers
CPU dry run (tiny model, tiny counts, eager, float32):
    .venv/bin/python bench/ab_suite.py --dry-run-cpu --phases ab,sweep,eager,graph
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ("pre_attn", "post_attn", "post_mlp")
SHAPES = {
    # Llama-3-8B shape (GQA 8 kv heads); weights are random (--load-format dummy)
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    # Llama-3.2-1B-like shape, for quick runs
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256),
    # CPU dry runs (vLLM CPU attention needs head_dim >= 32)
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=2048),
}
STEER_BLOCK = {"steer": {"max_configs": 272}}
STEER_SERVERS = {"steer": STEER_BLOCK, "eager": STEER_BLOCK,
                 "steer_inline": {"steer": {**STEER_BLOCK["steer"], "apply": "inline"}}}
MODULE_NAME = "ab_bench_module"
STATE_FILE = Path(tempfile.gettempdir()) / "vllm_steer_ab_servers.json"
T0 = time.time()


def log(*a) -> None:
    print(f"[ab {time.time() - T0:7.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------- model directory


def write_model_dir(path: Path, shape: dict, dtype: str) -> Path:
    """config.json (LlamaForCausalLM) + a word-level tokenizer covering the whole vocab (offline)."""
    if (path / ".complete").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab_n = shape["vocab"]
    bos, eos = vocab_n - 2, vocab_n - 1
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"],
        "vocab_size": vocab_n,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_n)}
    vocab.pop(f"t{bos}")
    vocab.pop(f"t{eos}")
    vocab["<s>"], vocab["</s>"] = bos, eos
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                      unk_token="t0", pad_token="</s>", model_max_length=8192)
    wrapped.save_pretrained(path)
    (path / ".complete").touch()
    return path


# --------------------------------------------------------------------------- servers


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw[:500].decode(errors="replace")


class Server:
    def __init__(self, name: str, port: int, args, model_dir: Path, workdir: Path):
        self.name, self.port, self.args, self.model_dir = name, port, args, model_dir
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "logs" / f"{name}.log"
        self.prof_dir = workdir / "prof" / name
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.start_s: float | None = None
        self.adopted = False
        self._t_start = time.time()

    def command(self) -> list[str]:
        a = self.args
        if a.launcher == "cpu":
            cmd = [sys.executable, "-m", "vllm_steer.launcher", "serve", str(self.model_dir)]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        cmd += [
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "bench",
            "--load-format", "dummy", "--dtype", a.dtype, "--seed", "0",
            "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
            "--disable-uvicorn-access-log",
        ]
        if a.launcher != "cpu":
            cmd += ["--gpu-memory-utilization", str(a.eager_gpu_mem if self.name == "eager" else a.gpu_mem)]
        if a.enforce_eager or self.name == "eager":
            cmd += ["--enforce-eager"]
        if self.name in STEER_SERVERS:
            cmd += ["--additional-config", json.dumps(STEER_SERVERS[self.name])]
        if a.profile_servers:
            cmd += ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": str(self.prof_dir),
                "torch_profiler_with_stack": False, "ignore_frontend": True,
                "torch_profiler_dump_cuda_time_total": False,
            })]
        return cmd

    def env(self) -> dict:
        e = dict(os.environ)
        e["VLLM_PLUGINS"] = "none" if self.name == "stock" else "steer"
        e["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        e["VLLM_CACHE_ROOT"] = self.args.cache_root
        e["TOKENIZERS_PARALLELISM"] = "false"
        e["HF_HUB_OFFLINE"] = "1"
        e["PYTHONUNBUFFERED"] = "1"
        if self.args.launcher == "cpu":
            e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            e.setdefault("VLLM_HOST_IP", "127.0.0.1")
        return e

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=3) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.prof_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        log(f"server {self.name}: starting on :{self.port}: {' '.join(cmd)}")
        self._t_start = time.time()
        self.proc = subprocess.Popen(cmd, env=self.env(), stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT))
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        t_end = time.time() + timeout
        while time.time() < t_end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.tail(60)}")
            if self.proc is None and not self.alive():
                raise RuntimeError(f"server {self.name} (adopted) exited:\n{self.tail(60)}")
            if self.healthy():
                self.start_s = round(time.time() - self._t_start, 1)
                log(f"server {self.name}: ready after {self.start_s} s")
                return
            time.sleep(1.0)
        raise RuntimeError(f"server {self.name} not ready after {timeout} s:\n{self.tail(60)}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            os.kill(self.pid, 0)
            return True
        except OSError:
            return False

    def stop(self) -> None:
        """SIGINT to the server's own process group (it started a new session), then escalate."""
        if not self.alive():
            return
        log(f"server {self.name}: stopping (pid {self.pid})")
        for sig, wait in ((signal.SIGINT, 40), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.pid, sig)
            except OSError:
                return
            t_end = time.time() + wait
            while time.time() < t_end:
                if self.proc is not None:
                    if self.proc.poll() is not None:
                        break
                elif not self.alive():
                    break
                time.sleep(0.5)
            else:
                continue
            break
        # the process group may still hold the engine core for a moment
        for _ in range(20):
            try:
                os.killpg(self.pid, 0)
            except OSError:
                return
            time.sleep(0.5)


class Pool:
    """Servers by name, started lazily (one after another: memory profiling must not overlap)."""

    def __init__(self, args, model_dir: Path, workdir: Path):
        self.args, self.model_dir, self.workdir = args, model_dir, workdir
        self.servers: dict[str, Server] = {}
        self.ports = {"stock": args.port_base, "disabled": args.port_base + 1, "steer": args.port_base + 2,
                      "eager": args.port_base + 3, "steer_inline": args.port_base + 4}
        self.pending: dict[str, Server] = {}
        if args.reuse_servers and STATE_FILE.exists():
            for name, st in json.loads(STATE_FILE.read_text()).items():
                s = Server(name, st["port"], args, model_dir, workdir)
                s.pid, s.start_s, s.adopted = st["pid"], st.get("start_s"), True
                s._t_start = st.get("t_start") or time.time()
                if s.alive() and s.healthy():
                    self.servers[name] = s
                    log(f"server {name}: adopted (pid {s.pid}, :{s.port})")
                elif s.alive():  # left while still starting: wait for it when needed
                    self.pending[name] = s
                    log(f"server {name}: adopted while starting (pid {s.pid}, :{s.port})")

    def ensure(self, names: list[str]) -> None:
        for name in names:
            if name not in self.servers:
                s = self.pending.pop(name, None)
                if s is None:
                    s = Server(name, self.ports[name], self.args, self.model_dir, self.workdir)
                    s.start()
                self.servers[name] = s
                self.save_state()  # a server still starting is adopted by the next --reuse-servers
                try:
                    s.wait_ready(self.args.start_timeout)
                except Exception:
                    self.servers.pop(name, None)
                    s.stop()
                    self.save_state()
                    raise
                self.save_state()

    def get(self, name: str) -> Server:
        self.ensure([name])
        return self.servers[name]

    def save_state(self) -> None:
        STATE_FILE.write_text(json.dumps({n: {"pid": s.pid, "port": s.port, "start_s": s.start_s,
                                              "t_start": getattr(s, "_t_start", None)}
                                          for n, s in self.servers.items() if s.alive()}))

    def stop_all(self) -> None:
        for s in list(self.servers.values())[::-1] + list(self.pending.values()):
            s.stop()
        STATE_FILE.unlink(missing_ok=True)


# --------------------------------------------------------------------------- request bodies


def steering_configs(n: int, seed: int, shape: dict, std: float, pack_dtype: str) -> list[dict]:
    """n distinct ``steering_vectors`` fields: all three hooks on every layer, packed binary."""
    import numpy as np

    from vllm_steer.client import pack

    rng = np.random.default_rng(seed)
    layers = list(range(shape["layers"]))
    out = []
    for _ in range(n):
        out.append({h: pack((rng.standard_normal((len(layers), shape["hidden"]), dtype=np.float32) * std),
                            layers, pack_dtype) for h in HOOKS})
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
    if kind == "per_request":
        cfgs = steering_configs(arm["n_configs"] or ctx["wide"], seed, ctx["shape"], ctx["std"], ctx["pack_dtype"])
        return [{"steering_vectors": cfgs[i % len(cfgs)]} for i in range(n_requests)]
    raise ValueError(kind)


def build_bodies(prompts, fields, max_tokens: int) -> list[bytes]:
    out = []
    for p, f in zip(prompts, fields):
        body = {"model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if f:
            body.update(f)
        out.append(json.dumps(body, separators=(",", ":")).encode())
    return out


# --------------------------------------------------------------------------- client


async def _one(session, url: str, body: bytes) -> dict:
    rec: dict = {}
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            first_t = None
            last_t = None
            first_obj = None
            last_payload = None
            n_events = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter()
                n_events += 1
                if first_t is None:
                    obj = json.loads(payload)
                    if obj.get("choices"):
                        first_t, first_obj = now, obj
                last_t, last_payload = now, payload
        t_end = time.perf_counter()
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return rec
    usage = None
    if last_payload is not None:
        try:
            usage = json.loads(last_payload).get("usage")
        except ValueError:
            pass
    if first_t is None or not usage:
        rec["error"] = f"no content or no usage (events={n_events})"
        return rec
    n_out = int(usage.get("completion_tokens") or 0)
    rec["ttft"] = first_t - t0
    rec["e2el"] = (last_t or t_end) - t0
    rec["tpot"] = (rec["e2el"] - rec["ttft"]) / (n_out - 1) if n_out > 1 else 0.0
    rec["out"] = n_out
    rec["prompt_tokens"] = usage.get("prompt_tokens")
    rec["events"] = n_events
    st = first_obj.get("steering")
    rec["steering"] = st if isinstance(st, dict) else None
    rec["t_start"], rec["t_end"] = t0, (last_t or t_end)
    return rec


async def _run_load(url: str, bodies: list[bytes], concurrency: int) -> tuple[list[dict], float, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=900, sock_connect=60)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    results: list[dict | None] = [None] * len(bodies)
    nxt = [0]
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def worker():
            while nxt[0] < len(bodies):
                i = nxt[0]
                nxt[0] += 1
                results[i] = await _one(session, url, bodies[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        t1 = time.perf_counter()
    return results, t0, t1  # type: ignore[return-value]


def run_load(server: Server, bodies: list[bytes], concurrency: int) -> tuple[list[dict], float]:
    res, t0, t1 = asyncio.run(_run_load(server.base + "/v1/completions", bodies, concurrency))
    ends = [r["t_end"] for r in res if "t_end" in r]
    wall = (max(ends) if ends else t1) - t0
    return res, wall


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize_trial(res: list[dict], wall: float, steered: bool) -> dict:
    ok = [r for r in res if "error" not in r]
    errs = [r["error"] for r in res if "error" in r]
    t = {
        "n": len(res), "ok": len(ok), "errors": errs[:3], "n_errors": len(errs),
        "wall_s": round(wall, 4),
        "output_tokens": sum(r["out"] for r in ok),
        "throughput": sum(r["out"] for r in ok) / wall if wall > 0 else float("nan"),
    }
    for m in ("ttft", "tpot", "e2el"):
        xs = [r[m] * 1e3 for r in ok]  # ms
        t[f"{m}_median_ms"] = statistics.median(xs) if xs else float("nan")
        t[f"{m}_p99_ms"] = pct(xs, 0.99)
    good = [r for r in ok if r.get("steering") and r["steering"].get("prefill") and r["steering"].get("decode")]
    t["steering_applied"] = len(good)
    t["steering_expected"] = len(res) if steered else 0
    t["unexpected_steering"] = 0 if steered else sum(1 for r in ok if r.get("steering"))
    t["per_request"] = {m: [round(r[m] * 1e3, 3) for r in ok] for m in ("ttft", "tpot", "e2el")}
    return t


# --------------------------------------------------------------------------- arms

ARMS = {
    "stock": dict(server="stock", kind="plain"),
    "disabled": dict(server="disabled", kind="plain"),
    "enabled_idle": dict(server="steer", kind="plain"),
    "named_shared": dict(server="steer", kind="module"),
    "all_steered_shared": dict(server="steer", kind="shared"),
    "per_request_n4": dict(server="steer", kind="per_request", n_configs=4),
    "per_request_n16": dict(server="steer", kind="per_request", n_configs=16),
    # the wide load: 256 requests at concurrency 256
    "stock_c256": dict(server="stock", kind="plain", wide=True),
    "disabled_c256": dict(server="disabled", kind="plain", wide=True),
    "k256": dict(server="steer", kind="per_request", n_configs=None, wide=True),  # --wide distinct configs
    # graph check: the same steered arm on the --enforce-eager server
    "eager_per_request_n16": dict(server="eager", kind="per_request", n_configs=16),
}
for _arm in [a for a, v in ARMS.items() if v["server"] == "steer"]:
    ARMS[f"{_arm}_inline"] = {**ARMS[_arm], "server": "steer_inline"}
AB_ARMS = ["stock", "disabled", "enabled_idle", "named_shared", "all_steered_shared", "per_request_n4",
           "per_request_n16", "stock_c256", "disabled_c256", "k256"]
SWEEP_ARMS = ["stock", "enabled_idle", "per_request_n16"]


def ensure_module(server: Server, ctx: dict) -> None:
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
    import hashlib

    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def one_run(pool: Pool, arm_name: str, load: dict, trial: int, phase: str, ctx: dict, warmup: bool = False) -> dict:
    arm = ARMS[arm_name]
    server = pool.get(arm["server"])
    if arm["kind"] == "module":
        ensure_module(server, ctx)
    n, conc, mt = load["requests"], load["concurrency"], load["max_tokens"]
    if warmup:
        n, mt = min(n, load["concurrency"], 32) if not arm.get("wide") else n, min(mt, 8)
    tag = "warmup" if warmup else f"t{trial}"
    prompts = make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of(phase, arm_name, tag, mt))
    fields = arm_fields(arm, n, seed_of(phase, arm_name, tag, "vec"), ctx)
    bodies = build_bodies(prompts, fields, mt)
    res, wall = run_load(server, bodies, conc)
    t = summarize_trial(res, wall, arm["kind"] != "plain")
    t["body_bytes_mean"] = int(sum(map(len, bodies)) / len(bodies))
    return t


def check_steering(t: dict, arm_name: str) -> str | None:
    steered = ARMS[arm_name]["kind"] != "plain"
    if t["n_errors"]:
        return f"{t['n_errors']} request errors, e.g. {t['errors'][:1]}"
    if steered and t["steering_applied"] != t["n"]:
        return f"steering field missing/null on {t['n'] - t['steering_applied']} of {t['n']} responses"
    if not steered and t["unexpected_steering"]:
        return f"{t['unexpected_steering']} unsteered responses carry a steering field"
    return None


def progress(phase: str, label: str, trial: int, trials: int, t: dict) -> None:
    log(f"[{phase}] trial {trial + 1}/{trials} {label:<28} tput {t['throughput']:9.1f} tok/s | "
        f"TTFT med {t['ttft_median_ms']:8.2f} p99 {t['ttft_p99_ms']:8.2f} ms | "
        f"TPOT med {t['tpot_median_ms']:7.3f} p99 {t['tpot_p99_ms']:7.3f} ms | "
        f"E2EL med {t['e2el_median_ms']:9.1f} ms | steering {t['steering_applied']}/{t['steering_expected']}"
        f" | err {t['n_errors']} | {t['wall_s']:.2f} s")


def run_matrix(pool: Pool, phase: str, runs: list[tuple[str, str, dict]], trials: int, ctx: dict,
               results: dict, save) -> None:
    """runs: (label, arm, load). Warm-up + steering check per run, then trials interleaved
    (the order rotates every trial)."""
    res = results.setdefault(phase, {})
    live = []
    for label, arm, load in runs:
        entry = res.setdefault(label, {"arm": arm, "load": load, "trials": []})
        try:
            if ARMS[arm]["server"] not in pool.servers:
                pool.ensure([ARMS[arm]["server"]])
            t = one_run(pool, arm, load, 0, phase, ctx, warmup=True)
            problem = check_steering(t, arm)
            entry["warmup"] = {k: v for k, v in t.items() if k != "per_request"}
            if problem:
                entry["failed"] = f"warm-up check: {problem}"
                log(f"[{phase}] {label}: FAILED warm-up check: {problem}")
                continue
            log(f"[{phase}] {label}: warm-up ok ({t['n']} requests, steering {t['steering_applied']}/"
                f"{t['steering_expected']}, body {t['body_bytes_mean']} B)")
            live.append((label, arm, load))
        except Exception as e:  # noqa: BLE001
            entry["failed"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"[{phase}] {label}: FAILED: {entry['failed']}")
        save()
    est: dict[str, float] = {}
    for trial in range(trials):
        k = trial % max(1, len(live))
        order = live[k:] + live[:k]
        for label, arm, load in order:
            need = est.get(label, 5.0) * 1.3 + ctx["reserve_s"]
            if time.time() - T0 + need > ctx["deadline_s"]:
                log(f"[{phase}] {label}: skipping trial {trial + 1} (deadline)")
                res[label].setdefault("skipped_trials", []).append(trial)
                continue
            t_start = time.time()
            try:
                t = one_run(pool, arm, load, trial, phase, ctx)
            except Exception as e:  # noqa: BLE001
                res[label].setdefault("run_errors", []).append(f"{type(e).__name__}: {e}"[:500])
                log(f"[{phase}] {label}: trial {trial + 1} error {e}")
                continue
            est[label] = time.time() - t_start
            problem = check_steering(t, arm)
            if problem:
                t["check"] = problem
            res[label]["trials"].append(t)
            progress(phase, label, trial, trials, t)
            save()


# --------------------------------------------------------------------------- stats / report

METRICS = [("throughput", "tok/s"), ("ttft_median_ms", "ms"), ("ttft_p99_ms", "ms"), ("tpot_median_ms", "ms"),
           ("tpot_p99_ms", "ms"), ("e2el_median_ms", "ms"), ("e2el_p99_ms", "ms")]


def mean_sem(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    s = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return m, s


def arm_stats(entry: dict) -> dict:
    trials = [t for t in entry.get("trials", []) if not t.get("check")]
    return {m: mean_sem([t[m] for t in trials]) for m, _ in METRICS} | {"n_trials": len(trials)}


def delta(a: tuple, b: tuple) -> dict:
    (ma, sa), (mb, sb) = a, b
    d = ma - mb
    se = math.sqrt((sa if sa == sa else 0) ** 2 + (sb if sb == sb else 0) ** 2)
    return {"delta": d, "pct": 100 * d / mb if mb else float("nan"), "se": se,
            "se_pct": 100 * se / mb if mb else float("nan"), "significant": abs(d) > 2 * se if se > 0 else False}


def reference_label(phase: str, label: str, entry: dict) -> str | None:
    phase = phase.split("#")[0]
    if phase == "ab":
        return "stock_c256" if ARMS[entry["arm"]].get("wide") else "stock"
    if phase == "sweep":
        return "stock@" + label.split("@")[1]
    if phase == "eager":
        return "per_request_n16@eager_ref"
    return None


def fmt(m: float, s: float, nd: int = 2) -> str:
    if m != m:
        return "—"
    return f"{m:.{nd}f} ± {s:.{nd}f}" if s == s else f"{m:.{nd}f}"


def fmt_delta(d: dict, unit: str) -> str:
    if d["delta"] != d["delta"]:
        return "—"
    mark = " **\\***" if d["significant"] else ""
    nd = 1 if unit == "tok/s" else 2
    return f"{d['delta']:+.{nd}f} ({d['pct']:+.2f}% ± {d['se_pct']:.2f}){mark}"


def report(paths: list[str], md_path: str | None, png_path: str | None) -> str:
    merged: dict = {"phases": {}, "meta": []}
    for p in paths:
        d = json.loads(Path(p).read_text())
        merged["meta"].append(d.get("meta", {}))
        for ph, v in d.get("phases", {}).items():
            name, k = ph, 2
            while name in merged["phases"] and set(v) & set(merged["phases"][name]):
                name, k = f"{ph}#{k}", k + 1  # same arms again (another run): keep it apart
            merged["phases"].setdefault(name, {}).update(v)
    lines: list[str] = []
    deltas_for_plot: list[tuple[str, dict]] = []
    order = [ph for ph in merged["phases"] if ph.split("#")[0] in ("ab", "sweep", "eager")]
    for ph in sorted(order, key=lambda x: (["ab", "sweep", "eager"].index(x.split("#")[0]), x)):
        arms = merged["phases"].get(ph)
        if not arms:
            continue
        lines.append(f"\n#### Phase `{ph}`\n")
        lines.append("| arm | trials | output tok/s | TTFT med ms | TTFT p99 ms | TPOT med ms | TPOT p99 ms "
                     "| E2EL med ms | E2EL p99 ms |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        stats = {label: arm_stats(e) for label, e in arms.items()}
        for label, e in arms.items():
            s = stats[label]
            if e.get("failed"):
                lines.append(f"| {label} | FAILED: {e['failed'][:120]} | | | | | | | |")
                continue
            cells = [fmt(*s["throughput"], 1)] + [fmt(*s[m]) for m, _ in METRICS[1:]]
            lines.append(f"| {label} | {s['n_trials']} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("Deltas against the reference arm (mean of per-trial values; ± is the combined SEM; "
                     "**\\*** marks |Δ| > 2·SE):\n")
        lines.append("| arm | vs | Δ output tok/s | Δ TTFT med ms | Δ TPOT med ms | Δ TPOT p99 ms | Δ E2EL med ms "
                     "| Δ E2EL p99 ms |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for label, e in arms.items():
            ref = reference_label(ph, label, e)
            if ref is None or ref == label or ref not in stats or e.get("failed") or not stats[label]["n_trials"]:
                continue
            s, r = stats[label], stats[ref]
            ds = {m: delta(s[m], r[m]) for m, _ in METRICS}
            if not ph.startswith("eager"):  # the eager check compares against the graphed arm, not stock
                deltas_for_plot.append((f"{ph}:{label}", ds))
            lines.append(f"| {label} | {ref} | " + " | ".join(
                fmt_delta(ds[m], u) for m, u in METRICS if m not in ("ttft_p99_ms",)) + " |")
            e["_deltas"] = ds
        if ph.startswith("ab") and "k256" in stats and "disabled_c256" in stats:
            k, dd = stats["k256"]["throughput"], stats["disabled_c256"]["throughput"]
            if k[0] == k[0] and dd[0]:
                ratio = k[0] / dd[0]
                lines.append(f"\nk256 / disabled_c256 output throughput: {ratio * 100:.1f}%")
    g = merged["phases"].get("graph")
    if g:
        lines.append("\n#### Phase `graph` (torch.profiler via /start_profile, kernels in the window)\n")
        lines.append("| server / requests | kernels | apply_steering kernels | apply_steering GPU µs | all kernels GPU µs "
                     "| cudaGraphLaunch calls | /v1/steering ops |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for label, e in g.items():
            if "error" in e:
                lines.append(f"| {label} | error: {e['error'][:100]} | | | | | |")
                continue
            lines.append(f"| {label} | {e.get('kernels')} | {e.get('steer_kernels')} | {e.get('steer_kernel_us')} | "
                         f"{e.get('kernel_us')} | {e.get('graph_launches')} | {e.get('status_ops')} |")
    kb = merged["phases"].get("kernel")
    if kb and kb.get("rows"):
        lines.append(f"\n#### Phase `kernel` (bf16, all tokens steered, table of {kb.get('rows_in_table')} rows; "
                     f"copy bandwidth {kb.get('copy_GBps')} GB/s)\n")
        lines.append("| N | D | fused µs | fused GB/s | % of copy | fused (CUDA graph) µs | unfused µs | unfused GB/s "
                     "| fused speed-up |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in kb["rows"]:
            lines.append(f"| {r['N']} | {r['D']} | {r['fused_us']:.2f} | {r['fused_GBps']:.0f} | "
                         f"{r['fused_pct_copy']:.1f}% | {r.get('fused_graph_us', float('nan')):.2f} | "
                         f"{r['unfused_us']:.2f} | {r['unfused_GBps']:.0f} | {r['unfused_us'] / r['fused_us']:.2f}x |")
    text = "\n".join(lines) + "\n"
    if md_path:
        Path(md_path).write_text(text)
    if png_path and deltas_for_plot:
        plot(deltas_for_plot, png_path)
    return text


def plot(deltas: list[tuple[str, dict]], png_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    panels = [("throughput", "Δ output throughput (%)"), ("tpot_median_ms", "Δ TPOT median (%)"),
              ("e2el_median_ms", "Δ E2EL median (%)"), ("ttft_median_ms", "Δ TTFT median (ms)")]
    labels = [l for l, _ in deltas]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.35 * len(labels) + 2), sharey=True)
    for ax, (m, title) in zip(axes, panels):
        ys = range(len(labels))
        if m == "ttft_median_ms":
            vals = [d[m]["delta"] for _, d in deltas]
            errs = [2 * d[m]["se"] for _, d in deltas]
        else:
            vals = [d[m]["pct"] for _, d in deltas]
            errs = [2 * d[m]["se_pct"] for _, d in deltas]
        colors = ["tab:red" if d[m]["significant"] else "tab:gray" for _, d in deltas]
        ax.barh(list(ys), vals, xerr=errs, color=colors, capsize=2)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)))
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("vllm-steer vs stock (bars: mean delta; whiskers: 2·SE; red: |Δ| > 2·SE)", fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    log(f"plot written: {png_path}")


# --------------------------------------------------------------------------- graph check (profiler)


def parse_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        tr = json.load(f)
    ev = [e for e in tr.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    kern = [e for e in ev if e.get("cat") == "kernel"]
    steer_k = [e for e in kern if "apply_steering" in e.get("name", "")]
    graph_k = [e for e in kern if any("graph" in str(k).lower() for k in (e.get("args") or {}))]
    steer_any = [e for e in ev if "apply_steering" in e.get("name", "")]
    top: dict[str, float] = {}
    for e in kern:
        top[e["name"][:80]] = top.get(e["name"][:80], 0.0) + float(e.get("dur", 0))
    host: dict[str, list] = {}
    for e in ev:
        if e.get("cat") in ("user_annotation", "python_function", "cpu_op") and e.get("cat") != "kernel":
            h = host.setdefault(f"{e.get('cat')}:{e.get('name', '')[:70]}", [0, 0.0])
            h[0] += 1
            h[1] += float(e.get("dur", 0))
    span = 0.0
    if kern:
        span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kern) - min(float(e["ts"]) for e in kern)
    return {
        "trace": path.name,
        "kernels": len(kern),
        "kernel_us": round(sum(float(e.get("dur", 0)) for e in kern), 1),
        "steer_kernels": len(steer_k),
        "steer_kernel_us": round(sum(float(e.get("dur", 0)) for e in steer_k), 1),
        "steer_events_any_category": len(steer_any),
        "graph_kernels": len(graph_k),
        "graph_launches": sum(1 for e in ev if e.get("name") == "cudaGraphLaunch"),
        "top_kernels_us": sorted(((round(v, 1), k) for k, v in top.items()), reverse=True)[:12],
        "gpu_span_us": round(span, 1),
        "top_host_us": sorted(((round(v[1], 1), v[0], k) for k, v in host.items()), reverse=True)[:25],
    }


def graph_phase(pool: Pool, ctx: dict, results: dict, save) -> None:
    res = results.setdefault("graph", {})
    plan = [("stock / unsteered", "stock", "plain"), ("disabled / unsteered", "disabled", "plain"),
            ("steer / unsteered (enabled_idle)", "steer", "plain"),
            ("steer / per_request_n4", "steer", "per_request"),
            ("steer_inline / unsteered (enabled_idle_inline)", "steer_inline", "plain"),
            ("steer_inline / per_request_n4", "steer_inline", "per_request")]
    for label, sname, kind in [p for p in plan if p[1] in ctx["graph_servers"]]:
        try:
            server = pool.get(sname)
            before = set(server.prof_dir.rglob("*.json*"))
            n, mt = 4, 16
            prompts = make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of("graph", label))
            fields = arm_fields({"kind": kind, "n_configs": 4}, n, seed_of("graph", label, "v"), ctx)
            bodies = build_bodies(prompts, fields, mt)
            run_load(server, bodies, n)  # warm: rows resident, nothing new compiled in the window
            fields = arm_fields({"kind": kind, "n_configs": 4}, n, seed_of("graph", label, "v2"), ctx)
            bodies = build_bodies(make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"],
                                               seed_of("graph", label, 2)), fields, mt)
            st, _ = http_json("POST", server.base + "/start_profile", timeout=120)
            if st != 200:
                raise RuntimeError(f"/start_profile -> {st}")
            out, _wall = run_load(server, bodies, n)
            st, _ = http_json("POST", server.base + "/stop_profile", timeout=300)
            t_end = time.time() + 120
            new: list[Path] = []
            while time.time() < t_end:
                new = [p for p in server.prof_dir.rglob("*.json*") if p not in before]
                if new and all(p.stat().st_size > 0 for p in new):
                    time.sleep(1.0)
                    break
                time.sleep(1.0)
            if not new:
                raise RuntimeError(f"no trace file under {server.prof_dir}")
            rec = parse_trace(max(new, key=lambda p: p.stat().st_size))
            rec["requests_steered"] = sum(1 for r in out if r.get("steering"))
            stcode, status = http_json("GET", server.base + "/v1/steering")
            rec["status_http"] = stcode
            if stcode == 200 and isinstance(status, dict):
                ws = status.get("workers") or [{}]
                rec["status_ops"] = ws[0].get("ops")
                rec["status_enabled"] = status.get("enabled")
            else:
                rec["status_ops"] = f"HTTP {stcode}"
            res[label] = rec
            log(f"[graph] {label}: kernels {rec['kernels']}, apply_steering kernels {rec['steer_kernels']} "
                f"({rec['steer_kernel_us']} µs of {rec['kernel_us']} µs), any-category steer events "
                f"{rec['steer_events_any_category']}, cudaGraphLaunch {rec['graph_launches']}, "
                f"graph kernels {rec['graph_kernels']}, /v1/steering ops {rec['status_ops']}")
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            log(f"[graph] {label}: error {e}")
        save()


# --------------------------------------------------------------------------- kernel microbench


def kernel_worker(out_path: str, quick: bool) -> None:
    import torch
    import triton.testing

    from vllm_steer.kernels.apply_steering.triton import apply_steering_triton

    dev = torch.cuda.get_device_name()
    # copy bandwidth: a large device-to-device copy, bytes read + written
    src = torch.randn(512 * 1024 * 1024 // 2, device="cuda", dtype=torch.bfloat16)  # 512 MiB... x2 bytes
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_GBps = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
    del src, dst
    R = 272
    rows = []
    Ns = (1, 16, 256, 2048, 8192) if not quick else (1, 256, 2048)
    Ds = (2048, 4096, 8192) if not quick else (2048, 4096)
    for d in Ds:
        table = torch.randn(R, d, device="cuda", dtype=torch.bfloat16)
        table[0].zero_()
        for n in Ns:
            hidden = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
            index = torch.randint(1, R, (n,), device="cuda", dtype=torch.int32)
            active = torch.ones(1, dtype=torch.uint8, device="cuda")
            # correctness on fresh inputs before timing
            ref = hidden.float() + table.float().index_select(0, index.long())
            h2 = hidden.clone()
            apply_steering_triton(h2, table, index, active)
            err = ((h2.float() - ref).norm() / ref.norm()).item()
            idx_l = index.long()

            def fused():
                apply_steering_triton(hidden, table, index, active)

            def unfused():
                hidden.add_(table.index_select(0, idx_l))

            f_ms = triton.testing.do_bench(fused, warmup=25, rep=100, return_mode="median")
            u_ms = triton.testing.do_bench(unfused, warmup=25, rep=100, return_mode="median")
            try:
                g_ms = triton.testing.do_bench_cudagraph(fused, rep=100, return_mode="median")
            except Exception:  # noqa: BLE001
                g_ms = float("nan")
            byts = 3 * n * d * 2
            rec = {"N": n, "D": d, "rel_err": err,
                   "fused_us": f_ms * 1e3, "unfused_us": u_ms * 1e3, "fused_graph_us": g_ms * 1e3,
                   "fused_GBps": byts / (f_ms * 1e-3) / 1e9, "unfused_GBps": byts / (u_ms * 1e-3) / 1e9,
                   "fused_graph_GBps": byts / (g_ms * 1e-3) / 1e9 if g_ms == g_ms else float("nan")}
            rec["fused_pct_copy"] = 100 * rec["fused_GBps"] / copy_GBps
            rec["fused_graph_pct_copy"] = 100 * rec["fused_graph_GBps"] / copy_GBps
            rows.append(rec)
            print(f"[kernel] N={n:5d} D={d:5d} fused {rec['fused_us']:8.2f} us ({rec['fused_GBps']:7.0f} GB/s, "
                  f"{rec['fused_pct_copy']:5.1f}% of copy) graph {rec['fused_graph_us']:7.2f} us | unfused "
                  f"{rec['unfused_us']:8.2f} us | rel err {err:.1e}", flush=True)
    Path(out_path).write_text(json.dumps({"gpu": dev, "copy_GBps": round(copy_GBps, 1), "rows_in_table": R,
                                          "bytes_model": "3*N*D*2 (read hidden, read table row, write hidden)",
                                          "rows": rows}))


def kernel_phase(args, results: dict, save) -> None:
    tmp = Path(tempfile.mkdtemp()) / "kernel.json"
    cmd = [sys.executable, __file__, "--kernel-worker", str(tmp)] + (["--quick-kernel"] if args.quick_kernel else [])
    try:
        subprocess.run(cmd, check=True, timeout=args.kernel_timeout)
        results["kernel"] = json.loads(tmp.read_text())
    except Exception as e:  # noqa: BLE001
        results["kernel"] = {"error": f"{type(e).__name__}: {e}"}
        log("[kernel] error", e)
    save()


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="ab")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--model-dir", help="use this model directory (config + tokenizer) instead of writing one")
    ap.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--pack-dtype", default=None, help="dtype of the packed request vectors (default: model dtype)")
    ap.add_argument("--launcher", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--enforce-eager", action="store_true", help="all servers eager (CPU dry runs)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="tiny model, tiny counts, CPU launcher, eager, float32")
    ap.add_argument("--arms", default=",".join(AB_ARMS), help="arms of the ab phase")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="requests per trial at concurrency --concurrency")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--wide", type=int, default=256, help="requests = concurrency = configs of the wide load")
    ap.add_argument("--wide-max-tokens", type=int, default=128)
    ap.add_argument("--sweep", default="64,256,1024")
    ap.add_argument("--sweep-requests", type=int, default=32)
    ap.add_argument("--sweep-trials", type=int, default=3)
    ap.add_argument("--eager-max-tokens", type=int, default=64)
    ap.add_argument("--eager-trials", type=int, default=2)
    ap.add_argument("--std", type=float, default=0.05, help="std of the steering vectors' entries")
    ap.add_argument("--gpu-mem", type=float, default=0.24, help="gpu_memory_utilization per server")
    ap.add_argument("--eager-gpu-mem", type=float, default=0.20, help="gpu_memory_utilization of the eager server")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--port-base", type=int, default=8100)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--cache-root", default=str(Path(tempfile.gettempdir()) / "vllm_steer_ab_cache"))
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "vllm_steer_ab"))
    ap.add_argument("--no-profile-servers", dest="profile_servers", action="store_false",
                    help="do not pass --profiler-config (then the graph phase cannot run)")
    ap.add_argument("--keep-servers", action="store_true", help="leave the servers running (own sessions)")
    ap.add_argument("--reuse-servers", action="store_true", help="adopt servers left by --keep-servers")
    ap.add_argument("--servers", default="stock,disabled,steer", help="servers the start phase starts")
    ap.add_argument("--graph-servers", default="stock,disabled,steer,steer_inline",
                    help="servers the graph phase profiles")
    ap.add_argument("--stop-servers", default="", help="stop these servers (names) before the phases")
    ap.add_argument("--deadline-s", type=float, default=560, help="skip trials that would end after this")
    ap.add_argument("--reserve-s", type=float, default=25)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--quick-kernel", action="store_true")
    ap.add_argument("--kernel-timeout", type=float, default=240)
    ap.add_argument("--kernel-worker", help=argparse.SUPPRESS)
    ap.add_argument("--report", nargs="+", help="merge result JSONs into markdown (--md) and a PNG (--png)")
    ap.add_argument("--md")
    ap.add_argument("--png")
    args = ap.parse_args()

    if args.kernel_worker:
        kernel_worker(args.kernel_worker, args.quick_kernel)
        return 0
    if args.report:
        print(report(args.report, args.md, args.png))
        return 0

    if args.dry_run_cpu:
        args.shape, args.launcher, args.enforce_eager = "tiny", "cpu", True
        args.dtype = args.dtype or "float32"
        args.trials, args.requests, args.concurrency, args.max_tokens, args.prompt_len = 2, 4, 2, 6, 16
        args.wide, args.wide_max_tokens, args.sweep, args.sweep_requests, args.sweep_trials = 6, 4, "4,8", 2, 2
        args.eager_max_tokens, args.eager_trials, args.max_model_len, args.max_num_seqs = 6, 1, 256, 16
        args.start_timeout = max(args.start_timeout, 600)
        args.deadline_s = max(args.deadline_s, 3600)
    args.dtype = args.dtype or "bfloat16"
    args.pack_dtype = args.pack_dtype or args.dtype
    shape = SHAPES[args.shape]
    out = Path(os.environ.get("OUT") or (ROOT / "bench" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    out_json = out / f"ab_{args.tag}.json"
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    phases = [p for p in args.phases.split(",") if p]

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "shape": args.shape, **shape,
            "dtype": args.dtype, "pack_dtype": args.pack_dtype, "steer_blocks": STEER_SERVERS,
            "launcher": args.launcher}
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001
        meta["vllm"] = f"import failed: {e}"
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001
        pass
    results: dict = {}

    def save() -> None:
        doc = {"meta": meta, "phases": results}
        tmp = out_json.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, default=str))
        os.replace(tmp, out_json)

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        model_dir = write_model_dir(workdir / f"model-{args.shape}-{args.dtype}", shape, args.dtype)
    meta["model_dir"] = str(model_dir)
    ctx = {"shape": shape, "std": args.std, "pack_dtype": args.pack_dtype, "prompt_len": args.prompt_len,
           "deadline_s": args.deadline_s, "reserve_s": args.reserve_s, "modules_done": set(), "wide": args.wide,
           "graph_servers": args.graph_servers.split(",")}
    log(f"phases {phases}; shape {args.shape} {shape}; dtype {args.dtype}; results -> {out_json}")

    pool = Pool(args, model_dir, workdir)
    for name in [s for s in args.stop_servers.split(",") if s]:
        if name in pool.servers:
            pool.servers.pop(name).stop()
            pool.save_state()
    rc = 0
    try:
        c16 = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens}
        wide = {"requests": args.wide, "concurrency": args.wide, "max_tokens": args.wide_max_tokens}
        for ph in phases:
            if ph == "kernel":
                kernel_phase(args, results, save)
            elif ph == "ab":
                arms = [a for a in args.arms.split(",") if a]
                need = []
                for a in arms:
                    if ARMS[a]["server"] not in need:
                        need.append(ARMS[a]["server"])
                pool.ensure(need)
                runs = [(a, a, wide if ARMS[a].get("wide") else c16) for a in arms]
                run_matrix(pool, "ab", runs, args.trials, ctx, results, save)
            elif ph == "sweep":
                pool.ensure([ARMS[a]["server"] for a in SWEEP_ARMS])
                runs = []
                for mt in [int(x) for x in args.sweep.split(",")]:
                    load = {"requests": args.sweep_requests, "concurrency": args.concurrency, "max_tokens": mt}
                    runs += [(f"{a}@mt{mt}", a, load) for a in SWEEP_ARMS]
                run_matrix(pool, "sweep", runs, args.sweep_trials, ctx, results, save)
            elif ph == "eager":
                pool.ensure(["steer", "eager"])
                load = {"requests": args.concurrency, "concurrency": args.concurrency,
                        "max_tokens": args.eager_max_tokens}
                runs = [("per_request_n16@eager_ref", "per_request_n16", load),
                        ("eager_per_request_n16", "eager_per_request_n16", load)]
                run_matrix(pool, "eager", runs, args.eager_trials, ctx, results, save)
            elif ph == "graph":
                graph_phase(pool, ctx, results, save)
            elif ph == "start":
                pool.ensure([s for s in args.servers.split(",") if s])
            else:
                raise SystemExit(f"unknown phase {ph}")
        meta["server_start_s"] = {n: s.start_s for n, s in pool.servers.items()}
    except Exception:  # noqa: BLE001
        rc = 1
        results["error"] = traceback.format_exc()[-4000:]
        log(results["error"])
    finally:
        meta["server_start_s"] = {n: s.start_s for n, s in pool.servers.items()}
        meta["server_log_tails"] = {n: s.tail(25) for n, s in pool.servers.items()}
        meta["elapsed_s"] = round(time.time() - T0, 1)
        save()
        if args.keep_servers:
            pool.save_state()
            log(f"servers kept: {list(pool.servers)} (state {STATE_FILE})")
        else:
            pool.stop_all()
    try:
        print(report([str(out_json)], str(out / f"ab_{args.tag}.md"), str(out / f"ab_{args.tag}.png")))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    log(f"done in {time.time() - T0:.0f} s; results {out_json}")
    return rc


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except SystemExit as e:  # --help, argparse errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
