"""The GPU check's oracle: Hugging Face transformers, float32, greedy with full recompute, each
steering vector added by the CPU lane's forward hooks (tests/hf_oracle.py)."""

from __future__ import annotations

import gc
import time
import traceback

from .common import ensure_repo_on_path, log


def hf_greedy(model, ids: list[int], steps: int, vecs: dict | None, device) -> dict:
    """Greedy tokens, their logprobs and the top-1 minus top-2 logit gap, full recompute each step."""
    import torch

    ensure_repo_on_path()
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


def oracle_runs(path, prompts: list[list[int]], batch_vecs: list, args, summary: dict) -> dict:
    """{("batch", i): run with the batch's vectors, ("plain", i): steered prompts unsteered}; the HF
    model is freed before returning (vLLM takes the GPU next). Errors go to summary["errors"]."""
    import torch

    hf: dict = {}
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
    return hf
