"""Gemma Scope's transcoder input on Gemma-2, the oracle both lanes use (``tests/test_families_and_compile.py`` on the
CPU engine, ``tests/gpu_e2e/test_gemma_scope_input_gpu.py`` on the GPU's kernels): a tiny Gemma-2 whose norm gains
are random (the fixture's are 0: a gain of 1 hides which input an encoder reads), a JumpReLU transcoder written as
sae-lens names Gemma Scope's (hook ``blocks.L.ln2.hook_normalized``), and transformers with hooks doing the clamps'
edit from Gemma Scope's input (gain-free) or from the pre-MLP norm's output (gain included)."""

from __future__ import annotations

import shutil

import numpy as np
import torch

from tests import hf_oracle
from tests.sae_writers import random_transcoder

# Gemma Scope's transcoders (google/gemma-scope-2b-pt-transcoders README, "Transcoder Input/Output Clarification",
# quoting arXiv:2408.05147v2 p. 18): "We fold the pre-MLP RMS norm gain parameters ... into the MLP input matrices
# ... and then train the transcoder on input activations just after the pre-MLP RMSNorm, to reconstruct the MLP
# sublayer's output". So the input is transformers' pre_feedforward_layernorm without its gain (1 + weight):
# Gemma2RMSNorm._norm of its input, which is TransformerLens' ``ln2.hook_normalized`` (its RMSNorm hooks x / scale
# before ``* w``), the hook sae-lens names; the output, the MLP block's addition to the stream, is
# post_feedforward_layernorm's output (sae-lens' ``hook_mlp_out``).
GS_LAYER, GS_F = 1, 64
GS_TC = random_transcoder(128, GS_F, "jumprelu", seed=51)
GS_TC.w_dec[:] *= 10  # edits that move this tiny model's logprobs well past the tolerance
GS_CLAMPS = [{"feature": j, "kind": "scale", "value": 0.0 if j % 2 else 3.0} for j in range(GS_F)]
GAIN_STD = 0.5


def with_norm_gains(path, out) -> str:
    """A copy of the checkpoint ``path`` whose RMSNorm weights are random (N(0, GAIN_STD): Gemma's gain 1 + w)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    (file,) = out.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(52)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.randn(t.shape, generator=g) * GAIN_STD
    save_file(tensors, file, metadata={"format": "pt"})
    return str(out)


def gemma_scope_edits(model, gain_free: bool = True) -> list:
    """Hooks on transformers' Gemma-2 layer GS_LAYER adding the clamps' edit to the MLP block's output
    (post_feedforward_layernorm's): ``(f' - f) @ W_dec``, f = JumpReLU(u @ W_enc + b_enc) of u, the stream
    entering pre_feedforward_layernorm normalized by its own ``_norm`` (``gain_free``: Gemma Scope's input) or
    that norm's output (gain included: what a hook on the MLP's input reads)."""
    block = model.model.layers[GS_LAYER]
    w = {k: torch.from_numpy(v) for k, v in (("enc", GS_TC.w_enc), ("b", GS_TC.b_enc), ("dec", GS_TC.w_dec),
                                            ("thr", GS_TC.threshold))}
    scale = torch.tensor([c["value"] for c in GS_CLAMPS])
    seen = {}

    def pre_norm(module, args, output):
        seen["u"] = module._norm(args[0].float()) if gain_free else output.float()

    def post_norm(module, args, output):
        z = seen["u"] @ w["enc"] + w["b"]
        f = torch.where(z > w["thr"], z, torch.zeros_like(z))
        return output + ((f * scale - f) @ w["dec"]).to(output.dtype)

    return [block.pre_feedforward_layernorm.register_forward_hook(pre_norm),
            block.post_feedforward_layernorm.register_forward_hook(post_norm)]


def gemma_scope_refs(got: dict, path: str, ids: list[int]) -> dict:
    """Transformers teacher-forced on the engine's tokens with the transcoder's edit from each input (gain-free:
    Gemma Scope's; gain included) and the engine's largest logprob distance to each."""
    model, _ = hf_oracle.load(path)
    refs = {}
    for gain_free in (True, False):
        handles = gemma_scope_edits(model, gain_free)
        try:
            refs[gain_free] = hf_oracle.teacher_forced(model, ids, got["token_ids"])
        finally:
            for h in handles:
                h.remove()
    refs["gap"] = {k: float(np.abs(got["logprobs"] - refs[k]["logprobs"]).max()) for k in (True, False)}
    return refs


