"""Registers ``torch.ops.vllm_steer.steered_norm``: the one steered norm op (mutates ``gate`` and ``pool``
when given), and ``steered_norm_plain``, the same op for a plain site (vectors and capture only).

Opaque to Inductor (so zero tables are never folded away), it takes the place of vLLM's fused
add + RMSNorm at hooked norms: the steering costs no launch of its own. Each feature crosses the schema
as its descriptor: ``vec_a`` / ``vec_b`` (``Tensor[]``: table, flag), ``sae_a`` / ``sae_b`` (``Tensor[]``:
the SAE pack) with their TopK k (``int``), ``cond`` (``Tensor[]``: site words, params, probes, site ids)
with the mutated ``gate`` (``Tensor?``), and capture as ``plan_a`` / ``plan_b`` (``Tensor?``) with the
mutated ``pool`` (``Tensor?``), ``proj_a`` / ``proj_b`` (``Tensor[]``: live count, directions, bounds), ``tc``
(``Tensor[]``: a transcoder's pack, at the norm that makes the MLP's input; required: a schema cannot default a
tensor list) and its TopK k ``topk_tc`` (``int``, default 0: last, so callers without a TopK transcoder omit it).
An empty list or None turns the feature off; which features a norm has is
fixed at install, so every traced call has the same arguments, all of them graph inputs (buffers).

``steered_norm_plain`` (x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, plan_a,
plan_b, pool: a slot's table and flag None where it has none; mutates ``pool``) is what the norms without SAE packs,
conditions, projections or a transcoder call: the dispatcher converts every argument of a call, from Python and back,
and a call of the full schema (20 arguments, 8 tensor lists) costs twice one of these 13 (CPU box: no-op ops,
7.9 vs 3.2 µs), on every eager launch (a prefill step above the graph sizes: 64 at the 8b shape).

``steered_norm_plain_ar`` and ``steered_norm_ar`` (each the same arguments, then ``group_name``) are the two ops of
vLLM's TP all-reduce of ``x``, the all-reduce inside the launch where the group has a workspace
(``runtime.allreduce_fusion``, opt-in).

CUDA tensors run the Triton kernel (one launch); a slot whose SAE pack is full (TopK, or a site that allows
reconstruct) first gets its on tokens' edit from the tensor-core kernels of ``kernels/sae_clamp/full_triton.py``
(a few launches that exit at once when no row is on), which the norm adds where the slot's clamps go (a full
transcoder pack, TopK: its edit encoded from the norm's output, which the gather recomputes, added after the norm)
(``VLLM_STEER_SAE_FULL_KERNELS=0`` sends full packs through the plain-torch reference instead). Other devices run
the plain-torch reference.
"""

from __future__ import annotations

import inspect
import os

import torch

from vllm_steer.kernels.capture_rows import live
from vllm_steer.kernels.library import LIB
from vllm_steer.kernels.sae_clamp.packed import N_FULL
from vllm_steer.kernels.steered_rms_norm.naive import quant_fp8_group_naive, quant_fp8_naive, steered_norm_naive

_registered = False
# The full-pack kernels (kernels/sae_clamp/full_triton.py): on since the twenty-fifth session, when the served-engine
# oracle (tests/gpu_e2e/test_sae_full_engine_gpu.py) passed on a GPU; "0" runs full packs through the reference.
FULL_KERNELS = os.environ.get("VLLM_STEER_SAE_FULL_KERNELS", "1") == "1"
_triton_norm = None  # kernels.steered_rms_norm.triton.steered_norm_triton, imported on first CUDA call


def _impl(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    index: torch.Tensor,
    vec_a: list[torch.Tensor],
    vec_b: list[torch.Tensor],
    sae_a: list[torch.Tensor],
    sae_b: list[torch.Tensor],
    topk_a: int,
    topk_b: int,
    cond: list[torch.Tensor],
    gate: torch.Tensor | None,
    plan_a: torch.Tensor | None,
    plan_b: torch.Tensor | None,
    pool: torch.Tensor | None,
    proj_a: list[torch.Tensor],
    proj_b: list[torch.Tensor],
    tc: list[torch.Tensor],
    topk_tc: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    full = len(sae_a) == N_FULL or len(sae_b) == N_FULL or len(tc) == N_FULL
    if pool is not None:
        live.ready(plan_a, plan_b)  # an eager step's capture plan, left to its first capturing op
    if pool is not None and not x.is_cuda and live.may_skip(False):  # CPU: nothing captured this step, plans empty
        plan_a = plan_b = pool = None
    args = (x, residual, weight, eps, weight_offset, index, vec_a, vec_b, sae_a, sae_b, topk_a, topk_b, cond, gate,
            plan_a, plan_b, pool, proj_a, proj_b, tc, topk_tc)
    return triton_path(*args) if x.is_cuda and (FULL_KERNELS or not full) else steered_norm_naive(*args)


def _param(name: str, annotation: str, default=inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


def _schema_of(base, *extra: inspect.Parameter, returns: str | None = None) -> inspect.Signature:
    """``base``'s signature, then the parameters ``extra`` (``returns``: another return annotation)."""
    sig = inspect.signature(base)
    return sig.replace(parameters=[*sig.parameters.values(), *extra],
                       return_annotation=sig.return_annotation if returns is None else returns)


def _with_schema(base, *extra: inspect.Parameter, returns: str | None = None):
    """Gives the decorated function ``_schema_of(base, *extra, returns)`` as its signature (the op schema is inferred
    from it), itself unchanged: the dispatcher passes every argument positionally, so a function of ``*args`` serves
    without a wrapper's frame on each eager launch."""
    def wrap(fn):
        fn.__signature__ = _schema_of(base, *extra, returns=returns)
        return fn
    return wrap


def _and_group_name(base):
    """Gives the decorated op function ``base``'s parameters and then ``group_name: str = ""`` (the TP group whose
    all-reduce is in the op) as its signature, which the op's schema is inferred from: each ``_ar`` op is its base op's
    schema plus one argument, written once; the function gets every argument positionally, defaults filled."""
    def wrap(fn):
        sig = _schema_of(base, _param("group_name", "str", ""))
        n = len(sig.parameters)

        def op(*args, **kwargs):
            if kwargs or len(args) < n:  # a caller that named arguments or left defaults out
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                args = tuple(bound.arguments.values())
            return fn(*args)

        op.__signature__, op.__name__, op.__doc__ = sig, fn.__name__, fn.__doc__
        return op
    return wrap


@_and_group_name(_impl)
def _impl_ar(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``steered_norm_ar``: ``steered_norm`` of vLLM's TP all-reduce of ``x`` (this rank's partial) over
    ``group_name``, as ``plain_ar`` for the plain op: one launch where the group has a workspace, the batch fits and
    no slot holds a full SAE pack (its edit is computed from ``x`` before the norm); else the all-reduce, then
    ``steered_norm``."""
    *base, group_name = args
    x, sae_a, sae_b, tc = base[0], base[8], base[9], base[19]
    full = len(sae_a) == N_FULL or len(sae_b) == N_FULL or len(tc) == N_FULL
    ws = _workspace(x, group_name) if not full else None
    if ws is not None:
        return triton_path(*base, ar=ws)
    return _impl(all_reduce(x, group_name), *base[1:])


def _workspace(x: torch.Tensor, group_name: str):
    """The TP group's all-reduce workspace where the fused launch can take ``x`` (CUDA, at most its tokens), else
    None."""
    if not x.is_cuda:
        return None
    from vllm_steer.kernels.allreduce_norm.triton import WORKSPACES

    ws = WORKSPACES.get(group_name)
    return ws if ws is not None and x.shape[0] <= ws.max_tokens else None


def triton_path(x, residual, weight, eps, weight_offset, index, vec_a, vec_b, sae_a, sae_b, topk_a, topk_b, cond, gate,
                plan_a, plan_b, pool, proj_a, proj_b, tc, topk_tc=0, ar=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on CUDA (and under Triton's interpreter, in tests): full SAE slots' (and a full transcoder's) edits
    first, then the norm's one launch (``ar``: the TP all-reduce inside it, ``steered_norm_ar``; no full packs)."""
    global _triton_norm
    if _triton_norm is None:
        from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton as _triton_norm
    if pool is not None:
        live.ready(plan_a, plan_b)
    full_a = full_b = full_tc = ()
    if len(sae_a) == N_FULL or len(sae_b) == N_FULL or len(tc) == N_FULL:
        from vllm_steer.kernels.sae_clamp.full_slot import full_slots

        sae_a, full_a, sae_b, full_b, tc, full_tc = full_slots(
            x, residual, index, vec_a, sae_a, topk_a, sae_b, topk_b, cond, gate, proj_a, tc, topk_tc,
            (weight, eps, weight_offset))
    return _triton_norm(x, residual, weight, eps, weight_offset, index, vec_a, vec_b, sae_a, sae_b, cond, gate,
                        plan_a, plan_b, pool, proj_a, proj_b, tc=tc, full_a=full_a, full_b=full_b, full_tc=full_tc,
                        ar=ar)


def _plain_schema(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  weight_offset: float, index: torch.Tensor, table_a: torch.Tensor | None, flag_a: torch.Tensor | None,
                  table_b: torch.Tensor | None, flag_b: torch.Tensor | None, plan_a: torch.Tensor | None,
                  plan_b: torch.Tensor | None, pool: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``steered_norm_plain``'s parameters, which its schema is inferred from (a slot's table and flag None where it
    has none), given to each of its functions (``_with_schema``)."""


@_with_schema(_plain_schema)
def plain_triton(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``steered_norm_plain`` where the platform is CUDA (and under Triton's interpreter, in tests): the norm's one
    launch."""
    return _plain_launch(*args)


def _plain_launch(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, plan_a, plan_b,
                  pool, ar=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain op's one launch (``ar``: the TP all-reduce inside it, ``steered_norm_plain_ar``)."""
    global _triton_norm
    if _triton_norm is None:
        from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton as _triton_norm
    if pool is not None:
        live.ready(plan_a, plan_b)
    return _triton_norm(x, residual, weight, eps, weight_offset, index, () if table_a is None else (table_a, flag_a),
                        () if table_b is None else (table_b, flag_b), (), (), (), None, plan_a, plan_b, pool, ar=ar)


@_with_schema(_plain_schema)
def _plain_reference(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, plan_a, plan_b,
                     pool) -> tuple[torch.Tensor, torch.Tensor]:
    """``steered_norm_plain`` on other platforms: the full op's ``_impl`` with the other features off."""
    return _impl(x, residual, weight, eps, weight_offset, index, [] if table_a is None else [table_a, flag_a],
                 [] if table_b is None else [table_b, flag_b], [], [], 0, 0, [], None, plan_a, plan_b, pool, [], [], [])


@_with_schema(_plain_schema, _param("quant_scale", "torch.Tensor | None"),
              _param("group_scale", "torch.Tensor | None", None), _param("group_size", "int", 0),
              _param("group_eps", "float", 1e-10), _param("ue8m0", "bool", False),
              returns="tuple[torch.Tensor, torch.Tensor, torch.Tensor]")
def plain_fp8(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, plan_a, plan_b, pool,
              quant_scale, group_scale=None, group_size=0, group_eps=1e-10, ue8m0=False):
    """``steered_norm_plain_fp8``: ``steered_norm_plain`` whose output is quantized for the FP8 linear after it
    (naive.quant_fp8_naive: ``quant_scale`` [1] float32 static per-tensor, None dynamic per-token); returns (fp8
    output, scale, new residual), the scale [N, 1] when dynamic and empty when static (the caller keeps its own).
    ``group_scale`` [N, D // group_size] float32 given (mutated; any strides): per token and group of ``group_size``
    columns for a block-FP8 linear (naive.quant_fp8_group_naive, vLLM's ``_C.per_token_group_fp8_quant`` with its
    ``eps`` and ``scale_ue8m0``), the scales written into it in its layout, the returned scale empty.
    Put in place of ``steered_norm_plain`` + vLLM's quant by ``runtime.fp8_fusion``. CUDA: the norm's one
    launch with its QUANT mode (interpreter-tested only); other devices: the reference."""
    if x.is_cuda:
        from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_fp8_triton

        if pool is not None:
            live.ready(plan_a, plan_b)

        return steered_norm_fp8_triton(x, residual, weight, eps, weight_offset, index,
                                       () if table_a is None else (table_a, flag_a),
                                       () if table_b is None else (table_b, flag_b), plan_a, plan_b, pool, quant_scale,
                                       group_scale, group_size, group_eps, ue8m0)
    out, stream = _plain_reference(x, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b,
                                   plan_a, plan_b, pool)
    if group_scale is not None:
        q, scales = quant_fp8_group_naive(out, group_size, group_eps, ue8m0)
        group_scale.copy_(scales)
        return q, scales.new_empty(0), stream
    q, scale = quant_fp8_naive(out, quant_scale)
    return q, scale if quant_scale is None else scale.new_empty(0), stream


@_and_group_name(plain_triton)
def plain_ar(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``steered_norm_plain_ar``: ``steered_norm_plain`` of vLLM's all-reduce of ``x`` (this TP rank's partial sum)
    over the group ``group_name``. Put in place of vLLM's ``all_reduce`` + ``steered_norm_plain`` by
    ``runtime.allreduce_fusion``. CUDA with the group's workspace (``allreduce_norm.triton.WORKSPACES``) and at most
    its tokens: one launch, the all-reduce inside (the norm's ``AR`` feature); otherwise (no workspace, a bigger
    batch, another device) vLLM's all-reduce, then ``steered_norm_plain``."""
    *base, group_name = args
    x = base[0]
    ws = _workspace(x, group_name)
    if ws is not None:
        return _plain_launch(*base, ar=ws)
    plain = plain_triton if x.is_cuda else _plain_reference
    return plain(all_reduce(x, group_name), *base[1:])


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """vLLM's all-reduce of the TP group ``group_name`` (the op the fusion took out of the graph)."""
    return torch.ops.vllm.all_reduce(x, group_name)


def _fake_fp8(x: torch.Tensor, residual, weight, eps, weight_offset, index, table_a, flag_a, table_b, flag_b, plan_a,
              plan_b, pool, quant_scale, group_scale=None, group_size=0, group_eps=1e-10, ue8m0=False,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shapes of ``steered_norm_plain_fp8``: fp8 output, scale ([N, 1] dynamic; empty when static or per group),
    new residual."""
    scale_shape = (x.shape[0], 1) if quant_scale is None and group_scale is None else (0,)
    return (torch.empty_like(x, dtype=torch.float8_e4m3fn), x.new_empty(scale_shape, dtype=torch.float32),
            torch.empty_like(x))


def _fake(x: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """The shapes (compile tracing): the output and the new residual, like ``x``."""
    return torch.empty_like(x), torch.empty_like(x)


def register() -> None:
    """Define the op once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    # the gate buffer is written at a row's probe site and read by the later norms of the same forward pass;
    # the capture pool is written at captured slots
    direct_register_custom_op("steered_norm", _impl, mutates_args=["gate", "pool"], fake_impl=_fake, target_lib=LIB)
    direct_register_custom_op("steered_norm_ar", _impl_ar, mutates_args=["gate", "pool"], fake_impl=_fake,
                              target_lib=LIB)
    from vllm.platforms import current_platform

    plain = plain_triton if current_platform.dispatch_key == "CUDA" else _plain_reference
    direct_register_custom_op("steered_norm_plain", plain, mutates_args=["pool"], fake_impl=_fake, target_lib=LIB)
    direct_register_custom_op("steered_norm_plain_fp8", plain_fp8, mutates_args=["pool", "group_scale"],
                              fake_impl=_fake_fp8, target_lib=LIB)
    direct_register_custom_op("steered_norm_plain_ar", plain_ar, mutates_args=["pool"], fake_impl=_fake,
                              target_lib=LIB)
    _registered = True
