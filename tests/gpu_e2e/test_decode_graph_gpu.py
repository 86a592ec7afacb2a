"""The decode step launches as many kernels steered as stock (compiled, FULL CUDA graphs, V2 runner): a
random-weight Llama served four ways in turn (no steer block; ``steer`` with 4 distinct inline configs on
the requests; ``steer.conditions`` with a conditional config; ``steer.capture`` with requests capturing
while they decode), each profiled by torch.profiler around the
same greedy decode (``LLM.start_profile``), its trace read by ``trace_kernels``. The forward graph holds the
same number of kernels in all three (steering folded into vLLM's norms: no launch of its own), and the
steered norms run inside it. The A/B suite's graph phase measures the same at the 8b shape over HTTP (418
kernels per step, bench/RESULTS.md). ``VLLM_STEER_E2E_TP=2``: every engine at TP=2 (the trace read is one
rank's). Skipped without CUDA."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gpu_e2e.test_row_refusal_gpu import _config_dir
from tests.gpu_e2e.trace_kernels import newest_trace, parse_trace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _profiled_decode(root: Path, steer: dict | None, extra) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import ProfilerConfig
    from vllm.inputs import TokensPrompt

    prof = root / "prof"
    prof.mkdir(parents=True)
    llm = LLM(model=_config_dir(root), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              gpu_memory_utilization=0.3, tensor_parallel_size=int(os.environ.get("VLLM_STEER_E2E_TP", "1")),
              additional_config={"steer": steer} if steer is not None else {},
              profiler_config=ProfilerConfig(profiler="torch", torch_profiler_dir=str(prof),
                                             torch_profiler_with_stack=False,
                                             torch_profiler_dump_cuda_time_total=False))
    try:
        prompts = [TokensPrompt(prompt_token_ids=list(range(10 + i, 42 + i))) for i in range(4)]
        params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0, extra_args=extra(i)) for i in range(4)]
        llm.generate(prompts, params, use_tqdm=False)  # warm: rows resident, nothing compiled in the window
        before = set(prof.rglob("*.json*"))
        llm.start_profile()
        llm.generate(prompts, params, use_tqdm=False)
        llm.stop_profile()
        return parse_trace(newest_trace(prof, before))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_the_forward_graph_has_as_many_kernels_steered_as_stock(tmp_path):
    os.environ.setdefault("VLLM_PLUGINS", "steer")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process touched CUDA (the skip check)
    rng = np.random.default_rng(0)
    vecs = [{"post_mlp": {2: (rng.standard_normal(512) * 4).astype(np.float32).tolist()},
             "pre_attn": {1: (rng.standard_normal(512) * 4).astype(np.float32).tolist()}} for _ in range(4)]
    cond = {"site": "pre_attn.1", "probe": [1.0] * 512, "threshold": 0.0}
    stock = _profiled_decode(tmp_path / "stock", None, lambda i: None)
    steer = _profiled_decode(tmp_path / "steer", {"max_configs": 8}, lambda i: {"steering_vectors": vecs[i]})
    gated = _profiled_decode(tmp_path / "cond", {"max_configs": 8, "conditions": True},
                             lambda i: {"steering_vectors": vecs[i], "steering_condition": cond})
    spec = {"layers": [1, 2], "hooks": ["pre_attn", "post_mlp"], "positions": "all_generated"}
    captured = _profiled_decode(tmp_path / "capture", {"max_configs": 8, "capture": ["activations"]},
                                lambda i: {"steering_vectors": vecs[i], "capture": {"activations": spec}})
    counts = [r["forward_kernels"] for r in (stock, steer, gated)]
    assert counts[0] and counts[0] > 20 and len(set(counts)) == 1, (counts, stock["kernels_per_launch_hist"],
                                                                     steer["kernels_per_launch_hist"])
    # capture is folded into the steered norms: one kernel more than stock, layer 0's pre_attn capture (its
    # norm is steered by an in-place add, not by the op), not one per captured site
    assert captured["forward_kernels"] == counts[0] + 1, (captured["kernels_per_launch_hist"],
                                                          captured["steer_kernel_names"])
    assert stock["steer_kernels"] == 0
    for r in (steer, gated, captured):  # the steered norms are kernels of the graph, none launched on their own
        assert r["steer_kernels_in_graphs"] > 0 and r["steer_kernels_eager"] == 0, r["steer_kernel_names"]
