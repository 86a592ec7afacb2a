"""The GPU check's checks on vllm.LLM engines.

Steer engine: runner / compile probes, (a) batch == alone == reversed batch and steered != unsteered,
(b) every request's first tokens against the HF oracle, (c) throughput (whole runs and add / decode
phases), rows released afterwards. Stock engine (no steer block): no steering installed, the same
tokens as the steer engine's unsteered runs, and its throughput.
"""

from __future__ import annotations

import gc
import json
import traceback
from pathlib import Path

from .checkpoint import as_packed_field, as_request_field, vectors_for
from .common import log
from .llm_helpers import generate, make_llm, sampling, shutdown, timed, timed_phases, worker_probe


def oracle_rows(batch: list[dict], plain: dict, hf: dict, batch_vecs: list, n_steered: int, k: int) -> list[dict]:
    """Per request: do vLLM's first k tokens match the oracle's (and where not, the oracle's gap)."""
    rows = []
    for i in range(len(batch)):
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
    return rows


def bench_prompts_for(prompts: list[list[int]], nb: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] + [10 + i] for i in range(nb)]


def steer_engine_checks(path: Path, args, prompts: list[list[int]], batch_vecs: list, n_steered: int,
                        hf: dict, summary: dict, check) -> None:
    llm = None
    try:
        llm, init_s = make_llm(path, args, {"max_configs": args.max_configs})
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
            rows = oracle_rows(batch, plain, hf, batch_vecs, n_steered, args.oracle_tokens)
            summary["oracle"] = rows
            check("hf_oracle_tokens_match", all(r["match"] for r in rows),
                  {"mismatched": [r["request"] for r in rows if not r["match"]]})
            hf_differ = [hf[("batch", i)]["tokens"] != hf[("plain", i)]["tokens"] for i in range(n_steered)]
            check("hf_oracle_steered_differ", all(hf_differ), {"per_request": hf_differ})

        # (c) throughput on the steering engine
        nb, bt = args.bench_requests, args.bench_tokens
        bench_prompts = bench_prompts_for(prompts, nb)
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


def stock_engine_checks(path: Path, args, prompts: list[list[int]], summary: dict, check) -> None:
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
        bench_prompts = bench_prompts_for(prompts, nb)
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
