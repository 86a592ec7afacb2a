"""Running arms: the streaming client (TTFT: first event with choices; E2EL: last event; TPOT: (E2EL - TTFT) /
(tokens - 1)), the warm-up steering check, interleaved trials (record ``trial`` k pairs with the reference's k),
and the ``graph`` phase (torch.profiler around a few requests per server, read by tests/gpu_e2e/trace_kernels.py;
GRAPH_LOADS picks its rows: ``decode`` GRAPH_PLAN, ``prefill`` PREFILL_GRAPH_PLAN, the prefill arms' load)."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import math
import os
import re
import shutil
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

from .arms import (ARMS, PREFILL_LOAD, arm_fields, arm_modules, build_bodies, expects_steering_field, make_prompts,
                   seed_of)
from .servers import CAPTURE_FS_DIR, CAPTURE_FS_NOSYNC_DIR, EXTRACT_DIR, T0, log, server_unavailable

GRAPH_PLAN = [  # (label, server, kind of traffic, requests: each its own config for a steered kind)
    ("stock / unsteered", "stock", "plain", 4), ("disabled / unsteered", "disabled", "plain", 4),
    ("steer / unsteered (enabled_idle)", "steer", "plain", 4), ("steer / per_request_n4", "steer", "per_request", 4),
    ("sae / unsteered (sae_idle)", "sae", "plain", 4), ("sae_full / unsteered (sae_full_idle)", "sae_full", "plain", 4),
    ("steer_cond / unsteered (cond_idle)", "steer_cond", "plain", 4), ("steer_cond / cond_n4", "steer_cond", "cond", 4),
    ("steer_proj / unsteered (project_idle)", "steer_proj", "plain", 4),
    ("steer_proj / project_n4", "steer_proj", "project", 4),
    ("steer_capture / unsteered (capture_idle)", "steer_capture", "plain", 4),
    ("steer_capture / capturing (capture_gen)", "steer_capture", "capture", 4),
    # the A/B's concurrency (issue 38: project_n16 vs per_request_n16), each beside its idle server at the same batch
    ("stock / unsteered n16", "stock", "plain", 16), ("steer / unsteered n16 (enabled_idle)", "steer", "plain", 16),
    ("steer / per_request_n16", "steer", "per_request", 16),
    ("steer_proj / unsteered n16 (project_idle)", "steer_proj", "plain", 16),
    ("steer_proj / project_n16", "steer_proj", "project", 16),
    # the same on the late kernel path (servers steer_late / steer_proj_late: VLLM_STEER_NORM_EARLY=0)
    ("steer_late / unsteered n16 (enabled_idle_late)", "steer_late", "plain", 16),
    ("steer_late / per_request_n16_late", "steer_late", "per_request", 16),
    ("steer_proj_late / unsteered n16 (project_idle_late)", "steer_proj_late", "plain", 16),
    ("steer_proj_late / project_n16_late", "steer_proj_late", "project", 16),
    # issue 43 (QUANT=fp8): steer without the norm + FP8 quant fused back (VLLM_STEER_FP8_NORM_QUANT=0)
    ("steer_fp8u / unsteered n16 (enabled_idle_fp8u)", "steer_fp8u", "plain", 16),
    ("steer_fp8u / per_request_n16_fp8u", "steer_fp8u", "per_request", 16),
    # issue 40 (arfuse, TP=2 with FlashInfer): stock without vLLM's all-reduce + RMSNorm fusion, beside stock and steer
    ("stock_nofuse / unsteered", "stock_nofuse", "plain", 4),
    ("stock_nofuse / unsteered n16", "stock_nofuse", "plain", 16),
    ("steer_arnorm / unsteered n16 (enabled_idle_arnorm)", "steer_arnorm", "plain", 16),
    ("steer_arnorm / per_request_n16_arnorm", "steer_arnorm", "per_request", 16),
    # every steered norm a programmatic dependent launch (steer_pdl: VLLM_STEER_NORM_PDL=1)
    ("steer_pdl / unsteered n16 (enabled_idle_pdl)", "steer_pdl", "plain", 16),
    ("steer_pdl / per_request_n16_pdl", "steer_pdl", "per_request", 16)]
# the request counts the graph phase profiles (GRAPH_NS, e.g. "16": the n16 rows alone)
GRAPH_NS = tuple(int(v) for v in os.environ.get("GRAPH_NS", "4,16").split(",") if v)
# issue 37 (prefill capture ~4% behind stock, vLLM's extract_hidden_states ~0): (label, arm) profiled under the arm's
# own load (PREFILL_LOAD: prompt 512, max_tokens 1, concurrency 32), GRAPH_PREFILL_REQUESTS requests (128: 64k
# prompt tokens, >= 8 prefill steps of 8192 tokens) after a warm-up wave of one concurrency's worth
PREFILL_GRAPH_PLAN = [("stock / prefill", "prefill_stock"),
                      ("steer_capture_fs / prefill capture files (nowait)", "prefill_capture_fs_nowait"),
                      ("steer_capture_fs / prefill capture mem", "prefill_capture_mem"),
                      ("extract_hs / prefill extract", "prefill_extract_hs")]
GRAPH_PREFILL_REQUESTS = int(os.environ.get("GRAPH_PREFILL_REQUESTS", "128"))
# which rows the graph phase profiles: decode (GRAPH_PLAN, the default), prefill (PREFILL_GRAPH_PLAN), or both
GRAPH_LOADS = tuple(v for v in os.environ.get("GRAPH_LOADS", "decode").split(",") if v)


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, object]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw[:500].decode(errors="replace")


def capture_counters(server) -> dict[str, float]:
    """The server's ``vllm_steer_capture_*`` counters from /metrics (summed over labels); {} if unreadable."""
    try:
        with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm_steer_capture_") and "_created" not in line.split(" ", 1)[0]:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def counter_delta(before: dict, after: dict) -> dict[str, float]:
    """Counters that moved during a trial (``_total`` names only: gauges are not differences)."""
    return {k.removeprefix("vllm_steer_capture_"): after[k] - before.get(k, 0.0) for k in after
            if k.endswith("_total") and after[k] != before.get(k, 0.0)}


async def _one(session, url: str, body: bytes) -> dict:
    first_t = last_t = first_obj = last_payload = capture_payload = None
    n_events = 0
    t0 = time.perf_counter()
    ctype = "application/json" if body[:1] == b"{" else "application/msgpack"
    try:
        async with session.post(url, data=body, headers={"Content-Type": ctype}) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:300]}"}
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
                if b'"capture":' in payload:  # vllm-steer's closing capture event (after the usage event)
                    capture_payload = payload
                else:
                    last_t, last_payload = now, payload
        t_end = time.perf_counter()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        usage = json.loads(last_payload).get("usage") if last_payload is not None else None
        capture = json.loads(capture_payload).get("capture") if capture_payload is not None else None
    except ValueError:
        usage = capture = None
    if first_t is None or not usage:
        return {"error": f"no content or no usage (events={n_events})"}
    n_out = int(usage.get("completion_tokens") or 0)
    ttft, e2el = first_t - t0, (last_t or t_end) - t0
    st = first_obj.get("steering")
    return {"ttft": ttft, "e2el": e2el, "tpot": (e2el - ttft) / (n_out - 1) if n_out > 1 else 0.0, "out": n_out,
            "prompt_tokens": usage.get("prompt_tokens"), "events": n_events,
            "steering": st if isinstance(st, dict) else None, "t_start": t0, "t_end": last_t or t_end,
            # capture: {instance: its result}; captured when every driver instance answered with data
            "captured": isinstance(capture, dict) and bool(capture)
            and all(isinstance(v, dict) and "data" in v for v in capture.values())}


def run_load(server, bodies: list[bytes], concurrency: int) -> tuple[list[dict], float]:
    """POST ``bodies`` in order, ``concurrency`` in flight: (per-request records, wall time to the last event)."""
    import aiohttp

    async def load() -> tuple[list[dict], float, float]:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=900, sock_connect=60)
        gate = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(body: bytes) -> dict:
                async with gate:
                    return await _one(session, server.base + "/v1/completions", body)

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(b) for b in bodies))
            return list(results), t0, time.perf_counter()

    res, t0, t1 = asyncio.run(load())
    ends = [r["t_end"] for r in res if "t_end" in r]
    return res, (max(ends) if ends else t1) - t0


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
    t = {"n": len(res), "ok": len(ok), "errors": errs[:3], "n_errors": len(errs), "wall_s": round(wall, 4),
         "output_tokens": sum(r["out"] for r in ok),
         "throughput": sum(r["out"] for r in ok) / wall if wall > 0 else float("nan")}
    for m in ("ttft", "tpot", "e2el"):
        xs = [r[m] * 1e3 for r in ok]  # ms
        t[f"{m}_median_ms"] = statistics.median(xs) if xs else float("nan")
        t[f"{m}_p99_ms"] = pct(xs, 0.99)
    good = [r for r in ok if r.get("steering") and r["steering"].get("prefill") and r["steering"].get("decode")]
    t.update(steering_applied=len(good), steering_expected=len(res) if steered else 0,
             unexpected_steering=0 if steered else sum(1 for r in ok if r.get("steering")),
             captured=sum(1 for r in ok if r.get("captured")))
    t["per_request"] = {m: [round(r[m] * 1e3, 3) for r in ok] for m in ("ttft", "tpot", "e2el")}
    return t


def ensure_modules(server, arm: dict, ctx: dict) -> None:
    """Register the arm's steering modules on ``server`` (replace=true), once per server and kind."""
    key = (server.name, arm["kind"])
    mods = {} if key in ctx["modules_done"] else arm_modules(arm, ctx)
    if not mods:
        return
    for name, vecs in mods.items():
        st, body = http_json("POST", server.base + "/v1/steering/modules",
                             {"name": name, "steering_vectors": vecs, "replace": True}, timeout=120)
        if st not in (200, 201):
            raise RuntimeError(f"module {name} registration failed: {st} {body}")
    log(f"modules {', '.join(mods)} registered on {server.name}; last: {json.dumps(body)[:300]}")
    ctx["modules_done"].add(key)


def one_run(pool, arm_name: str, load: dict, trial: int, phase: str, ctx: dict, warmup: bool = False) -> dict:
    arm = ARMS[arm_name]
    server = pool.get(arm["server"])
    ensure_modules(server, arm, ctx)
    n, conc, mt = load["requests"], load["concurrency"], load["max_tokens"]
    if warmup:
        n, mt = min(n, load["concurrency"], 32) if not arm.get("wide") else n, min(mt, 8)
    tag = "warmup" if warmup else f"t{trial}"
    prompt_len = load.get("prompt_len", ctx["prompt_len"])
    prompts = make_prompts(n, prompt_len, ctx["shape"]["vocab"], seed_of(phase, arm_name, tag, mt))
    fields = arm_fields(arm, n, seed_of(phase, arm_name, tag, "vec"), ctx)
    bodies = build_bodies(prompts, fields, mt, arm.get("wire", "json"))
    files = written_files(arm, ctx)
    if files is not None:
        shutil.rmtree(files, ignore_errors=True)
    counted = arm["kind"] in ("capture", "capture_fs")
    before = capture_counters(server) if counted else {}
    res, wall = run_load(server, bodies, conc)
    t = summarize_trial(res, wall, expects_steering_field(arm))
    t.update(trial=None if warmup else trial, body_bytes_mean=int(sum(map(len, bodies)) / len(bodies)),
             prompt_throughput=sum(r.get("prompt_tokens") or 0 for r in res if "error" not in r) / wall)
    if files is not None:
        t.update(files_written(files, arm["kind"], n, wall))
        shutil.rmtree(files, ignore_errors=True)
    if counted:  # after the files are complete: every drop of the trial is counted by then
        t["capture_counters"] = counter_delta(before, capture_counters(server))
    return t


def written_files(arm: dict, ctx: dict) -> Path | None:
    """The folder an arm's server writes its captured files to (None: an arm that writes none)."""
    if arm["kind"] == "capture_fs":
        return ctx["workdir"] / (CAPTURE_FS_NOSYNC_DIR if arm.get("instance") == "fs_nosync" else CAPTURE_FS_DIR)
    if arm["kind"] == "extract_hs":
        return ctx["workdir"] / EXTRACT_DIR
    return None


def disk_write_bound(folder: Path, size: int = 2 << 30, block: int = 8 << 20) -> float:
    """GB/s of one sequential fsynced write of ``size`` bytes under ``folder`` (the bound of the file-writing arms)."""
    folder.mkdir(parents=True, exist_ok=True)
    path, buf = folder / "disk_bound.tmp", os.urandom(block)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // block):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    gbps = size / (time.perf_counter() - t0) / 1e9
    path.unlink()
    return round(gbps, 3)


def files_written(root: Path, kind: str, n: int, wall: float, wait_s: float = 120.0) -> dict:
    """Wait (bounded) until every request's files are complete, then what was written: bytes, bytes per second of
    the load's wall time, and the lag after the load's end. Complete: the filesystem consumer's request.json per
    request; vLLM's connector: one .safetensors per request without its .lock (removed by its reader only, so its
    files count once present)."""
    t0 = time.time()
    pattern = "*/*/request.json" if kind == "capture_fs" else "**/*.safetensors"
    done = 0
    while time.time() - t0 < wait_s:
        done = len(list(root.glob(pattern))) if root.exists() else 0
        if done >= n:
            break
        time.sleep(0.5)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
    out = {"files_complete": done, "files_expected": n, "bytes_written": size, "write_gbps": size / wall / 1e9,
           "publish_lag_s": round(time.time() - t0, 2)}
    if kind == "capture_fs":  # what the requests' records say: complete, or partial with the rows dropped
        records = [json.loads(p.read_text()) for p in root.glob(pattern)]
        out["statuses"] = dict(collections.Counter(r.get("status", "?") for r in records))
        out["dropped_rows"] = sum(int(r.get("dropped_rows", 0)) for r in records)
    return out


def check_steering(t: dict, arm_name: str) -> str | None:
    """Request errors; a steering field missing on a steered arm or present on an unsteered one."""
    steered = expects_steering_field(ARMS[arm_name])
    if t["n_errors"]:
        return f"{t['n_errors']} request errors, e.g. {t['errors'][:1]}"
    if steered and t["steering_applied"] != t["n"]:
        return f"steering field missing/null on {t['n'] - t['steering_applied']} of {t['n']} responses"
    if not steered and t["unexpected_steering"]:
        return f"{t['unexpected_steering']} unsteered responses carry a steering field"
    if ARMS[arm_name]["kind"] == "capture" and t["captured"] != t["n"]:
        return f"capture results (activations data) missing on {t['n'] - t['captured']} of {t['n']} responses"
    if "files_complete" in t and t["files_complete"] < t["files_expected"]:
        return f"captured files complete for {t['files_complete']} of {t['files_expected']} requests"
    return None


def run_matrix(pool, phase: str, runs: list[tuple[str, str, dict]], trials: int, ctx: dict,
               results: dict, save) -> None:
    """runs: (label, arm, load). Warm-up + steering check per run, then trials interleaved (order rotated)."""
    res = results.setdefault(phase, {})
    live = []
    for label, arm, load in runs:
        entry = res.setdefault(label, {"arm": arm, "load": load, "trials": []})
        try:
            t = one_run(pool, arm, load, 0, phase, ctx, warmup=True)
            entry["warmup"] = {k: v for k, v in t.items() if k != "per_request"}
            if problem := check_steering(t, arm):
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
        for label, arm, load in live[k:] + live[:k]:
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
            if problem := check_steering(t, arm):
                t["check"] = problem
            res[label]["trials"].append(t)
            log(f"[{phase}] trial {trial + 1}/{trials} {label:<28} tput {t['throughput']:9.1f} tok/s | TTFT med "
                f"{t['ttft_median_ms']:8.2f} ms | TPOT med {t['tpot_median_ms']:7.3f} p99 {t['tpot_p99_ms']:7.3f} ms | "
                f"steering {t['steering_applied']}/{t['steering_expected']}, err {t['n_errors']}, {t['wall_s']:.2f} s")
            save()


def graph_bodies(label: str, kind: str, n: int, ctx: dict, max_tokens: int, k: int) -> list[bytes]:
    """The ``k``-th load of a graph row (1: the warm-up, 2: the profiled one): ``n`` requests, a steered kind's each
    with its own config (``n_configs`` = n: per_request_n16 / project_n16 as the A/B arms send them)."""
    p, v = (("graph", label), ("graph", label, "v")) if k == 1 else (("graph", label, k), ("graph", label, f"v{k}"))
    return build_bodies(make_prompts(n, ctx["prompt_len"], ctx["shape"]["vocab"], seed_of(*p)),
                        arm_fields({"kind": kind, "n_configs": n}, n, seed_of(*v), ctx), max_tokens)


def prefill_graph_load(ctx: dict) -> dict:
    """The prefill rows' load: PREFILL_LOAD with GRAPH_PREFILL_REQUESTS requests (a CPU dry run: its own tiny one)."""
    if getattr(ctx.get("args"), "dry_run_cpu", False):
        return {"prompt_len": ctx["prompt_len"], "max_tokens": 1, "requests": 4, "concurrency": 2}
    return {**PREFILL_LOAD, "requests": GRAPH_PREFILL_REQUESTS}


def prefill_graph_bodies(label: str, arm_name: str, n: int, ctx: dict, k: int) -> list[bytes]:
    """The ``k``-th load of a prefill row (1: the warm-up, 2: the profiled one): ``n`` requests as arm ``arm_name``
    sends them (its prompt length, max_tokens 1, its capture fields)."""
    arm, load = ARMS[arm_name], prefill_graph_load(ctx)
    prompts = make_prompts(n, load["prompt_len"], ctx["shape"]["vocab"], seed_of("graph", label, k))
    return build_bodies(prompts, arm_fields(arm, n, seed_of("graph", label, f"v{k}"), ctx), load["max_tokens"],
                        arm.get("wire", "json"))


def _decode_bodies(label: str, kind: str, n: int, ctx: dict) -> list[list[bytes]]:
    return [graph_bodies(label, kind, n, ctx, 16, k) for k in (1, 2)]


def _prefill_bodies(label: str, arm: str, ctx: dict) -> list[list[bytes]]:
    load = prefill_graph_load(ctx)
    return [prefill_graph_bodies(label, arm, n, ctx, k) for n, k in ((load["concurrency"], 1), (load["requests"], 2))]


def graph_rows(ctx: dict) -> list[dict]:
    """The graph phase's rows (GRAPH_LOADS) on --graph-servers: label, server, arm (prefill rows), concurrency, and
    ``bodies``, which makes the warm-up and the profiled bodies (when the row runs: decode rows' configs are large)."""
    rows = []
    if "decode" in GRAPH_LOADS:
        for label, sname, kind, n in [p for p in GRAPH_PLAN if p[1] in ctx["graph_servers"] and p[3] in GRAPH_NS]:
            rows.append({"label": label, "server": sname, "arm": None, "concurrency": n,
                         "bodies": functools.partial(_decode_bodies, label, kind, n, ctx)})
    if "prefill" in GRAPH_LOADS:
        load = prefill_graph_load(ctx)
        for label, arm in PREFILL_GRAPH_PLAN:
            if ARMS[arm]["server"] in ctx["graph_servers"]:
                rows.append({"label": label, "server": ARMS[arm]["server"], "arm": arm, "load": "prefill",
                             "concurrency": load["concurrency"],
                             "bodies": functools.partial(_prefill_bodies, label, arm, ctx)})
    return rows


def graph_phase(pool, ctx: dict, results: dict, save) -> None:
    from tests.gpu_e2e.trace_kernels import newest_trace, parse_trace

    res = results.setdefault("graph", {})
    for row in graph_rows(ctx):
        label, sname, arm = row["label"], row["server"], row["arm"]
        if why := server_unavailable(sname, ctx["args"]):
            log(f"[graph] skipping {label}: {why}")
            continue
        try:
            server = pool.get(sname)
            before = set(server.prof_dir.rglob("*.json*"))
            warm, profiled = row["bodies"]()
            files = written_files(ARMS[arm], ctx) if arm else None
            if files is not None:
                shutil.rmtree(files, ignore_errors=True)
            run_load(server, warm, row["concurrency"])  # rows resident, nothing new compiled in the window
            if files is not None:  # the warm-up's files (published behind its responses) written, then gone
                files_written(files, ARMS[arm]["kind"], len(warm), wall=1.0, wait_s=60)
                shutil.rmtree(files, ignore_errors=True)
            counted = arm is not None and ARMS[arm]["kind"] in ("capture", "capture_fs")
            counters = capture_counters(server) if counted else {}
            st, _ = http_json("POST", server.base + "/start_profile", timeout=120)
            if st != 200:
                raise RuntimeError(f"/start_profile -> {st}")
            out, wall = run_load(server, profiled, row["concurrency"])
            http_json("POST", server.base + "/stop_profile", timeout=300)
            path = newest_trace(server.prof_dir, before)
            for attempt in range(4):  # a large trace may still be being written (a torn gzip / JSON)
                try:
                    rec = parse_trace(path)
                    break
                except (EOFError, OSError, ValueError):
                    if attempt == 3:
                        raise
                    time.sleep(5.0)
            rec["trace_bytes"] = path.stat().st_size
            if row.get("load") == "prefill":  # small (~1 MB): comes back with the results, for a look off the GPU
                shutil.copy(path, ctx["out"] / (re.sub(r"[^A-Za-z0-9_.-]+", "_", f"trace_{label}") + "".join(
                    path.suffixes[-2:])))
            rec["requests_steered"] = sum(1 for r in out if r.get("steering"))
            if arm is not None:  # the load under the profiler: what it ran, and that it did what the arm asks
                ok = [r for r in out if "error" not in r]
                rec.update(load=row.get("load"), arm=arm, requests=len(out), request_errors=len(out) - len(ok),
                           errors=[r["error"] for r in out if "error" in r][:2], wall_s=round(wall, 3),
                           captured=sum(1 for r in ok if r.get("captured")),
                           prompt_throughput=round(sum(r.get("prompt_tokens") or 0 for r in ok) / wall, 1))
                if files is not None:
                    rec.update(files_written(files, ARMS[arm]["kind"], len(out), wall))
                    shutil.rmtree(files, ignore_errors=True)
                if counted:
                    rec["capture_counters"] = counter_delta(counters, capture_counters(server))
            rec["status_http"], status = http_json("GET", server.base + "/v1/steering")
            if rec["status_http"] == 200 and isinstance(status, dict):
                rec["status_ops"] = (status.get("workers") or [{}])[0].get("ops")
                rec["status_enabled"] = status.get("enabled")
            else:
                rec["status_ops"] = f"HTTP {rec['status_http']}"
            res[label] = rec
            tl = rec["timeline"]
            comm = rec.get("step_comm_kernels")
            log(f"[graph] {label}: kernels per launch {rec['kernels_per_launch_hist']}, eager kernels "
                f"{rec['eager_kernels']}, steer kernels per step {rec['steer_kernels_per_step']}"
                f"{'; all-reduce kernels per step ' + str(comm) if comm else ''}; GPU window "
                f"{tl.get('window_us')} µs, idle {tl.get('idle_pct')}%, prefill steps {tl.get('prefill_steps')}, "
                f"trace {rec['trace_bytes'] / 1e6:.1f} MB (more: the report)")
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            log(f"[graph] {label}: error {e}")
        save()
