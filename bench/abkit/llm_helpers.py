"""vllm.LLM helpers of the GPU check: engine construction and shutdown, sampling params, generation,
timed runs (whole and split into add / decode phases), and the worker probe (collective_rpc)."""

from __future__ import annotations

import time
from pathlib import Path

from .common import log


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
    if getattr(args, "tp", 1) > 1:
        kw["tensor_parallel_size"] = args.tp
    if getattr(args, "pp", 1) > 1:
        kw["pipeline_parallel_size"] = args.pp
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
