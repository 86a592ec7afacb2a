#!/usr/bin/env python3
"""A/B suite of vllm-steer through the OpenAI server path (issue 7): every arm talks HTTP to a real vLLM OpenAI
server (CPU: ``python -m vllm_steer.launcher serve``) with an async streaming client. Servers: abkit/servers.py;
arms: abkit/arms.py. Phases (``--phases``, run in order): ``ab`` (--arms at concurrency 16; --long-arms again at
--long-max-tokens, labels ``<arm>@mt256``; the 256-wide load), ``start`` (start --servers, e.g. with --keep-servers),
``stop`` (stop --servers among the adopted ones, to free GPU memory for others),
``graph`` (torch.profiler on --graph-servers: kernels per CUDA-graph launch; GRAPH_LOADS=prefill: the prefill arms'
load instead, the GPU's busy / idle time per step, abkit/runner.py), ``host`` (py-spy on the processes of
--host-arms' servers under their load: host CPU per engine step, abkit/host_profile.py). Results: JSON and markdown under $OUT;
``--report FILE...`` merges JSONs into one report; ``--numbers`` rewrites bench/NUMBERS.md.
    python3 bench/ab_suite.py --shape 8b --phases ab --keep-servers     (GPU: bench/gpu_session.sh, RESULTS.md)
    python3 bench/ab_suite.py --shape 8b --phases graph --reuse-servers
    .venv/bin/python bench/ab_suite.py --dry-run-cpu --phases ab,graph  (CPU: tiny model and counts, eager)
"""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
for _p in (_BENCH.parent, _BENCH):  # the repo root (tests.*), bench/ (abkit) first
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from abkit.arms import AB_ARMS, ARMS, LONG_ARMS, usable_arms  # noqa: E402
from abkit.host_profile import host_phase  # noqa: E402
from abkit.report import report  # noqa: E402
from abkit.runner import disk_write_bound, graph_phase, run_matrix  # noqa: E402
from abkit.servers import (BLOCK_FP8, ROOT, SAFE_ENV, SHAPES, STATE_FILE, STEER_SERVERS, T0, Pool, log,  # noqa: E402
                           server_unavailable, site_layer, write_model_dir)

PHASES = ("ab", "start", "stop", "graph", "host")
DRY_RUN = dict(shape="tiny", launcher="cpu", enforce_eager=True, trials=2, requests=4, concurrency=2, max_tokens=6,
               prompt_len=16, wide=6, wide_max_tokens=4, max_model_len=256, max_num_seqs=16, long_max_tokens=12)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="ab")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--launcher", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--enforce-eager", action="store_true", help="all servers eager (CPU dry runs)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny model, tiny counts, CPU launcher, eager, float32")
    found = sorted(glob.glob(str(ROOT / ".whl" / "peer" / "hotwire_vllm-*.whl")))
    ap.add_argument("--peer-wheel", default=found[-1] if found else None,
                    help="hotwire's wheel, hotwire_vllm-*.whl (default: the one in .whl/peer/; '' for none)")
    ap.add_argument("--site-layer", type=int, default=8, help="layer of the single-site arms' post_mlp site")
    ap.add_argument("--arms", default=",".join(AB_ARMS), help="arms of the ab phase (any of: %s)" % ", ".join(ARMS))
    ap.add_argument("--long-arms", default=",".join(LONG_ARMS), help="arms run again at --long-max-tokens")
    for flag, default in (("--trials", 3), ("--concurrency", 16), ("--max-tokens", 128), ("--long-max-tokens", 256),
                          ("--prompt-len", 256), ("--wide-max-tokens", 128), ("--max-model-len", 2048),
                          ("--max-num-seqs", 256), ("--port-base", 8100)):
        ap.add_argument(flag, type=int, default=default)
    for flag, default in (("--start-timeout", 420), ("--reserve-s", 25)):
        ap.add_argument(flag, type=float, default=default)
    ap.add_argument("--requests", type=int, default=64, help="requests per trial at concurrency --concurrency")
    ap.add_argument("--wide", type=int, default=256, help="requests = concurrency = configs of the wide load")
    ap.add_argument("--std", type=float, default=0.05, help="std of the steering vectors' entries")
    ap.add_argument("--gpu-mem", type=float, default=0.24, help="gpu_memory_utilization per server")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="every server's KV cache in GiB (vLLM's --kv-cache-memory-bytes: no memory profiling, which "
                         "another server starting beside it would disturb), and the servers of one ensure() started "
                         "together: one of each config at once, a server whose config one of them has (its compile "
                         "cache) once that one is ready")
    ap.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size of every server")
    ap.add_argument("--quantization", default=None,
                    help="--quantization of every server (e.g. fp8: the dummy weights quantized at load; issue 43's "
                         "FP8 cost: stock FP8 vs steer FP8; fp8_block: a block-FP8 checkpoint's config, 128 x 128 "
                         "weight blocks, activations per token and group of 128)")
    ap.add_argument("--api-servers", type=int, default=4, help="--api-server-count of the *_multi servers")
    ap.add_argument("--cache-root", default=str(Path(tempfile.gettempdir()) / "vllm_steer_ab_cache"))
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "vllm_steer_ab"))
    ap.add_argument("--no-profile-servers", dest="profile_servers", action="store_false", help="(no graph phase)")
    ap.add_argument("--keep-servers", action="store_true", help="leave the servers running (own sessions)")
    ap.add_argument("--reuse-servers", action="store_true", help="adopt servers left by --keep-servers")
    ap.add_argument("--servers", default="stock,disabled,steer", help="servers the start phase starts")
    ap.add_argument("--graph-servers", default="stock,disabled,steer", help="servers the graph phase profiles")
    ap.add_argument("--host-arms", default="stock,capture_gen_n16", help="arms whose load the host phase samples")
    ap.add_argument("--host-duration", type=int, default=120, help="py-spy's --duration cap (s)")
    ap.add_argument("--host-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--host-gil", action="store_true",
                    help="py-spy --gil: only samples of the thread holding the GIL (who holds it, per thread and step)")
    ap.add_argument("--deadline-s", type=float, default=560, help="skip trials that would end after this")
    ap.add_argument("--debug-loggers", default="",
                    help="vLLM loggers (comma-separated) the servers started here log at DEBUG, the rest as vLLM does")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--report", nargs="+", help="merge result JSONs into markdown (--md)")
    ap.add_argument("--md")
    ap.add_argument("--numbers", action="store_true", help="rewrite bench/NUMBERS.md from bench/numbers.json")
    args = ap.parse_args(argv)
    if args.dry_run_cpu:
        vars(args).update(DRY_RUN, dtype=args.dtype or "float32", start_timeout=max(args.start_timeout, 600),
                          deadline_s=max(args.deadline_s, 3600))
    args.dtype = args.dtype or "bfloat16"
    if args.peer_wheel:
        args.peer_wheel = str(Path(args.peer_wheel).resolve())
    return args


def _names(csv: str) -> list[str]:
    return [x for x in csv.split(",") if x]


def ab_runs(args, pool) -> list[tuple[str, str, dict]]:
    """(label, arm, load) of the ab phase: --arms, then --long-arms at --long-max-tokens."""
    c16 = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    wide = {"requests": args.wide, "concurrency": args.wide, "max_tokens": args.wide_max_tokens}
    arms = usable_arms(_names(args.arms), args, "ab")
    wanted = {ARMS[a]["server"] for a in arms} | set(pool.servers) | set(pool.pending)
    long_arms = usable_arms(_names(args.long_arms), args, "ab long")
    for a in [a for a in long_arms if ARMS[a]["server"] not in wanted]:
        log(f"[ab long] skipping arm {a}: its server {ARMS[a]['server']} is not started by --arms")
    long_arms = [a for a in long_arms if ARMS[a]["server"] in wanted]
    def load_of(arm: dict) -> dict:  # the phase's load, overridden by the arm's own
        own = arm.get("load", {})
        if args.dry_run_cpu:  # a CPU dry run keeps its tiny counts
            own = {k: v for k, v in own.items() if k == "max_tokens"}
        return {**(wide if arm.get("wide") else c16), **own}

    runs = [(a, a, load_of(ARMS[a])) for a in arms]
    return runs + [(f"{a}@mt{args.long_max_tokens}", a, {**c16, "max_tokens": args.long_max_tokens})
                   for a in long_arms]


def versions() -> dict:  # vllm, vllm_steer, torch, FlashInfer (None: stock cannot fuse the TP all-reduce) and the GPU
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    out = {}
    with contextlib.suppress(PackageNotFoundError):  # by its metadata: importing it would not change the answer
        out["flashinfer"] = version("flashinfer-python") if find_spec("flashinfer") else None
    for name in ("vllm", "vllm_steer"):
        try:
            mod = importlib.import_module(name)
            out[name] = getattr(mod, "__version__", None) or str(Path(mod.__file__).parent)
        except Exception as e:  # noqa: BLE001
            out[name] = f"import failed: {e}"
    with contextlib.suppress(Exception):
        import torch

        out.update(torch=torch.__version__, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
    return out


def main() -> int:
    args = parse_args()
    if args.report:
        print(report(args.report, args.md))
        return 0
    if args.numbers:
        from abkit.numbers import MANIFEST, PAGE, render

        PAGE.write_text(render(json.loads(MANIFEST.read_text())))
        print(f"wrote {PAGE}")
        return 0
    phases = _names(args.phases)
    if set(phases) - set(PHASES):
        raise SystemExit(f"unknown phase(s) {sorted(set(phases) - set(PHASES))} (known: {sorted(PHASES)})")
    shape = SHAPES[args.shape]
    out, workdir = Path(os.environ.get("OUT") or ROOT / "bench" / "results"), Path(args.workdir)
    for d in (out, workdir):
        d.mkdir(parents=True, exist_ok=True)
    out_json = out / f"ab_{args.tag}.json"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "shape": args.shape, **shape,
            "dtype": args.dtype, "pack_dtype": args.dtype, "steer_blocks": STEER_SERVERS,
            "launcher": args.launcher, "peer_wheel": args.peer_wheel,
            "site_layer": site_layer(args.site_layer, shape), **versions()}
    results: dict = {}

    def save() -> None:
        tmp = out_json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "phases": results}, default=str))
        os.replace(tmp, out_json)

    block = args.quantization == BLOCK_FP8
    model_dir = write_model_dir(workdir / f"model-{args.shape}-{args.dtype}{'-fp8block' if block else ''}", shape,
                                args.dtype, block_fp8=block)
    meta["model_dir"] = str(model_dir)
    ctx = {"shape": shape, "std": args.std, "pack_dtype": args.dtype, "prompt_len": args.prompt_len,
           "deadline_s": args.deadline_s, "reserve_s": args.reserve_s, "modules_done": set(), "wide": args.wide,
           "graph_servers": _names(args.graph_servers), "args": args, "site_layer": meta["site_layer"],
           "workdir": workdir, "out": out}
    log(f"phases {phases}; shape {args.shape} {shape}; dtype {args.dtype}"
        f"{'; quantization ' + args.quantization if args.quantization else ''}; results -> {out_json}")
    if meta.get("flashinfer"):
        log(f"FlashInfer {meta['flashinfer']} importable: at --tp >= 2 stock fuses each all-reduce with its RMSNorm "
            f"(stock_nofuse does not); every server: {SAFE_ENV}")
    if not args.peer_wheel:
        log("no --peer-wheel: hotwire and its arms are skipped")
    pool = Pool(args, model_dir, workdir)
    rc = 0
    try:
        for ph in phases:
            if ph == "ab":
                runs = ab_runs(args, pool)
                for name in dict.fromkeys(ARMS[a]["server"] for _label, a, _load in runs):
                    try:  # all up before the first trial; one that fails only fails its arms
                        pool.ensure([name])
                    except Exception as e:  # noqa: BLE001
                        results.setdefault("server_errors", {})[name] = f"{type(e).__name__}: {e}"[-3000:]
                        log(f"[ab] server {name} failed to start; its arms fail: {str(e)[:500]}")
                if any(ARMS[a]["kind"] in ("capture_fs", "extract_hs") for _label, a, _load in runs):
                    meta["disk_write_gbps"] = disk_write_bound(workdir)
                    log(f"[ab] disk write bound (2 GiB, fsync) under {workdir}: {meta['disk_write_gbps']} GB/s")
                run_matrix(pool, "ab", runs, args.trials, ctx, results, save)
            elif ph == "graph":
                graph_phase(pool, ctx, results, save)
            elif ph == "host":
                host_phase(pool, args, ctx, results, save)
            elif ph == "stop":
                for s in _names(args.servers):
                    if (server := pool.servers.pop(s, None) or pool.pending.pop(s, None)) is not None:
                        server.stop()
                pool.save_state()
            elif ph == "start":
                skip = {s: why for s in _names(args.servers) if (why := server_unavailable(s, args))}
                for s, why in skip.items():
                    log(f"[start] skipping server {s}: {why}")
                pool.ensure([s for s in _names(args.servers) if s not in skip])
    except Exception:  # noqa: BLE001
        rc = 1
        results["error"] = traceback.format_exc()[-4000:]
        log(results["error"])
    finally:
        servers = pool.servers.items()
        meta.update(wheel_versions=pool.wheel_versions(), server_start_s={n: s.start_s for n, s in servers},
                    server_log_tails={n: s.tail(25) for n, s in servers}, elapsed_s=round(time.time() - T0, 1),
                    jit_compiles_in_service={n: s.jit_compiles() for n, s in servers})
        for n, kernels in meta["jit_compiles_in_service"].items():
            if kernels:
                log(f"server {n}: kernels compiled while serving (vLLM's JIT monitor): {', '.join(kernels)}")
        save()
        if args.keep_servers:
            pool.save_state()
            log(f"servers kept: {list(pool.servers)} (state {STATE_FILE})")
        else:
            pool.stop_all()
    try:
        print(report([str(out_json)], str(out / f"ab_{args.tag}.md")))
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
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
