"""The steered norm's call shapes the kernel tests were written against (plain, SAE, conditional, both,
with capture), each one call of the single API (``steered_norm_naive`` / ``steered_norm_triton`` /
``torch.ops.vllm_steer.steered_norm``) with the matching feature descriptors. Tests only: the kernels have one
entry point; these keep the tests' cases and assertions as they were written. The Triton module is imported
on first use (``tests/interpreted`` sets TRITON_INTERPRET before)."""

from __future__ import annotations

import torch

from vllm_steer.kernels.steered_rms_norm.naive import steered_norm_naive


def _vec(table, flag) -> tuple:
    return () if table is None else (table, flag)


def _cond(cond_site, cond_params, probe, gate, site_ids) -> dict:
    return {"cond": (cond_site, cond_params, probe, site_ids), "gate": gate}


def _triton():
    from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton

    return steered_norm_triton


def _op():
    return torch.ops.vllm_steer.steered_norm


# --- the reference --------------------------------------------------------------------------------------------
def steered_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a=None, flag_a=None, table_b=None,
                           flag_b=None):
    return steered_norm_naive(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a),
                              _vec(table_b, flag_b))


def steered_sae_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                               sae_a, sae_b, topk_a, topk_b):
    return steered_norm_naive(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a),
                              _vec(table_b, flag_b), sae_a, sae_b, topk_a, topk_b)


def steered_cond_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                                cond_site, cond_params, probe, gate, site_ids):
    return steered_norm_naive(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a),
                              _vec(table_b, flag_b), **_cond(cond_site, cond_params, probe, gate, site_ids))


def steered_cond_sae_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                                    sae_a, sae_b, topk_a, topk_b, cond_site, cond_params, probe, gate, site_ids):
    return steered_norm_naive(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a),
                              _vec(table_b, flag_b), sae_a, sae_b, topk_a, topk_b,
                              **_cond(cond_site, cond_params, probe, gate, site_ids))


def steered_capture_rms_norm_naive(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                                   sae_a, sae_b, topk_a, topk_b, cond, pool, plan_a, plan_b):
    return steered_norm_naive(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a),
                              _vec(table_b, flag_b), sae_a, sae_b, topk_a, topk_b,
                              **(_cond(*cond) if cond is not None else {}), plan_a=plan_a, plan_b=plan_b, pool=pool)


# --- the Triton kernel ----------------------------------------------------------------------------------------
def steered_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a=None, flag_a=None, table_b=None,
                            flag_b=None):
    return _triton()(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a), _vec(table_b, flag_b))


def steered_sae_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                                sae_a, sae_b, split=None):
    return _triton()(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a), _vec(table_b, flag_b),
                     sae_a, sae_b, split=split)


def steered_cond_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                                 cond_site, cond_params, probe, gate, site_ids):
    return _triton()(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a), _vec(table_b, flag_b),
                     **_cond(cond_site, cond_params, probe, gate, site_ids))


def steered_cond_sae_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b,
                                     flag_b, sae_a, sae_b, cond_site, cond_params, probe, gate, site_ids, split=None):
    return _triton()(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a), _vec(table_b, flag_b),
                     sae_a, sae_b, **_cond(cond_site, cond_params, probe, gate, site_ids), split=split)


def steered_capture_rms_norm_triton(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                                    sae_a, sae_b, cond, pool, plan_a, plan_b, split=None):
    return _triton()(x, residual, weight, eps, weight_offset, index, _vec(table_a, flag_a), _vec(table_b, flag_b),
                     sae_a, sae_b, **(_cond(*cond) if cond is not None else {}), plan_a=plan_a, plan_b=plan_b,
                     pool=pool, split=split)


# --- the registered op ----------------------------------------------------------------------------------------
def op_steered_rms_norm(x, residual, weight, eps, weight_offset, index, table_a=None, flag_a=None, table_b=None,
                        flag_b=None):
    return _op()(x, residual, weight, eps, weight_offset, index, list(_vec(table_a, flag_a)),
                 list(_vec(table_b, flag_b)), [], [], 0, 0, [], None, None, None, None, [], [], [])


def op_steered_sae_rms_norm(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                            sae_a, sae_b, topk_a, topk_b):
    return _op()(x, residual, weight, eps, weight_offset, index, list(_vec(table_a, flag_a)),
                 list(_vec(table_b, flag_b)), list(sae_a), list(sae_b), topk_a, topk_b, [], None, None, None, None, [], [],
                 [])
