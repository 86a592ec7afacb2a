"""Per-site diagnosis of bench/gpu_capture_check.py (same model and engine; prints every site's error vs transformers).

Record of the 2026-11-21 run (bench/RESULTS.md), not a maintained script:
    python3 bench/results/capdiag-2026-11-21.py [--eager]     # writes $OUT/capdiag.json
"""
import argparse, json, os, sys, tempfile
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]  # the project root (this file lives in bench/results/)
sys.path.insert(0, str(ROOT / "bench")); sys.path.insert(0, str(ROOT))
import gpu_check as gc_

def main():
    import numpy as np, torch
    from tests.test_capture import hf_streams
    from vllm_steer.capture.collect import collect
    from vllm_steer.capture.filesystem import load_request
    ap = argparse.ArgumentParser()
    for k, v in dict(layers=4, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32000).items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--mem", type=float, default=0.5); ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="capdiag-")); ckpt, root = work / "model", work / "captures"
    tok = gc_.build_checkpoint(ckpt, args)
    ids = tok(gc_.PROMPTS[0])["input_ids"]
    steer = {"max_configs": 8, "capture": [{"name": "filesystem", "instance": "fs", "params": {"root": str(root)}}]}
    llm, startup = gc_.make_llm(ckpt, args, steer)
    from vllm import SamplingParams
    all_sites = {"fs": {"layers": "all", "hooks": "all", "positions": "all_prompt"}}
    plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False, extra_args={"capture": all_sites})
    none = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    vec = np.random.default_rng(7).standard_normal(args.hidden).astype(np.float32)
    vec *= 8.0 / np.linalg.norm(vec)
    steered = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False,
                             extra_args={"capture": all_sites, "steering_vectors": {"post_mlp": {"1": vec.tolist()}}})
    ids2 = tok(gc_.PROMPTS[1])["input_ids"]
    runs = {}
    o = llm.generate([{"prompt_token_ids": ids}] * 2, [plain, steered], use_tqdm=False); collect(llm, o)
    runs["orig_plain"] = (o[0], ids); runs["orig_steered"] = (o[1], ids)
    o = llm.generate([{"prompt_token_ids": ids2}], [plain], use_tqdm=False); collect(llm, o); runs["p1_alone"] = (o[0], ids2)
    o = llm.generate([{"prompt_token_ids": ids2}, {"prompt_token_ids": ids}], [plain, none], use_tqdm=False); collect(llm, o)
    runs["p1_repeat_in_batch"] = (o[0], ids2)
    status = llm.collective_rpc("vllm_steer_status")
    gc_.shutdown(llm)
    refs = {0: hf_streams(str(ckpt), ids), 1: hf_streams(str(ckpt), ids2)}
    res = {"startup_s": round(startup, 1), "n_ids": [len(ids), len(ids2)], "status": status}
    for tag, (o, pid) in runs.items():
        ref = refs[0] if pid is ids else refs[1]
        got = load_request(str(root), o.request_id)
        sites = {"request_id": o.request_id, "num_cached_tokens": getattr(o, "num_cached_tokens", None)}
        for key in sorted(got):
            pos, rows = got[key]; r = ref[key][np.asarray(pos, dtype=int)]
            d = np.abs(rows - r); rel = d / (np.abs(r) + 1e-2)
            i = np.unravel_index(np.argmax(rel), rel.shape)
            rowerr = d.max(1)
            sites[f"L{key[0]}.{key[1]}"] = {"n": int(len(pos)), "pos": [int(pos[0]), int(pos[-1])] if len(pos) else [],
                "max_abs": float(d.max()), "max_rel": float(rel.max()), "argmax_rel": [int(x) for x in i],
                "got": float(rows[i]), "ref": float(r[i]), "ref_absmax": float(np.abs(r).max()),
                "row_err_top": [[int(j), float(rowerr[j])] for j in np.argsort(-rowerr)[:4]],
                "row_err_median": float(np.median(rowerr))}
        res[tag] = sites
    print(json.dumps(res, indent=1))
    (Path(os.environ.get("OUT") or ".") / "capdiag.json").write_text(json.dumps(res, indent=1))
    sys.stdout.flush(); os._exit(0)

if __name__ == "__main__":
    main()
