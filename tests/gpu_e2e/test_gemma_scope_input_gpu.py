"""Gemma Scope's transcoder input through the served engine on a GPU (compiled, CUDA graphs; the norm kernel's
clamp walk encodes the transcoder at post_attn.L): the tiny Gemma-2 of the fixtures with random norm gains and a
JumpReLU transcoder hooked as sae-lens names Gemma Scope's (``blocks.1.ln2.hook_normalized``), against transformers
with the clamps' edit encoded from Gemma Scope's input, the pre-MLP RMSNorm's output without its gain (source and
oracle: ``tests/gemma_scope_input.py``). The CPU lane runs the same check in the Gemma-2 job of
``tests/test_families_and_compile.py`` (the worker folds the norm's gain into W_enc: ``runtime.sae_tables.gain_folded``).
Run: ``CHECKS=tests/gpu_e2e/test_gemma_scope_input_gpu.py bash bench/gpu_session.sh checks``."""

from __future__ import annotations


import numpy as np
import pytest

from tests.gemma_scope_input import GS_CLAMPS, GS_LAYER, GS_TC, gemma_scope_refs, with_norm_gains
from tests.gpu_e2e import engine_case as ec
from tests.sae_writers import write_sae_lens_transcoder

pytestmark = ec.needs_device

STEPS = 10
LOGPROB_TOL = 1e-3 if ec.CPU else 0.05  # as test_sae_full_engine_gpu: TF32 GEMMs on the GPU


@pytest.fixture(scope="module")
@ec.one_engine_run
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma_scope")
    from tests.fixtures.models import cache_default, tiny_model

    with cache_default(d / "fixture-cache"):
        path = with_norm_gains(tiny_model("gemma2"), d / "gemma2-gains")
    tc = write_sae_lens_transcoder(str(d / "gst"), GS_TC, GS_LAYER, hook_name=f"blocks.{GS_LAYER}.ln2.hook_normalized")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)("the robot said hello to the sun")["input_ids"]
    llm = ec.make_llm(path, {"max_configs": 8, "sae": {"gst": {"path": tc}}})
    try:
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, detokenize=False, logprobs=0,
                                 extra_args=extra) for extra in (None, {"sae": {"name": "gst", "clamps": GS_CLAMPS}})]
        plain, clamped = ec.generate(llm, [ids, ids], params)
    finally:
        ec.shutdown(llm)
    return {"path": path, "ids": ids, "plain": plain, "clamped": clamped}


def _refs(run) -> dict:
    got = {"token_ids": run["clamped"]["tokens"], "logprobs": np.asarray(run["clamped"]["logprobs"])}
    return gemma_scope_refs(got, run["path"], run["ids"])


def test_the_clamps_move_the_served_tokens_and_the_oracles_differ(run):
    refs = _refs(run)
    assert run["clamped"]["tokens"] != run["plain"]["tokens"]
    # the oracle check discriminates: the engine is outside the tolerance of the oracle with the gain, and far closer
    # to the gainless one (s34's H200: 0.0003 vs 0.082; the GPU's tolerance is TF32's, so no fixed multiple of it)
    assert refs["gap"][False] > max(LOGPROB_TOL, 5 * refs["gap"][True]), refs["gap"]


def test_served_gemma_scope_transcoder_encodes_the_pre_mlp_norm_without_its_gain(run):
    refs = _refs(run)
    ec.check_forced(run["clamped"], refs[True], None, LOGPROB_TOL, LOGPROB_TOL, 0.0)
