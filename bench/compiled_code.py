#!/usr/bin/env python3
"""What Inductor generates around a decoder layer's norms, per engine config (GPU, vLLM compile).

For each variant, one ``vllm.LLM`` (small dummy-weight Llama, bf16, no enforce_eager) runs in its
own process with ``TORCH_LOGS=output_code`` written to a file; the script then lists, for the
generated code, every Triton kernel definition (``def triton_...``) and every call of a custom op
of ours (``torch.ops.vllm_steer``) or of vLLM's C ops, and writes a summary plus the raw logs
(gzipped) under $OUT. Variants:
  stock      no plugin
  steer      the installed plugin (steering folded into the norms)
  old_kernel the previous release (--old-site DIR on PYTHONPATH), apply: kernel
  old_inline the previous release, apply: inline (the add Inductor was meant to fuse)

    python3 bench/compiled_code.py --old-site /tmp/old_site
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

CHILD = r"""
import json, os, sys
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(model=cfg["model"], dtype="bfloat16", load_format="dummy", max_model_len=512, max_num_seqs=8,
          gpu_memory_utilization=cfg["mem"], additional_config=cfg["additional_config"], seed=0)
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0))
print("TOKENS", list(out[0].outputs[0].token_ids), flush=True)
llm.shutdown()
os._exit(0)
"""


def write_model(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
           "intermediate_size": 2816, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(cfg))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(1024)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(path)
    return path


def summarize(log: str) -> dict:
    kernels = re.findall(r"^def (triton_\w+)\(", log, flags=re.M)
    ours = re.findall(r"torch\.ops\.vllm_steer\.(\w+)", log)
    vllm_c = re.findall(r"torch\.ops\._C\.(\w+)", log)
    calls = re.findall(r"^\s+(triton_\w+)\.run\(", log, flags=re.M)
    norm_like = sorted({k for k in kernels if "mean" in k or "rsqrt" in k or "pow" in k})
    return {"kernel_definitions": len(kernels), "distinct_kernels": len(set(kernels)),
            "kernel_launch_sites": len(calls), "vllm_steer_op_calls": dict(Counter(ours)),
            "vllm_c_op_calls": dict(Counter(vllm_c)), "norm_kernels": norm_like[:40],
            "index_select_kernels": sorted({k for k in kernels if "index" in k})[:40]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-site", default=None)
    ap.add_argument("--variants", default="stock,steer,old_kernel,old_inline")
    ap.add_argument("--mem", type=float, default=0.1)
    ap.add_argument("--timeout", type=int, default=130)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or ".")
    work = Path(tempfile.mkdtemp(prefix="compiled-code-"))
    model = write_model(work / "model")
    variants = {
        "stock": ({"VLLM_PLUGINS": "none"}, {}),
        "steer": ({"VLLM_PLUGINS": "steer"}, {"steer": {}}),
        "old_kernel": ({"VLLM_PLUGINS": "steer"}, {"steer": {"apply": "kernel"}}),
        "old_inline": ({"VLLM_PLUGINS": "steer"}, {"steer": {"apply": "inline"}}),
    }
    summary = {}
    for name in [v for v in args.variants.split(",") if v]:
        env_extra, additional = variants[name]
        if name.startswith("old") and not args.old_site:
            summary[name] = {"skipped": "no --old-site"}
            continue
        log_path = work / f"{name}.log"
        env = {**os.environ, **env_extra, "TORCH_LOGS": "output_code", "TORCH_LOGS_OUT": str(log_path),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(work / f"cache-{name}"),
               "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1"}
        if name.startswith("old"):
            env["PYTHONPATH"] = f"{args.old_site}:{env.get('PYTHONPATH', '')}"
        cfg = {"model": str(model), "mem": args.mem, "additional_config": additional}
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, capture_output=True,
                              text=True, timeout=args.timeout)
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        rec = {"rc": proc.returncode, **summarize(text)}
        rec["tokens"] = next((l for l in proc.stdout.splitlines() if l.startswith("TOKENS")), None)
        if proc.returncode:
            rec["stderr_tail"] = (proc.stdout + proc.stderr)[-3000:]
        summary[name] = rec
        with gzip.open(out / f"output_code_{name}.log.gz", "wt") as f:
            f.write(text)
        print(name, json.dumps({k: v for k, v in rec.items() if k != "stderr_tail"})[:1500], flush=True)
    (out / "compiled_code.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    rc = 1
    try:
        rc = main()
    finally:
        sys.stdout.flush()
        os._exit(rc)
