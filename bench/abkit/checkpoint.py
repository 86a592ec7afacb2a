"""The GPU check's model and inputs: a random-weight Llama checkpoint (float32, fixed seed) with the
offline test tokenizer, the check's prompts, and its steering vectors in the request forms."""

from __future__ import annotations

import os
from pathlib import Path

from .common import ensure_repo_on_path

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


def build_checkpoint(path: Path, args) -> "object":
    """Random-weight Llama (float32, fixed seed) + the offline test tokenizer; returns the tokenizer.

    ``args`` has layers, hidden, intermediate, heads, kv_heads, vocab."""
    import torch
    import transformers

    os.environ.setdefault("VLLM_STEER_TEST_CACHE", str(path.parent / "fixture-cache"))
    ensure_repo_on_path()
    from tests.fixtures.models import tokenizer as fixture_tokenizer

    tok = fixture_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        initializer_range=0.05,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    return tok


def vectors_for(spec: dict, hidden: int, scale: float) -> dict[str, dict[int, "object"]]:
    import numpy as np

    return {
        hook: {layer: (np.random.default_rng(seed).standard_normal(hidden) * scale).astype(np.float32)
               for layer, seed in layers.items()}
        for hook, layers in spec.items()
    }


def as_request_field(vecs: dict) -> dict:
    """{hook: {layer: np}} -> the request's ``steering_vectors`` ({hook: {"layer": [floats]}})."""
    return {hook: {str(l): v.tolist() for l, v in layers.items()} for hook, layers in vecs.items()}


def as_packed_field(vecs: dict) -> dict:
    """{hook: {layer: np}} -> the packed request form (base64 float32, one [n_layers, D] block)."""
    import base64

    import numpy as np

    out = {}
    for hook, layers in vecs.items():
        ids = sorted(layers)
        arr = np.ascontiguousarray(np.stack([layers[i] for i in ids]), dtype=np.float32)
        out[hook] = {"dtype": "float32", "shape": list(arr.shape), "layer_indices": ids,
                     "data": base64.b64encode(arr.tobytes()).decode()}
    return out
