#!/usr/bin/env python3
"""Host work per decode step while projection rows are live (issue 38): one in-process engine (``vllm.LLM``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core, the scheduler and the worker run in this process, so one
cProfile sees them all) on a random llama with the A/B shape's hidden size and a few layers, server block
``{"max_configs": 272, "max_projections": 1}`` (the A/B's ``steer_proj``). Arms, 16 requests at once, each its own
config: ``plain`` (no steering field), ``per_request`` (vectors at every hook and layer, as ``per_request_n16``),
``project`` (one unit direction ablated at post_mlp of every layer, as ``project_n16``). Each arm runs twice with
``ignore_eos``, ``--short`` and ``--long`` tokens, and the report is the difference (``--long - --short`` decode
steps): what admission, prefill and the rows' writes cost cancels, what is left is per decode step. Per arm: wall
ms per step, engine steps, and per vllm_steer function calls and own time per decode step (own: its own plus the
builtins it called directly; cProfile slows everything, read the counts and the shares); also the calls per step
of a few vLLM functions that copy or serialize a request's params (``--watch``).
CPU lane:
    PYTHONPATH=. .venv/bin/python bench/proj_step_cost.py [--hidden 4096 --layers 4 --out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_PLUGINS": "steer",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
             "TORCHINDUCTOR_VEC_ISA_OK": "1", "TORCHDYNAMO_DISABLE": "1"}.items():
    os.environ.setdefault(k, v)

# vLLM functions whose per-step count would show a request's params copied or serialized every step
WATCH = ("deepcopy", "clone", "encode", "decode", "payload_of", "request_payload", "decode_payload", "dumps", "loads")


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A random llama (float32) of ``hidden`` and ``layers``; small attention and MLP (the steering cost scales with
    the hidden size and the sites, not with them)."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers as tf

    from tests.fixtures.models import tokenizer

    tok = tokenizer()
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         initializer_range=0.02, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def arm_extra(arm: str, n: int, hidden: int, layers: int) -> list[dict | None]:
    from bench.abkit.arms import projection_configs, steering_configs

    shape = {"hidden": hidden, "layers": layers}
    if arm == "plain":
        return [None] * n
    if arm == "per_request":
        return [{"steering_vectors": c} for c in steering_configs(n, 1, shape, 0.05, "float32", binary=True)]
    if arm == "project":
        return [{"steering_projections": c} for c in projection_configs(n, 2, shape)]
    raise ValueError(arm)


def _own(stats: dict) -> dict:
    """{function label: [calls, own s]} of vllm_steer functions (idle_cost's accounting: builtins they call directly
    count as theirs)."""
    from bench.idle_cost import _ours

    return {r["function"]: [r["calls"], r["own_s"]] for r in _ours(stats)}


def _watched(stats: dict) -> dict:
    out: dict = {}
    for func, (cc, nc, tt, ct, callers) in stats.items():
        if func[2] in WATCH or any(w in func[2] for w in ("deepcopy", "msgpack")):
            label = f"{Path(func[0]).name}:{func[2]}" if func[0] != "~" else func[2]
            e = out.setdefault(label, [0, 0.0])
            e[0] += nc
            e[1] += tt
    return out


def _steps(stats: dict) -> int:
    return sum(v[1] for f, v in stats.items() if f[2] == "step" and f[0].endswith(os.path.join("engine", "core.py")))


def run(llm, extras: list, tokens: int, prompt_len: int) -> tuple[dict, float]:
    import pstats

    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, extra_args=dict(e) if e else None)
              for e in extras]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(prompt_len)]} for i in range(len(extras))]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    return pstats.Stats(prof).stats, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=72)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--arms", default="plain,per_request,project")
    ap.add_argument("--model-dir", default="/tmp/proj_step_cost_model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from vllm import LLM

    model = build_model(Path(f"{args.model_dir}-{args.hidden}x{args.layers}"), args.hidden, args.layers)
    llm = LLM(model=str(model), enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=args.requests,
              additional_config={"steer": {"max_configs": 272, "max_projections": 1}})
    result: dict = {"args": vars(args), "arms": {}}
    for arm in args.arms.split(","):
        extras = arm_extra(arm, args.requests, args.hidden, args.layers)
        run(llm, extras, 2, args.prompt_len)  # warm: rows written, caches filled
        short, w_short = run(llm, extras, args.short, args.prompt_len)
        long, w_long = run(llm, extras, args.long, args.prompt_len)
        steps = _steps(long) - _steps(short)
        a, b = _own(short), _own(long)
        per_step = {}
        for f, (n, t) in b.items():
            n0, t0 = a.get(f, (0, 0.0))
            if n - n0 > 0:
                per_step[f] = {"calls": round((n - n0) / steps, 3), "own_us": round(1e6 * (t - t0) / steps, 2)}
        wa, wb = _watched(short), _watched(long)
        watched = {f: round((n - wa.get(f, (0, 0))[0]) / steps, 3) for f, (n, t) in wb.items()
                   if n - wa.get(f, (0, 0))[0] > 0}
        ours = sum(v["own_us"] for v in per_step.values())
        rec = {"decode_steps": steps, "wall_ms_per_step": round(1e3 * (w_long - w_short) / steps, 3),
               "ours_us_per_step": round(ours, 2),
               "functions": dict(sorted(per_step.items(), key=lambda kv: -kv[1]["own_us"])),
               "watched_calls_per_step": dict(sorted(watched.items(), key=lambda kv: -kv[1]))}
        result["arms"][arm] = rec
        print(f"{arm}: {steps} decode steps, {rec['wall_ms_per_step']:.2f} ms/step (profiled), ours "
              f"{ours:.1f} us/step", flush=True)
        for f, v in list(rec["functions"].items())[:12]:
            print(f"    {v['calls']:8.3f}/step {v['own_us']:9.2f} us  {f}")
        print("    watched:", ", ".join(f"{k} {v}" for k, v in list(rec["watched_calls_per_step"].items())[:12]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
