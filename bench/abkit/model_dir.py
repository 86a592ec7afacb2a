"""Model shapes of the A/B suite and the model directory (config.json + an offline tokenizer) of one.

The servers load it with ``--load-format dummy``: random weights, no checkpoint files.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # Llama-3-8B shape (GQA 8 kv heads); weights are random (--load-format dummy)
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    # Llama-3.2-1B-like shape, for quick runs
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256),
    # CPU dry runs (vLLM CPU attention needs head_dim >= 32)
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=2048),
}


def write_model_dir(path: Path, shape: dict, dtype: str) -> Path:
    """config.json (LlamaForCausalLM) + a word-level tokenizer covering the whole vocab (offline)."""
    if (path / ".complete").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab_n = shape["vocab"]
    bos, eos = vocab_n - 2, vocab_n - 1
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"],
        "vocab_size": vocab_n,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_n)}
    vocab.pop(f"t{bos}")
    vocab.pop(f"t{eos}")
    vocab["<s>"], vocab["</s>"] = bos, eos
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                      unk_token="t0", pad_token="</s>", model_max_length=8192)
    wrapped.save_pretrained(path)
    (path / ".complete").touch()
    return path
