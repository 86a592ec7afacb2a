"""DeepSeek's block FP8 for the tiny DeepSeek-V4 oracle's ``wo_a`` (tests/gpu_e2e/test_deepseek_v4_gpu.py).

vLLM 0.26's CUDA V4 attention (FlashMLA and FlashInfer backends alike) projects its output with DeepGEMM's FP8 einsum
on ``wo_a.weight`` / ``wo_a.weight_scale_inv`` (``vllm/models/deepseek_v4/nvidia/ops/o_proj.py``): a bfloat16 wo_a
cannot run. So the checkpoint vLLM reads has wo_a as float8 e4m3 in 128 x 128 blocks, each with a float32
power-of-two scale (DeepSeek's ``.scale``: the dequantizing factor; ``expert_dtype: fp8`` makes vLLM read float32
scales), and lists every other FP8-capable linear layer as unquantized; transformers reads wo_a dequantized, which the
power-of-two scales make exact in bfloat16. No engine here: tests/test_hyper_connections.py checks it on CPU.
"""

from __future__ import annotations

import torch

BLOCK = 128  # DeepSeek's FP8 weight blocks (vLLM's weight_block_size)


def fp8_wo_a(weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(vLLM's tensors, transformers' tensors) from DeepSeek-named bfloat16 ``weights``: each ``attn.wo_a.weight`` as
    float8 with its ``attn.wo_a.scale`` for vLLM, dequantized for transformers; every other tensor the same in both."""
    engine, exact = dict(weights), dict(weights)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for name, w in weights.items():
        if not name.endswith(".attn.wo_a.weight"):
            continue
        out, inp = w.shape
        blocks = w.float().reshape(out // BLOCK, BLOCK, inp // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
        scale = torch.exp2(torch.ceil(torch.log2(amax / fp8_max)))  # q * scale is exact in bfloat16
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        deq = (q.float() * scale[:, None, :, None]).reshape(out, inp)
        engine[name] = q.reshape(out, inp)
        engine[name.removesuffix("weight") + "scale"] = scale.contiguous()
        exact[name] = deq.to(torch.bfloat16)
    return engine, exact


def unquantized_layers(layers: int, indexed: tuple[int, ...]) -> list[str]:
    """vLLM's names of the FP8-capable linear layers other than wo_a, for ``layers`` decoder layers of which
    ``indexed`` have the indexer (compress ratio 4)."""
    names = []
    for layer in range(layers):
        attn, ffn = f"model.layers.{layer}.attn", f"model.layers.{layer}.ffn"
        names += [f"{attn}.fused_wqa_wkv", f"{attn}.wq_a", f"{attn}.wkv", f"{attn}.wq_b", f"{attn}.wo_b",
                  f"{ffn}.shared_experts.gate_up_proj", f"{ffn}.shared_experts.down_proj", f"{ffn}.experts"]
    return names + [f"model.layers.{layer}.attn.indexer.wq_b" for layer in indexed]


def quantization_config(layers: int, indexed: tuple[int, ...]) -> dict:
    """config.json's ``quantization_config`` (with ``expert_dtype: fp8`` beside it): block FP8 at wo_a only."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK] * 2,
            "ignored_layers": unquantized_layers(layers, indexed)}
