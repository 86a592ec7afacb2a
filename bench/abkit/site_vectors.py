"""The single-site work of the A/B suite (issue 31): one steered site, ``post_mlp`` of layer
--site-layer (clamped to the shape), and the 16 deterministic vectors every plugin compared on it gets.

hotwire-vllm reads them as files, ``<workdir>/hotwire_vectors/v0.pt`` .. ``v15.pt`` (``torch.save`` of
a ``(hidden,)`` float32 tensor; the id is the file name), and a request names an id, a layer and a
scale in ``vllm_xargs`` (the value is a JSON *string*). vllm-steer gets the same vectors as 16
registered modules (``ab_site_0`` ..) or inline in each request, packed for ``post_mlp`` at the layer.
hotwire adds at the end of decoder layer L's forward = the residual stream after layer L's MLP =
vllm-steer's ``post_mlp`` hook at layer L.
"""

from __future__ import annotations

import json
from pathlib import Path

N_SITE = 16
SITE_SEED = 31
SITE_HOOK = "post_mlp"
HOTWIRE_DIR = "hotwire_vectors"  # under the suite's workdir
# hotwire's slot bank (HOTWIRE_SLOTS, default 16) holds one slot per distinct (id, layer, scale); the
# arms use N_SITE at scale 1, so a peer check at another scale on the same server needs more
HOTWIRE_SLOTS = 2 * N_SITE


def site_layer(requested: int, shape: dict) -> int:
    """--site-layer clamped to the shape's layers (the tiny CPU shape has 2)."""
    return max(0, min(int(requested), shape["layers"] - 1))


def site_vectors(shape: dict, std: float, n: int = N_SITE):
    """(n, hidden) float32: ``np.random.default_rng(SITE_SEED)`` normal x ``std``."""
    import numpy as np

    return np.random.default_rng(SITE_SEED).standard_normal((n, shape["hidden"]), dtype=np.float32) * np.float32(std)


def hotwire_id(i: int) -> str:
    return f"v{i}"


def module_name(i: int) -> str:
    return f"ab_site_{i}"


def hotwire_field(i: int, layer: int, scale: float = 1.0) -> dict:
    """hotwire's request field for vector ``v{i}`` at ``layer``."""
    return {"vllm_xargs": {"hotwire": json.dumps({"id": hotwire_id(i), "layer": layer, "scale": scale})}}


def steer_vectors(vec, layer: int, pack_dtype: str, scale: float = 1.0) -> dict:
    """vllm-steer's ``steering_vectors`` value for one vector at ``post_mlp`` of ``layer`` (a scale
    other than 1 goes in the packed ``scales``)."""
    from vllm_steer.client import pack

    return {SITE_HOOK: pack(vec.reshape(1, -1), [layer], pack_dtype, scales=None if scale == 1.0 else [scale])}


def write_hotwire_vectors(folder: Path, shape: dict, std: float) -> Path:
    """The $HOTWIRE_VECTORS folder: ``v{i}.pt`` for the N_SITE site vectors (rewritten every call)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.pt"):
        old.unlink()
    for i, v in enumerate(site_vectors(shape, std)):
        torch.save(torch.from_numpy(v.copy()), folder / f"{hotwire_id(i)}.pt")
    return folder


def ctx_site(ctx: dict) -> tuple[int, object]:
    """(site layer, vectors) of a suite run, made once per ctx."""
    if "site" not in ctx:
        ctx["site"] = (ctx["site_layer"], site_vectors(ctx["shape"], ctx["std"]))
    return ctx["site"]
