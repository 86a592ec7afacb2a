#!/usr/bin/env python3
"""Engine-side A/B for small models (issue 41 item 3): a method whose noise floor is shown in the same run.

The server A/B (`ab_suite.py`) cannot resolve 1% at the 1b shape: stock's own TPOT moved ±5% between trials,
the client, HTTP and the API process are in every number. Here each engine is a `vllm.LLM` in a process of its
own, alive for the whole run and driven by this one; a trial runs every arm once, in a shuffled order, on the
same fixed batch (token ids, `ignore_eos`, greedy): `generate` with `max_tokens` 1 (prefill) then
`--max-tokens` T, timed around the call; decode time per step = (t_T - t_1) / (T - 1). Only one engine works
at a time, the others idle. Two stock engines (`stock`, `stock2`: `VLLM_PLUGINS=none`) give the method's own
spread: `stock2` vs `stock` paired per trial is what a difference must clear. Arms on the steer engine
(`steer_blocks` of the A/B suite's `steer` server: every hook and layer steered, rows for 272 configs):
`enabled_idle` (no steering field), `site_named16` (16 modules at post_mlp of --site-layer, request i names
module i % 16, loaded at start-up from JSON files), `site_inline16` (the same vectors inline, packed).

Per arm: paired difference of decode step time and of prefill time against `stock` in the same trial, mean ±
SEM over trials, in percent, and each arm's median. `--out F.json` keeps every trial.

    python3 bench/offline_pairs.py --shape 1b --trials 40 --batch 16 --max-tokens 64 --gpu-mem 0.12
    python3 bench/offline_pairs.py --shape tiny --device cpu --trials 3 --batch 4 --max-tokens 8   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.abkit.arms import ARMS, arm_fields, arm_modules, make_prompts  # noqa: E402
from bench.abkit.report import fmt_pct, paired_pct  # noqa: E402
from bench.abkit.servers import SHAPES, STEER_SERVERS, site_layer, write_model_dir  # noqa: E402

ENGINE_OF = {"stock": "stock", "stock2": "stock2", "enabled_idle": "steer", "site_named16": "steer",
             "site_inline16": "steer"}
ARM_KIND = {"stock": "stock", "stock2": "stock", "enabled_idle": "enabled_idle", "site_named16": "site_named16",
            "site_inline16": "site_inline16"}


def _engine(conn, spec: dict) -> None:
    """One engine process: start `LLM`, answer ("run", arm, max_tokens) with seconds, until ("stop",); any
    failure is sent as ("error", traceback) so the driver stops instead of waiting."""
    try:
        _serve(conn, spec)
    except BaseException:  # noqa: BLE001 - SystemExit from vLLM's start-up too
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise


def _serve(conn, spec: dict) -> None:
    os.environ["VLLM_PLUGINS"] = "steer" if spec["steer"] is not None else "none"
    from vllm import LLM, SamplingParams

    kwargs = dict(model=spec["model"], dtype=spec["dtype"], load_format="dummy", seed=0,
                  max_model_len=spec["max_model_len"], max_num_seqs=spec["batch"], enforce_eager=spec["eager"])
    if spec["device"] == "cuda":
        kwargs["gpu_memory_utilization"] = spec["gpu_mem"]
    if spec["steer"] is not None:
        kwargs["additional_config"] = spec["steer"]
    llm = LLM(**kwargs)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def run(arm: str, max_tokens: int) -> float:
        fields = spec["fields"].get(arm) or [None] * len(prompts)
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                 extra_args=dict(f) if f else None) for f in fields]
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        if any(len(o.outputs[0].token_ids) != max_tokens for o in out):
            raise RuntimeError(f"{arm}: an output is not {max_tokens} tokens long")
        if fields[0] is not None and getattr(out[0], "steering", None) is None:
            raise RuntimeError(f"{arm}: the output carries no steering report (was the request steered?)")
        return dt

    for arm in spec["fields"]:  # warm-up: every arm's batch once at both lengths
        run(arm, 1)
        run(arm, spec["max_tokens"])
    conn.send(("ready", None))
    while (msg := conn.recv())[0] == "run":
        conn.send(("done", run(msg[1], msg[2])))


def _answer(engine: dict, name: str):
    """The engine's next answer; SystemExit with its traceback if it failed or died."""
    conn, proc = engine["conn"], engine["proc"]
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(f"engine {name} died (exit code {proc.exitcode})")
    kind, value = conn.recv()
    if kind == "error":
        raise SystemExit(f"engine {name} failed:\n{value}")
    return value


def _start(engines: dict, base: dict, steer: dict, fields: dict, ctx) -> None:
    """Start each engine process in turn (starts do not overlap) and wait for it to be warm."""
    for name, e in engines.items():
        spec = dict(base, steer=steer if name == "steer" else None, fields={a: fields[a] for a in e["arms"]})
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_engine, args=(child, spec), name=f"engine-{name}")
        proc.start()
        t0 = time.time()
        e.update(conn=parent, proc=proc)
        _answer(e, name)
        print(f"[offline_pairs] engine {name} ready in {time.time() - t0:.0f} s ({', '.join(e['arms'])})", flush=True)


def _fields_and_modules(args, shape: dict, workdir: Path) -> tuple[dict, dict]:
    """Per arm, the batch's steering fields (None: none); the steer engine's start-up modules {name: path}."""
    ctx = {"shape": shape, "std": args.std, "pack_dtype": args.dtype, "site_layer": site_layer(args.site_layer, shape)}
    fields, modules = {}, {}
    for arm in args.arms:
        kind = ARMS[ARM_KIND[arm]]
        fields[arm] = arm_fields(kind, args.batch, 0, ctx)
        for name, vectors in arm_modules(kind, ctx).items():
            path = workdir / f"{name}.json"
            path.write_text(json.dumps({"name": name, "steering_vectors": vectors}))
            modules[name] = str(path)
    return fields, modules


def _summary(trials: list[dict], arms: list[str], max_tokens: int) -> dict:
    """Per arm: decode step ms and prefill ms (medians), and paired % vs stock per trial (``abkit.report.paired_pct``:
    mean, SEM, significant at 2 SEM)."""
    per_arm = {arm: {"trials": [{"trial": k, "decode_step_ms": (t[arm]["gen"] - t[arm]["prefill"]) / (max_tokens - 1)
                                 * 1e3, "prefill_ms": t[arm]["prefill"] * 1e3} for k, t in enumerate(trials)]}
               for arm in arms}
    out = {}
    for arm, entry in per_arm.items():
        row = {m: statistics.median(t[m] for t in entry["trials"]) for m in ("decode_step_ms", "prefill_ms")}
        if arm != "stock":
            row |= {f"{m}_vs_stock": paired_pct(entry, per_arm["stock"], m) for m in ("decode_step_ms", "prefill_ms")}
        out[arm] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--arms", default="stock,stock2,enabled_idle,site_named16,site_inline16")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="requests per generate (the arms' concurrency)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--site-layer", type=int, default=8)
    ap.add_argument("--std", type=float, default=0.05)
    ap.add_argument("--gpu-mem", type=float, default=0.12, help="each engine's --gpu-memory-utilization")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (the CPU dry run uses it)")
    ap.add_argument("--seed", type=int, default=0, help="the trials' arm order")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="start no trial after this many seconds of trials (0: all); the summary still prints")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if "stock" not in args.arms or set(args.arms) - set(ENGINE_OF):
        raise SystemExit(f"--arms: 'stock' and any of {', '.join(ENGINE_OF)}")
    if args.max_tokens < 2:
        raise SystemExit("--max-tokens: at least 2 (a decode step)")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    shape = SHAPES[args.shape]
    workdir = Path(tempfile.mkdtemp(prefix="offline_pairs_"))
    model = write_model_dir(workdir / f"model_{args.shape}", shape, args.dtype)
    fields, modules = _fields_and_modules(args, shape, workdir)
    steer = json.loads(json.dumps(STEER_SERVERS["steer"]))
    if modules:
        steer["steer"]["modules"] = modules
    prompts = make_prompts(args.batch, args.prompt_len, shape["vocab"], 1234)
    base = dict(model=str(model), dtype=args.dtype, device=args.device, gpu_mem=args.gpu_mem, batch=args.batch,
                max_model_len=args.prompt_len + args.max_tokens + 16, eager=args.eager or args.device == "cpu",
                prompts=prompts, max_tokens=args.max_tokens)
    engines = {}
    ctx = mp.get_context("spawn")
    for arm in args.arms:
        engines.setdefault(ENGINE_OF[arm], {"arms": []})["arms"].append(arm)
    rng = random.Random(args.seed)
    trials = []
    try:
        _start(engines, base, steer, fields, ctx)
        t_start = time.monotonic()
        for i in range(args.trials):
            if args.deadline_s and trials and time.monotonic() - t_start > args.deadline_s:
                print(f"[offline_pairs] deadline: {len(trials)} of {args.trials} trials", flush=True)
                break
            order = list(args.arms)
            rng.shuffle(order)
            trial = {}
            for arm in order:
                engine = engines[ENGINE_OF[arm]]
                times = {}
                for what, n in (("prefill", 1), ("gen", args.max_tokens)):
                    engine["conn"].send(("run", arm, n))
                    times[what] = _answer(engine, ENGINE_OF[arm])
                trial[arm] = times
            trials.append(trial)
            print(f"[offline_pairs] trial {i + 1}/{args.trials}: " + ", ".join(
                f"{a} {(trial[a]['gen'] - trial[a]['prefill']) / (args.max_tokens - 1) * 1e3:.3f} ms/step"
                for a in args.arms), flush=True)
            if args.out:  # every trial so far, so a run cut short still leaves its data
                Path(args.out).write_text(json.dumps({"args": vars(args), "partial": True, "trials": trials}))
    finally:
        for e in engines.values():
            if "proc" in e and e["proc"].is_alive():
                e["conn"].send(("stop",))
                e["proc"].join(timeout=60)
            if "proc" in e and e["proc"].is_alive():
                e["proc"].kill()
    summary = _summary(trials, args.arms, args.max_tokens)
    for arm, row in summary.items():
        cells = [f"decode step {row['decode_step_ms']:.3f} ms", f"prefill {row['prefill_ms']:.1f} ms"]
        if arm != "stock":
            cells += [f"vs stock: decode {fmt_pct(row['decode_step_ms_vs_stock'])}, "
                      f"prefill {fmt_pct(row['prefill_ms_vs_stock'])}"]
        print(f"{arm:>14}: " + "; ".join(cells))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                              "summary": summary, "trials": trials}, indent=1))


if __name__ == "__main__":
    main()
