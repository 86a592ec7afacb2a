#!/usr/bin/env python3
"""GPU check of activation capture on stock vLLM 0.26 (V2 runner, torch.compile + CUDA graphs).

Writes a small random-weight Llama (bench/gpu_check.py's checkpoint helper), starts ``vllm.LLM``
with the filesystem consumer, captures every hook of every layer for one prompt, and compares the
files with transformers' hidden states (pre_attn = hidden_states[i], post_mlp = hidden_states[i+1],
post_attn = layer input + attention output via hooks). Also: a steered request captures the
same rows at and before its steered site; no consumer errors, no drops. JSON to $OUT.

    python3 bench/gpu_capture_check.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpu_check as gc_  # noqa: E402  (env defaults, checkpoint, LLM helpers)


def main() -> int:
    import numpy as np
    import torch

    from tests.test_capture import hf_streams  # the same reference the CPU lane uses
    from vllm_steer.capture.collect import collect
    from vllm_steer.capture.filesystem import load_request

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--mem", type=float, default=0.5)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size (stages publish their own sites)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="capcheck-"))
    ckpt, root = work / "model", work / "captures"
    tok = gc_.build_checkpoint(ckpt, args)
    ids = tok(gc_.PROMPTS[0])["input_ids"]
    steer = {"max_configs": 8, "capture": [{"name": "filesystem", "instance": "fs", "params": {"root": str(root)}}]}
    llm, startup = gc_.make_llm(ckpt, args, steer)
    status = llm.collective_rpc("vllm_steer_status")
    from vllm import SamplingParams

    all_sites = {"fs": {"layers": "all", "hooks": "all", "positions": "all_prompt"}}
    vec = np.random.default_rng(7).standard_normal(args.hidden).astype(np.float32)
    vec *= 8.0 / np.linalg.norm(vec)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False, extra_args={"capture": all_sites})
    steered = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False,
                             extra_args={"capture": all_sites, "steering_vectors": {"post_mlp": {"1": vec.tolist()}}})
    outs = llm.generate([{"prompt_token_ids": ids}] * 2, [plain, steered], use_tqdm=False)
    collect(llm, outs)
    after = llm.collective_rpc("vllm_steer_status")
    gc_.shutdown(llm)
    torch.cuda.empty_cache()
    got = load_request(str(root), outs[0].request_id, sites=3 * args.layers)
    got_s = load_request(str(root), outs[1].request_id, sites=3 * args.layers)
    ref = hf_streams(str(ckpt), ids)
    # Relative to each site's largest |value|: vLLM's float32 GPU attention runs in TF32 (~5e-4
    # rounding), which puts elementwise ratios near zero far off while the stream agrees to ~1e-3.
    worst = max(float(np.max(np.abs(rows - ref[key])) / np.max(np.abs(ref[key]))) for key, (_, rows) in got.items())
    same_upstream = all(np.array_equal(got[(l, h)][1], got_s[(l, h)][1]) for l in range(2)
                        for h in ("pre_attn", "post_attn", "post_mlp"))
    summary = {
        "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "startup_s": round(startup, 1),
        "status": status, "sites_captured": len(got), "sites_expected": 3 * args.layers,
        "worst_rel_err_vs_hf": worst, "steered_same_at_and_before_site": same_upstream,
        "steered_differs_after": not np.array_equal(got[(2, "pre_attn")][1], got_s[(2, "pre_attn")][1]),
        "parallel": {"tp": args.tp, "pp": args.pp},
        "capture_rows_per_worker": [w["capture"]["rows"] for w in after],
        "capture_stats": {k: sum(w["capture"][k] for w in after) for k in after[0]["capture"]},
    }
    summary["ok"] = (summary["sites_captured"] == summary["sites_expected"] and worst < 1e-2 and same_upstream
                     and summary["steered_differs_after"] and summary["capture_stats"]["consumer_errors"] == 0)
    print(json.dumps(summary, indent=1, default=str))
    (gc_.out_dir() / f"gpu_capture_check{args.tag}.json").write_text(json.dumps(summary, indent=1, default=str))
    sys.stdout.flush()
    os._exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
