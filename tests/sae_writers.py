"""Writers of small SAE files in each format ``vllm_steer.core.sae_files`` reads (Gemma Scope params.npz,
sae-lens directories, our manifest), written with the real libraries (numpy, safetensors + torch)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from vllm_steer.core.sae_files import SaeMeta, SaeWeights

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}


def random_sae(d_model: int, d_sae: int, activation: str = "relu", k: int = 0, seed: int = 0,
               b_dec_in: bool = False) -> SaeWeights:
    """A float32 SAE with small random weights (std ~0.1) and positive thresholds for jumprelu."""
    g = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (g.normal(0.0, 0.1, size=shape)).astype(np.float32)

    threshold = (g.uniform(0.01, 0.2, size=d_sae)).astype(np.float32) if activation == "jumprelu" else None
    meta = SaeMeta(d_model=d_model, d_sae=d_sae, activation=activation, k=k, dtype="float32", b_dec_in=b_dec_in)
    return SaeWeights(meta=meta, w_enc=normal(d_model, d_sae), b_enc=normal(d_sae), w_dec=normal(d_sae, d_model),
                      b_dec=normal(d_model), threshold=threshold)


def tensors_of(w: SaeWeights) -> dict[str, np.ndarray]:
    """The arrays under the names every format uses."""
    out = {"W_enc": w.w_enc, "W_dec": w.w_dec, "b_enc": w.b_enc, "b_dec": w.b_dec}
    if w.threshold is not None:
        out["threshold"] = w.threshold
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray], dtype: str = "float32") -> str:
    """``tensors`` cast to ``dtype`` (torch's rounding) and saved by safetensors.torch."""
    save_file({k: torch.from_numpy(np.array(v)).to(_TORCH_DTYPES[dtype]) for k, v in tensors.items()},
              path)
    return path


def write_json(path: str, data: dict[str, Any]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path


def write_gemma_scope(dir: str, w: SaeWeights, dtype: str = "float32") -> str:
    """``dir/params.npz`` as Gemma Scope ships it; returns ``dir``."""
    os.makedirs(dir, exist_ok=True)
    np.savez(os.path.join(dir, "params.npz"), **{k: v.astype(dtype) for k, v in tensors_of(w).items()})
    return dir


def _lens_cfg(w: SaeWeights, hook_name: str, dtype: str, new_format: bool) -> dict[str, Any]:
    m = w.meta
    base = {"d_in": m.d_model, "d_sae": m.d_sae, "dtype": dtype, "device": "cpu",
            "apply_b_dec_to_input": m.b_dec_in, "normalize_activations": "none"}
    if new_format:  # sae-lens 6: architecture names the activation, run metadata under "metadata"
        arch = {"relu": "standard"}.get(m.activation, m.activation)
        cfg = {**base, "architecture": arch, "reshape_activations": "none",
               "metadata": {"model_name": "tiny", "hook_name": hook_name, "sae_lens_version": "6.18.0"}}
        if m.activation == "topk":
            cfg["k"] = m.k
        return cfg
    act = "topk" if m.activation == "topk" else "relu"  # sae-lens < 6: activation_fn_str + kwargs
    return {**base, "architecture": "jumprelu" if m.activation == "jumprelu" else "standard",
            "model_name": "tiny", "hook_name": hook_name, "hook_layer": 0, "hook_head_index": None,
            "activation_fn_str": act, "activation_fn_kwargs": {"k": m.k} if act == "topk" else {},
            "finetuning_scaling_factor": False, "sae_lens_training_version": "3.5.0", "context_size": 128}


def write_sae_lens(dir: str, w: SaeWeights, hook_name: str = "blocks.3.hook_resid_post", dtype: str = "float32",
                   new_format: bool = True, log_threshold: bool = False) -> str:
    """A sae-lens SAE directory (cfg.json + sae_weights.safetensors); returns ``dir``.

    ``log_threshold`` stores a jumprelu threshold as its log, as sae-lens training SAEs hold it."""
    os.makedirs(dir, exist_ok=True)
    tensors = tensors_of(w)
    if log_threshold:
        tensors["log_threshold"] = np.log(tensors.pop("threshold"))
    write_safetensors(os.path.join(dir, "sae_weights.safetensors"), tensors, dtype)
    write_json(os.path.join(dir, "cfg.json"), _lens_cfg(w, hook_name, dtype, new_format))
    return dir


def write_manifest(dir: str, saes: dict[str, SaeWeights], activation: str, k: int = 0, b_dec_in: bool = False,
                   dtype: str = "float32") -> str:
    """Our manifest format: ``manifest.json`` plus one safetensors file per site; returns ``dir``."""
    os.makedirs(dir, exist_ok=True)
    sites = {}
    for site, w in saes.items():
        name = site.replace(".", "_") + ".safetensors"
        write_safetensors(os.path.join(dir, name), tensors_of(w), dtype)
        sites[site] = name
    manifest: dict[str, Any] = {"format": "vllm-steer-sae", "version": 1, "activation": activation,
                                "b_dec_in": b_dec_in, "sites": sites}
    if activation == "topk":
        manifest["k"] = k
    write_json(os.path.join(dir, "manifest.json"), manifest)
    return dir


TRANSCODER_ARCHS = {("relu", False): "transcoder", ("relu", True): "skip_transcoder",
                    ("jumprelu", False): "jumprelu_transcoder", ("jumprelu", True): "jumprelu_skip_transcoder"}


def random_transcoder(d_model: int, d_sae: int, activation: str = "relu", seed: int = 0) -> SaeWeights:
    """A float32 transcoder (d_out = d_in = ``d_model``) as ``random_sae`` makes an SAE; its meta says so."""
    w = random_sae(d_model, d_sae, activation, seed=seed)
    return SaeWeights(meta=SaeMeta(d_model=d_model, d_sae=d_sae, activation=activation, k=0, dtype="float32",
                                   b_dec_in=False, transcoder=True),
                      w_enc=w.w_enc, b_enc=w.b_enc, w_dec=w.w_dec, b_dec=w.b_dec, threshold=w.threshold)


def write_sae_lens_transcoder(dir: str, w: SaeWeights, layer: int, skip: bool = False, dtype: str = "float32",
                              hook_name: str | None = None, **cfg_overrides: Any) -> str:
    """A sae-lens 6 transcoder directory as ``Transcoder.save_model`` writes it (cfg.json with d_out and the
    metadata's hook_name / hook_name_out, weights W_enc, b_enc, W_dec, b_dec, threshold for jumprelu, W_skip
    [d_out, d_in] for a skip transcoder); returns ``dir``."""
    os.makedirs(dir, exist_ok=True)
    tensors = tensors_of(w)
    if skip:
        tensors["W_skip"] = (np.random.default_rng(7).normal(0.0, 0.05, size=(w.meta.d_model, w.meta.d_model))
                             .astype(np.float32))
    write_safetensors(os.path.join(dir, "sae_weights.safetensors"), tensors, dtype)
    cfg = {"d_in": w.meta.d_model, "d_sae": w.meta.d_sae, "d_out": w.meta.d_model, "dtype": dtype, "device": "cpu",
           "apply_b_dec_to_input": False, "normalize_activations": "none", "reshape_activations": "none",
           "architecture": TRANSCODER_ARCHS[(w.meta.activation, skip)],
           "metadata": {"model_name": "tiny", "hook_name": hook_name or f"blocks.{layer}.mlp.hook_in",
                        "hook_name_out": f"blocks.{layer}.hook_mlp_out", "sae_lens_version": "6.54.12"}}
    write_json(os.path.join(dir, "cfg.json"), {**cfg, **cfg_overrides})
    return dir


def sparsify_cfg(w: SaeWeights, **overrides: Any) -> dict[str, Any]:
    """The cfg.json sparsify 1.3.3's ``save_to_disk`` writes for a TopK SAE (``SparseCoderConfig.to_dict()`` + d_in)."""
    cfg = {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True, "num_latents": w.meta.d_sae,
           "k": w.meta.k, "multi_topk": False, "skip_connection": False, "transcode": False, "d_in": w.meta.d_model}
    return {**cfg, **overrides}


def write_sparsify(dir: str, w: SaeWeights, dtype: str = "float32", extra: dict[str, np.ndarray] | None = None,
                   **cfg_overrides: Any) -> str:
    """A sparsify hookpoint folder as ``SparseCoder.save_to_disk`` writes it (``dir``'s name is the hookpoint,
    e.g. ``layers.3``): cfg.json and sae.safetensors (encoder.weight = W_enc.T [F, D], encoder.bias, W_dec,
    b_dec, and ``extra`` arrays); returns ``dir``. tests/test_sae_sparsify.py checks it against sparsify's own."""
    os.makedirs(dir, exist_ok=True)
    tensors = {"encoder.weight": np.ascontiguousarray(w.w_enc.T), "encoder.bias": w.b_enc, "W_dec": w.w_dec,
               "b_dec": w.b_dec, **(extra or {})}
    write_safetensors(os.path.join(dir, "sae.safetensors"), tensors, dtype)
    write_json(os.path.join(dir, "cfg.json"), sparsify_cfg(w, **cfg_overrides))
    return dir
