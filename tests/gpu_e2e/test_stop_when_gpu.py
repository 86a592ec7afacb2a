"""``steering_condition.stop_when`` on a GPU engine (V2 runner, torch.compile, CUDA graphs, vLLM's async
scheduling, where the gates reach the host inside vLLM's async output): an always-open gate with
``tokens: 3`` stops after 3 tokens (4 when only decode is gated), with finish_reason "stop_when" and
the gate as stop_reason; a shut gate never stops and runs as the unsteered request; an unsteered
request in the same batch runs to max_tokens. Run on the GPU machine (``VLLM_PLUGINS=steer``); skipped
without CUDA. The CPU lane checks the stop point against transformers' gates
(tests/test_conditional_steering.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.gpu_e2e.test_row_refusal_gpu import _config_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_stop_when_stops_at_the_bound_under_cuda_graphs_and_async_scheduling(tmp_path):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ.setdefault("VLLM_PLUGINS", "steer")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process touched CUDA (the skip check)
    llm = LLM(model=_config_dir(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              gpu_memory_utilization=0.3, additional_config={"steer": {"max_configs": 8, "conditions": True}})
    try:
        vec = {"post_mlp": {2: (np.random.default_rng(0).standard_normal(512) * 4).astype(np.float32).tolist()}}

        def cond(threshold: float, phase: str = "both") -> dict:
            return {"site": "post_mlp.1", "probe": [1.0] * 512, "threshold": threshold, "mode": "hard",
                    "phase": phase, "stop_when": {"above": 0.5, "tokens": 3}}

        def sp(**extra) -> SamplingParams:
            return SamplingParams(max_tokens=16, ignore_eos=True, temperature=0, extra_args=extra or None)

        prompts = [TokensPrompt(prompt_token_ids=list(range(10 + i, 42 + i))) for i in range(4)]
        params = [sp(steering_vectors=vec, steering_condition=cond(-1e30)),
                  sp(steering_vectors=vec, steering_condition=cond(-1e30, "decode")),
                  sp(steering_vectors=vec, steering_condition=cond(1e30)),
                  sp()]
        both, decode, shut, plain = (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
        assert (both.finish_reason, len(both.token_ids), both.stop_reason) == ("stop_when", 3, "1"), both
        assert (decode.finish_reason, len(decode.token_ids), decode.stop_reason) == ("stop_when", 4, "1"), decode
        assert (shut.finish_reason, len(shut.token_ids), plain.finish_reason) == ("length", 16, "length")
        alone = llm.generate([prompts[2]], [sp()], use_tqdm=False)[0].outputs[0]
        assert shut.token_ids == alone.token_ids  # a shut gate scales the vector to nothing
    finally:
        llm.llm_engine.engine_core.shutdown()
