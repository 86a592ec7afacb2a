"""The row wait's refusal on a GPU engine (V2 runner, torch.compile, CUDA graphs, vLLM's async
scheduling): with one usable row held by a long request, a request with another config is finished
with ``finish_reason="error"`` and the 503 refusal in ``stop_reason`` after ``max_row_wait_s``, the
holder's tokens equal its run alone. Run on the GPU machine (``VLLM_PLUGINS=steer``); skipped without CUDA. CI's CPU lane has the same
behaviour over HTTP in tests/test_operating_limits.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _config_dir(tmp_path) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
           "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
           "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
           "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_a_request_waiting_past_the_bound_is_refused_and_the_holder_is_untouched(tmp_path):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_steer.core.refusals import decode

    os.environ.setdefault("VLLM_PLUGINS", "steer")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process touched CUDA (the skip check)
    llm = LLM(model=_config_dir(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              gpu_memory_utilization=0.3, additional_config={"steer": {"max_configs": 2, "max_row_wait_s": 0.5}})
    try:
        rng = np.random.default_rng(0)
        vec = lambda: {"post_mlp": {2: (rng.standard_normal(512) * 4).astype(np.float32).tolist()}}  # noqa: E731
        prompt = TokensPrompt(prompt_token_ids=list(range(10, 42)))
        long = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0, extra_args={"steering_vectors": vec()})
        short = SamplingParams(max_tokens=8, temperature=0, extra_args={"steering_vectors": vec()})
        alone = llm.generate([prompt], [long], use_tqdm=False)[0].outputs[0]
        held, refused = (o.outputs[0] for o in llm.generate([prompt, prompt], [long, short], use_tqdm=False))
        assert held.token_ids == alone.token_ids and held.finish_reason == "length"
        assert refused.finish_reason == "error" and not refused.token_ids
        r = decode(refused.stop_reason)
        assert r is not None and r.status == 503 and "steer.max_row_wait_s" in r.message, refused.stop_reason
        (status,) = llm.collective_rpc("vllm_steer_status")
        assert status["peak_live_configs"] == 1  # never a second row (the last request's is freed next step)
    finally:
        llm.llm_engine.engine_core.shutdown()
