"""The SAE edit transformers' forward hooks apply in the oracle tests: a site's SAE (``tests.sae_writers``
weights) clamped or reconstructed by the plain-torch reference (``kernels/sae_clamp/naive.py``), and the same SAE
with its W_enc / W_dec rounded to bfloat16, as the engine keeps a full pack's (TopK, reconstruct) weights."""

from __future__ import annotations

import dataclasses

import torch

from vllm_steer.kernels.sae_clamp import naive

ACT = {"relu": naive.RELU, "jumprelu": naive.JUMPRELU, "topk": naive.TOPK}
KIND = {"set": naive.SET, "add": naive.ADD, "scale": naive.SCALE}


def bf16_exact(w, biases: bool = False):
    """``w`` with W_enc / W_dec rounded to bfloat16 (the engine's full packs hold them so; the rounding itself is
    documented in kernels/sae_clamp/README.md), so the oracle computes with the same SAE; ``biases``: b_enc / b_dec
    too (an SAE whose file is bf16)."""

    def r(a):
        return torch.from_numpy(a).bfloat16().float().numpy()

    w = dataclasses.replace(w, w_enc=r(w.w_enc), w_dec=r(w.w_dec))
    return dataclasses.replace(w, b_enc=r(w.b_enc), b_dec=r(w.b_dec)) if biases else w


def sae_edit(weights, mode: str, clamps: list):
    """The stream edit (``h -> h'``, any leading shape) of ``weights`` in ``mode`` ("delta" / "reconstruct") with
    ``clamps`` (the request's ``[{"feature", "kind", "value", "only_if_active"?}]``), every token."""
    f = weights.meta.d_sae
    sae = naive.Sae(torch.from_numpy(weights.w_enc), torch.from_numpy(weights.b_enc), torch.from_numpy(weights.w_dec),
                    torch.from_numpy(weights.b_dec), ACT[weights.meta.activation],
                    None if weights.threshold is None else torch.from_numpy(weights.threshold), weights.meta.k,
                    weights.meta.b_dec_in)
    kind = torch.zeros(2, f, dtype=torch.int8)
    value = torch.zeros(2, f)
    only = torch.zeros(2, f, dtype=torch.int8)
    for c in clamps:
        kind[1, c["feature"]], value[1, c["feature"]] = KIND[c["kind"]], c["value"]
        only[1, c["feature"]] = int(c.get("only_if_active", False))
    modes = torch.tensor([naive.OFF, naive.DELTA if mode == "delta" else naive.RECONSTRUCT], dtype=torch.int8)

    def fn(h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        index = torch.ones(flat.shape[0], dtype=torch.int32)
        out = naive.sae_clamp_naive(flat.float().cpu(), index, sae, modes, kind, value, only)
        return out.to(h.device, h.dtype).reshape(h.shape)

    return fn
