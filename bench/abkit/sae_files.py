"""The SAE of the A/B suite's ``sae`` / ``sae_full`` servers: one random SAE per site at 4 layers
(d_sae 16384 by default), written once per workdir in the manifest format (bf16 safetensors), and the
``steer.sae`` blocks that load it (``sae``: 256 clampable features, delta only; ``sae_full``: the whole
SAE kept for reconstruct)."""

from __future__ import annotations

import json
from pathlib import Path

SAE_NAME = "ab_sae"
D_SAE = 16384
CLAMPABLE = 256
CLAMPED = 64  # features each request clamps, per site


def sae_layers(num_layers: int) -> list[int]:
    return [num_layers * i // 4 + num_layers // 8 for i in range(4)]


def _model_shape(model_dir: Path) -> tuple[int, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg["hidden_size"], cfg["num_hidden_layers"]


def ensure_sae_files(workdir: Path, model_dir: Path) -> Path:
    """The manifest folder (written on first use)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    root = workdir / "sae"
    if (root / "manifest.json").exists():
        return root
    hidden, layers = _model_shape(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sites = {}
    for layer in sae_layers(layers):
        def t(*shape: int, std: float) -> torch.Tensor:
            return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * std).to(torch.bfloat16)

        name = f"post_mlp_{layer}.safetensors"
        save_file({"W_enc": t(hidden, D_SAE, std=0.02), "W_dec": t(D_SAE, hidden, std=0.02),
                   "b_enc": t(D_SAE, std=0.01), "b_dec": t(hidden, std=0.01)}, str(root / name))
        sites[f"post_mlp.{layer}"] = name
    (root / "manifest.json").write_text(json.dumps({"format": "vllm-steer-sae", "version": 1, "activation": "relu",
                                                   "sites": sites}))
    return root


def sae_block(workdir: Path, model_dir: Path, full: bool) -> dict:
    root = ensure_sae_files(workdir, model_dir)
    entry = {"path": str(root), "features": list(range(0, D_SAE, D_SAE // CLAMPABLE))[:CLAMPABLE]}
    if full:
        entry["reconstruct"] = True
    return {"steer": {"max_configs": 272, "sae": {SAE_NAME: entry}}}


def sae_fields(n: int, seed: int, layers: int, mode: str) -> list[dict]:
    """n distinct ``sae`` fields: CLAMPED features SET at each of the 4 sites."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feats = list(range(0, D_SAE, D_SAE // CLAMPABLE))[:CLAMPABLE]
    out = []
    for _ in range(n):
        out.append([{"name": SAE_NAME, "site": f"post_mlp.{layer}", "mode": mode,
                     "clamps": [{"feature": int(f), "kind": "set", "value": float(v)}
                                for f, v in zip(rng.choice(feats, CLAMPED, replace=False), rng.uniform(1, 8, CLAMPED))]}
                    for layer in sae_layers(layers)])
    return out
