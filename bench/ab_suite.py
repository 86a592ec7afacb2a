#!/usr/bin/env python3
"""A/B suite of vllm-steer through the OpenAI server path, in one entry point (issue 7).

Every arm talks HTTP to a real ``vllm.entrypoints.openai.api_server`` (or, on CPU, the same
server through ``python -m vllm_steer.launcher serve``) with a small async streaming client
(aiohttp, ``stream: true``, ``ignore_eos: true``, prompts of random token ids as a list of ints).
The pieces live in bench/abkit/ (servers, client, arms, runner, report, profile_graph, numbers).

Servers (each its own process, all alive together so trials of different servers interleave):
  stock      VLLM_PLUGINS=none, no steer block
  disabled   VLLM_PLUGINS=steer, no steer block
  steer      VLLM_PLUGINS=steer, --additional-config '{"steer": {"max_configs": 272}}'
             serves every steered arm (enabled_idle, named_shared, all_steered_shared,
             per_request_n4, per_request_n16, k256): one start-up, one compile.
  hotwire    the peer plugin hotwire-vllm: --peer-wheel (default: .whl/peer/hotwire_vllm-*.whl if
             present) is installed (pip --target, no deps) into <workdir>/hotwire_site, which goes first
             on that server's PYTHONPATH; VLLM_PLUGINS=hotwire,
             HOTWIRE_VECTORS=<workdir>/hotwire_vectors (v0..v15.pt, written before it starts),
             HOTWIRE_SLOTS=32. CUDA only; without the wheel (or on the CPU launcher) its arms are skipped.
  sae*, steer_cond, *_multi: see abkit/servers.py. All but hotwire share one VLLM_CACHE_ROOT.

Single-site arms (one steered site: post_mlp of --site-layer, clamped to the shape; the same 16
vectors, rng(31) normal x --std, for every plugin; abkit/site_vectors.py):
  hotwire_idle   plain traffic on hotwire        hotwire_ids16  request i: id v{i%16}, scale 1.0
  site_named16   steer, request i names module ab_site_{i%16} (16 modules registered once per server)
  site_inline16  steer, request i carries vector i%16 inline (steering_vectors.post_mlp)
hotwire adds at the end of decoder layer L = the residual after layer L's MLP = vllm-steer's post_mlp at L.

Phases (``--phases``, comma separated, run in the order given):
  ab      the A/B arms (--arms) at concurrency 16 (--max-tokens), the same load at --long-max-tokens
          for --long-arms (labels ``<arm>@mt256``, deltas against ``stock@mt256``), and the
          256-wide load (stock_c256 / disabled_c256 / k256)
  start   only start servers (--servers), e.g. with --keep-servers before a later call
  graph   torch.profiler (vLLM's /start_profile) around a few requests on --graph-servers
          (unsteered and per_request_n4): kernels per CUDA-graph launch (= per decode step with a
          FULL graph), eager kernels, steering kernels (steer / apply_steering / capture_rows)
Results: JSON under $OUT (written after every trial), a progress line per arm and trial.
``--report FILE...`` merges result JSONs into a markdown table; the report also pairs trial k of every arm with trial k of its reference (per-trial Δ%, mean ± SEM).
``--numbers`` rewrites bench/NUMBERS.md, the one page of current numbers, from the result JSONs that
bench/numbers.json names (abkit/numbers.py); add a run's JSON there to make its numbers current.
The kit's CPU checks (trace parser, single-site fields, the hotwire server's files) are tests/test_bench_kit.py.

GPU (vLLM + plugin installed, see bench/RESULTS.md):
    python3 bench/ab_suite.py --shape 8b --phases ab --keep-servers
    python3 bench/ab_suite.py --shape 8b --phases graph --reuse-servers
    python3 bench/ab_suite.py --shape 1b --phases ab --peer-wheel PEER.whl --gpu-mem 0.15 --keep-servers
        --long-arms "" --arms stock,hotwire_idle,hotwire_ids16,enabled_idle,site_named16,site_inline16
      (one command line; bench/gpu_session.sh small runs the single-site arms)
CPU dry run (tiny model, tiny counts, eager, float32):
    .venv/bin/python bench/ab_suite.py --dry-run-cpu --phases ab,graph
    .venv/bin/python bench/ab_suite.py --dry-run-cpu --phases ab --arms stock,enabled_idle,site_named16,site_inline16
"""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
for _p in (_BENCH.parent, _BENCH):  # the repo root (tests.*), bench/ (abkit) first
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from abkit import common  # noqa: E402
from abkit.arms import AB_ARMS, ARMS, LONG_ARMS, usable_arms  # noqa: E402
from abkit.common import ROOT, log  # noqa: E402
from abkit.model_dir import SHAPES, write_model_dir  # noqa: E402
from abkit.profile_graph import graph_phase  # noqa: E402
from abkit.report import report  # noqa: E402
from abkit.runner import run_matrix  # noqa: E402
from abkit.servers import STATE_FILE, STEER_SERVERS, WHEEL_SERVERS, Pool, server_unavailable  # noqa: E402
from abkit.site_vectors import site_layer  # noqa: E402


def parse_args(argv=None):
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
    ap.add_argument("--peer-wheel", default=_default_peer_wheel(),
                    help="the peer plugin's hotwire_vllm-*.whl, served by hotwire (default: "
                         ".whl/peer/hotwire_vllm-*.whl if present; '' for none)")
    ap.add_argument("--site-layer", type=int, default=8,
                    help="layer of the single-site arms' post_mlp site (clamped to the shape)")
    ap.add_argument("--arms", default=",".join(AB_ARMS),
                    help="arms of the ab phase (any of: %s)" % ", ".join(ARMS))
    ap.add_argument("--long-arms", default=",".join(LONG_ARMS),
                    help="arms run again at --long-max-tokens in the ab phase (labels <arm>@mt<N>)")
    ap.add_argument("--long-max-tokens", type=int, default=256)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="requests per trial at concurrency --concurrency")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--wide", type=int, default=256, help="requests = concurrency = configs of the wide load")
    ap.add_argument("--wide-max-tokens", type=int, default=128)
    ap.add_argument("--std", type=float, default=0.05, help="std of the steering vectors' entries")
    ap.add_argument("--gpu-mem", type=float, default=0.24, help="gpu_memory_utilization per server")
    ap.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size of every server")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--api-servers", type=int, default=4, help="--api-server-count of the *_multi servers")
    ap.add_argument("--port-base", type=int, default=8100)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--cache-root", default=str(Path(tempfile.gettempdir()) / "vllm_steer_ab_cache"))
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "vllm_steer_ab"))
    ap.add_argument("--no-profile-servers", dest="profile_servers", action="store_false",
                    help="do not pass --profiler-config (then the graph phase cannot run)")
    ap.add_argument("--keep-servers", action="store_true", help="leave the servers running (own sessions)")
    ap.add_argument("--reuse-servers", action="store_true", help="adopt servers left by --keep-servers")
    ap.add_argument("--servers", default="stock,disabled,steer", help="servers the start phase starts")
    ap.add_argument("--graph-servers", default="stock,disabled,steer",
                    help="servers the graph phase profiles")
    ap.add_argument("--stop-servers", default="", help="stop these servers (names) before the phases")
    ap.add_argument("--deadline-s", type=float, default=560, help="skip trials that would end after this")
    ap.add_argument("--reserve-s", type=float, default=25)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--report", nargs="+", help="merge result JSONs into markdown (--md)")
    ap.add_argument("--md")
    ap.add_argument("--numbers", action="store_true", help="rewrite bench/NUMBERS.md from bench/numbers.json")
    args = ap.parse_args(argv)
    if args.dry_run_cpu:
        args.shape, args.launcher, args.enforce_eager = "tiny", "cpu", True
        args.dtype = args.dtype or "float32"
        args.trials, args.requests, args.concurrency, args.max_tokens, args.prompt_len = 2, 4, 2, 6, 16
        args.wide, args.wide_max_tokens, args.max_model_len, args.max_num_seqs = 6, 4, 256, 16
        args.long_max_tokens = 12
        args.start_timeout = max(args.start_timeout, 600)
        args.deadline_s = max(args.deadline_s, 3600)
    args.dtype = args.dtype or "bfloat16"
    args.pack_dtype = args.pack_dtype or args.dtype
    for w in WHEEL_SERVERS.values():
        if getattr(args, w.option):
            setattr(args, w.option, str(Path(getattr(args, w.option)).resolve()))
    return args


def _default_peer_wheel() -> str | None:
    found = sorted(glob.glob(str(ROOT / ".whl" / "peer" / "hotwire_vllm-*.whl")))
    return found[-1] if found else None


def _names(csv: str) -> list[str]:
    return [x for x in csv.split(",") if x]


def ab_runs(args, pool) -> list[tuple[str, str, dict]]:
    """(label, arm, load) of the ab phase: --arms, then --long-arms at --long-max-tokens."""
    c16 = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    wide = {"requests": args.wide, "concurrency": args.wide, "max_tokens": args.wide_max_tokens}
    long_load = {**c16, "max_tokens": args.long_max_tokens}
    arms = usable_arms(_names(args.arms), args, "ab")
    wanted = {ARMS[a]["server"] for a in arms} | set(pool.servers) | set(pool.pending)
    long_arms = []
    for a in usable_arms(_names(args.long_arms), args, "ab long"):
        if ARMS[a]["server"] not in wanted:
            log(f"[ab long] skipping arm {a}: its server {ARMS[a]['server']} is not started by --arms")
        else:
            long_arms.append(a)
    runs = [(a, a, wide if ARMS[a].get("wide") else c16) for a in arms]
    runs += [(f"{a}@mt{args.long_max_tokens}", a, long_load) for a in long_arms]
    return runs


def main() -> int:
    args = parse_args()
    if args.report:
        print(report(args.report, args.md))
        return 0
    if args.numbers:
        from abkit.numbers import PAGE, write_page

        write_page()
        print(f"wrote {PAGE}")
        return 0

    shape = SHAPES[args.shape]
    out = common.out_dir(ROOT / "bench" / "results")
    out_json = out / f"ab_{args.tag}.json"
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    phases = _names(args.phases)
    known = {"ab", "start", "graph"}
    if set(phases) - known:
        raise SystemExit(f"unknown phase(s) {sorted(set(phases) - known)} (known: {sorted(known)})")

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "shape": args.shape, **shape,
            "dtype": args.dtype, "pack_dtype": args.pack_dtype, "steer_blocks": STEER_SERVERS,
            "launcher": args.launcher, "peer_wheel": args.peer_wheel,
            "site_layer": site_layer(args.site_layer, shape)}
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001
        meta["vllm"] = f"import failed: {e}"
    try:
        import vllm_steer

        meta["vllm_steer"] = getattr(vllm_steer, "__version__", None) or str(Path(vllm_steer.__file__).parent)
    except Exception as e:  # noqa: BLE001
        meta["vllm_steer"] = f"import failed: {e}"
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
           "graph_servers": _names(args.graph_servers), "args": args, "site_layer": meta["site_layer"]}
    log(f"phases {phases}; shape {args.shape} {shape}; dtype {args.dtype}; results -> {out_json}")
    for name, w in WHEEL_SERVERS.items():
        if not getattr(args, w.option):
            log(f"no {w.flag}: {name} and its arms are skipped")

    pool = Pool(args, model_dir, workdir)
    for name in _names(args.stop_servers):
        if name in pool.servers:
            pool.servers.pop(name).stop()
            pool.save_state()
    rc = 0
    try:
        for ph in phases:
            if ph == "ab":
                runs = ab_runs(args, pool)
                need: list[str] = []
                for _label, a, _load in runs:
                    if ARMS[a]["server"] not in need:
                        need.append(ARMS[a]["server"])
                for name in need:  # all up before the first trial; one that fails only fails its arms
                    try:
                        pool.ensure([name])
                    except Exception as e:  # noqa: BLE001
                        results.setdefault("server_errors", {})[name] = f"{type(e).__name__}: {e}"[-3000:]
                        log(f"[ab] server {name} failed to start; its arms fail: {str(e)[:500]}")
                run_matrix(pool, "ab", runs, args.trials, ctx, results, save)
            elif ph == "graph":
                graph_phase(pool, ctx, results, save)
            elif ph == "start":
                names = []
                for s in _names(args.servers):
                    why = server_unavailable(s, args)
                    if why:
                        log(f"[start] skipping server {s}: {why}")
                    else:
                        names.append(s)
                pool.ensure(names)
    except Exception:  # noqa: BLE001
        rc = 1
        results["error"] = traceback.format_exc()[-4000:]
        log(results["error"])
    finally:
        meta["wheel_versions"] = pool.wheel_versions()
        meta["server_start_s"] = {n: s.start_s for n, s in pool.servers.items()}
        meta["server_log_tails"] = {n: s.tail(25) for n, s in pool.servers.items()}
        meta["elapsed_s"] = round(time.time() - common.T0, 1)
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
    log(f"done in {time.time() - common.T0:.0f} s; results {out_json}")
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
