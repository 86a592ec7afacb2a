"""The forward of a steered hyper-connection layer (``runtime.families``' ``hyper`` adapter: DeepSeek-V4's mHC).

vLLM 0.26's ``DeepseekV4DecoderLayer`` never calls its ``attn_norm`` / ``ffn_norm``: each mHC kernel merges the n
streams into the sublayer's input and applies the norm in the same write (``norm_weight=``). A layer with a steered
norm gets this forward instead (install swaps its class, only where one of its norms is steered): vLLM's, statement
for statement, except that a steered norm's kernel is called with ``norm_weight=None`` (it returns the merged stream,
the same kernel family's unfused variant) and the steered norm reads that merged stream, adds the vector, captures it
and normalizes it in one ``steered_norm`` launch. An unsteered norm of the same layer stays fused. The first layer,
whose input is the embedding ``[T, D]``, has only a fused broadcast kernel: where its attention norm is steered, the
embedding is expanded to the n streams ``[T, n, D]`` first (what the broadcast kernel reads it as).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

KERNELS = ("mhc_pre_broadcast_tilelang", "mhc_pre_tilelang", "mhc_fused_post_pre_tilelang")


def kernels(base: type) -> tuple:
    """The mHC kernels the layer class's own forward calls (its module's globals), for ``layer_forward``."""
    module = vars(sys.modules[base.__module__])
    return tuple(module[name] for name in KERNELS)


def _fused(norm: nn.Module) -> tuple[torch.Tensor | None, float]:
    """(norm_weight, eps) for the mHC kernel: None where the norm is steered (the layer calls it itself)."""
    return (None if hasattr(type(norm), "_vs_base") else norm.weight.data), norm.variance_epsilon


def layer_forward(self, x: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor | None,
                  post_mix: torch.Tensor | None = None, res_mix: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None):
    """vLLM 0.26's DeepseekV4DecoderLayer.forward (``runtime.families._HYPER_PRE`` / ``_HYPER_FFN``) with each
    steered norm unfused from its mHC kernel (module docstring)."""
    mhc_pre_broadcast_tilelang, mhc_pre_tilelang, mhc_fused_post_pre_tilelang = self._vs_mhc
    mix = (self.rms_norm_eps, self.hc_eps, self.hc_eps, self.hc_post_alpha, self.hc_sinkhorn_iters)
    attn_norm_weight, attn_norm_eps = _fused(self.attn_norm)
    if residual is None:
        if x.dim() == 2 and attn_norm_weight is not None:
            residual, post_mix, res_mix, x = mhc_pre_broadcast_tilelang(
                x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *mix, norm_weight=attn_norm_weight,
                norm_eps=attn_norm_eps, fn_broadcast=self.hc_attn_fn_broadcast)
        else:
            if x.dim() == 2:  # the embedding, as the n equal streams the broadcast kernel reads
                x = x.unsqueeze(-2).expand(-1, self.hc_mult, -1).contiguous()
            residual = x
            post_mix, res_mix, x = mhc_pre_tilelang(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *mix,
                                                    norm_weight=attn_norm_weight, norm_eps=attn_norm_eps)
    else:
        residual, post_mix, res_mix, x = mhc_fused_post_pre_tilelang(
            x, residual, post_mix, res_mix, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *mix, n_splits=1,
            tile_n=1, norm_weight=attn_norm_weight, norm_eps=attn_norm_eps)
    if attn_norm_weight is None:
        x = self.attn_norm(x)
    x = self.attn(positions, x, None)

    ffn_norm_weight, ffn_norm_eps = _fused(self.ffn_norm)
    residual, post_mix, res_mix, x = mhc_fused_post_pre_tilelang(
        x, residual, post_mix, res_mix, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, *mix, n_splits=1,
        tile_n=1, norm_weight=ffn_norm_weight, norm_eps=ffn_norm_eps)
    if ffn_norm_weight is None:
        x = self.ffn_norm(x)
    x = self.ffn(x, input_ids)
    return x, residual, post_mix, res_mix
