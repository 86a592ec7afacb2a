"""Runs one vLLM engine in a child process for a test and returns what it generated.

Tests describe a job (model, LLM kwargs, a list of generate() calls) and get plain results back,
so every engine lives and dies in its own process: no state leaks between tests, and an engine
crash fails one test instead of the session. Run as ``python -m tests.engine_job IN OUT``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_PLUGINS": "steer",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    # Inductor (compiled engines) trusts the CPU flags for AVX2/AVX-512 instead of building and loading a
    # probe library per ISA in a fresh Python (~1.7 s each, several per compiling process)
    "TORCHINDUCTOR_VEC_ISA_OK": "1",
}
# An enforce_eager engine still torch.compiles vLLM's CPU sampler (`compiled_random_sample`) in its warm-up
# and the logprobs op at the first request: Inductor, its ISA probes and a C++ build, ~20 s of a ~25 s
# start of the tiny model (measured 2026-11-26), for code that is vLLM's and the same math eager. Engines
# that are eager anyway run those eagerly; the tests about compile (test_families_and_compile) are not
# enforce_eager and keep Inductor.
EAGER_ENV = {"TORCHDYNAMO_DISABLE": "1"}


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux ``PR_SET_PDEATHSIG``), so
    a test run killed hard (``./dev test`` stopped, CI's timeout) leaves no server or engine job behind; vLLM's
    engine processes end with their API server."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def run_job(job: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None, timeout: int = 600) -> dict:
    """Run ``job`` in a fresh process; raise with the child's log tail if it fails."""
    src, dst = tmp_path / "job.pkl", tmp_path / "result.pkl"
    src.write_bytes(pickle.dumps(job))
    eager = job.get("llm_kwargs", {}).get("enforce_eager", False)
    full_env = {**os.environ, **CPU_ENV, **(EAGER_ENV if eager else {}), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine_job", str(src), str(dst)],
        cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout, preexec_fn=die_with_parent,
    )
    if proc.returncode != 0 or not dst.exists():
        raise RuntimeError(f"engine job failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    result = pickle.loads(dst.read_bytes())
    result["log"] = proc.stdout + proc.stderr
    return result


def _output_record(out: Any) -> dict:
    comp = out.outputs[0]
    rec = {
        "request_id": out.request_id,
        "token_ids": list(comp.token_ids),
        "text": comp.text,
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": comp.finish_reason,
        "stop_reason": comp.stop_reason,
        "logprobs": None,
        "prompt_logprobs": None,
    }
    if comp.logprobs is not None:
        rec["logprobs"] = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = [
            None if lp is None else lp[t].logprob
            for lp, t in zip(out.prompt_logprobs, out.prompt_token_ids)
        ]
    return rec


def _continued(prompt: dict, done: list) -> dict:
    """``{"continue_call": k}``: the prompt and generated tokens of call k's first request (a
    multi-turn follow-up); any other prompt as given."""
    if "continue_call" not in prompt:
        return prompt
    out = done[prompt["continue_call"]][0]
    return {"prompt_token_ids": list(out.prompt_token_ids) + list(out.outputs[0].token_ids)}


def _llm_call(llm, call: dict) -> Any:
    """``{"llm_call": "module:function", "kwargs": {...}}``: ``function(llm, **kwargs)``."""
    import importlib

    module, _, fn = call["llm_call"].partition(":")
    return getattr(importlib.import_module(module), fn)(llm, **call.get("kwargs", {}))


def handed_over_stale(llm, extra: dict, prompt: dict, between: list[dict]) -> dict:
    """Two API processes racing: a request is prepared here, the ``between`` llm_calls (another process's
    registrations) reach the engine core first, and only then does the request, with the payload it was
    prepared with (this process's own checks are bypassed: they cannot see another process's changes).
    Its output: what the engine core made of it."""
    from vllm import SamplingParams

    from vllm_steer.frontend import prepare
    from vllm_steer.frontend.prepared import for_request

    stale = prepare.SteeringFrontend(llm.llm_engine.vllm_config).engine_extra_args(dict(extra))
    for call in between:
        _llm_call(llm, call)
    handed_over = prepare._prepared
    prepare._prepared = lambda frontend, ex, request_id: for_request(stale, ex, request_id)
    try:
        out = llm.generate([prompt], [SamplingParams(max_tokens=4, temperature=0.0, extra_args=dict(extra))],
                           use_tqdm=False)[0].outputs[0]
    finally:
        prepare._prepared = handed_over
    return {"finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "tokens": list(out.token_ids)}


def generate_error(llm, extra: dict, prompt: dict) -> dict:
    """``llm.generate`` with ``extra_args=extra``: the error it raises (type, message, field), or its tokens."""
    from vllm import SamplingParams

    try:
        out = llm.generate([prompt], [SamplingParams(max_tokens=2, temperature=0.0, extra_args=dict(extra))],
                           use_tqdm=False)[0].outputs[0]
    except Exception as e:  # noqa: BLE001 - what the caller sees is the point
        return {"error": type(e).__name__, "message": str(e), "field": getattr(e, "field", None)}
    return {"tokens": list(out.token_ids)}


def _main(src: str, dst: str) -> None:
    job = pickle.loads(Path(src).read_bytes())
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], **job.get("llm_kwargs", {}))
    result: dict[str, Any] = {"calls": []}
    if job.get("rpc"):
        result["rpc"] = {name: llm.collective_rpc(name) for name in job["rpc"]}
    done: list = []  # outputs of earlier calls, for prompts that continue them
    for call in job.get("calls", []):
        if "llm_call" in call:
            result["calls"].append(_llm_call(llm, call))
            done.append(None)
            continue
        params = [SamplingParams(**p) for p in call["params"]]
        prompts = [_continued(p, done) for p in call["prompts"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        done.append(outs)
        if job.get("collect_capture"):
            from vllm_steer.capture.collect import collect

            collect(llm, outs)
        result["calls"].append([{**_output_record(o), "capture": getattr(o, "capture", None),
                                 "steering": getattr(o, "steering", "absent")} for o in outs])
    if job.get("rpc_after"):
        result["rpc_after"] = {name: llm.collective_rpc(name) for name in job["rpc_after"]}
    result["parent_pid"] = os.getpid()
    Path(dst).write_bytes(pickle.dumps(result))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
