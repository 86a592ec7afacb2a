"""The SAE edit transformers' forward hooks apply in the oracle tests: a site's SAE (``tests.sae_writers``
weights) clamped or reconstructed by the plain-torch reference (``kernels/sae_clamp/naive.py``), and the same SAE
with its W_enc / W_dec rounded to bfloat16, as the engine keeps a full pack's (TopK, reconstruct) weights; EleutherAI
sparsify's own ``SparseCoder`` (imported without its package ``__init__``), random coders of it and a transcoder's
clamp edit by its ``encode`` / ``decode``; dictionary_learning's own dictionaries and trainer configs (its modules
imported without the package ``__init__`` files)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import types

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


def sparsify_module() -> types.ModuleType:
    """sparsify's ``sparse_coder`` module, imported without the package's ``__init__`` (it imports the trainer,
    whose datasets / schedulefree ci/overrides.txt leaves out), with its eager decoder (the Triton one is
    CUDA's: ``SPARSIFY_DISABLE_TRITON``, sparsify/utils.py)."""
    if "sparsify.sparse_coder" not in sys.modules:
        spec = importlib.util.find_spec("sparsify")
        assert spec is not None, "eai-sparsify is not installed: ./dev setup installs ci/requirements.lock"
        if "sparsify" not in sys.modules:
            pkg = types.ModuleType("sparsify")
            pkg.__path__ = list(spec.submodule_search_locations)
            sys.modules["sparsify"] = pkg
        old = os.environ.get("SPARSIFY_DISABLE_TRITON")
        os.environ["SPARSIFY_DISABLE_TRITON"] = "1"
        try:
            importlib.import_module("sparsify.sparse_coder")
        finally:
            if old is None:
                del os.environ["SPARSIFY_DISABLE_TRITON"]
            else:
                os.environ["SPARSIFY_DISABLE_TRITON"] = old
    return sys.modules["sparsify.sparse_coder"]


def sparsify_coder(d: int, num_latents: int, k: int, seed: int = 0, dtype=torch.float32, bias_shift: float = 0.0,
                   scale: float = 0.3, bf16: bool = False, **cfg):
    """A sparsify ``SparseCoder`` with random weights (std ``scale``; nonzero biases: b_dec matters; W_skip too with
    ``skip_connection``); ``bf16``: its weights rounded to bfloat16 values (the engine keeps a full pack's so)."""
    module = sparsify_module()  # first: "sparsify.config" alone would import the package's __init__
    config = importlib.import_module("sparsify.config").SparseCoderConfig(num_latents=num_latents, k=k, **cfg)
    coder = module.SparseCoder(d, config, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in coder.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if bf16:
                p.copy_(p.bfloat16().float())
        coder.encoder.bias -= bias_shift
    return coder


def sparsify_clamped(coder, x: torch.Tensor, kind: torch.Tensor, value: torch.Tensor,
                     only: torch.Tensor) -> torch.Tensor:
    """What the clamps do to a sparsify transcoder's output for input ``x`` [N, D], by sparsify's own code: its
    ``forward`` (decode of the TopK latents + W_skip x for a skip transcoder) with the latents clamped, minus its
    plain ``forward``: ``kind`` / ``value`` / ``only`` [N, F] per token (naive's codes)."""
    top_acts, top_indices, _ = coder.encode(x)
    f = torch.zeros(x.shape[0], coder.num_latents, dtype=top_acts.dtype).scatter(-1, top_indices, top_acts)
    f_new = naive.clamp(f, kind, value, only)
    every = torch.arange(coder.num_latents).expand(x.shape[0], -1)

    def output(acts):
        out = coder.decode(acts, every)
        if coder.W_skip is not None:
            out = out + x.to(coder.dtype) @ coder.W_skip.mT
        return out

    return output(f_new) - output(f)


def sparsify_transcoder_hook(folder: str, clamps: list):
    """A forward hook on layer L's MLP adding what ``clamps`` (a request's) do to the output of the sparsify (skip)
    transcoder saved in ``folder`` (read by sparsify's own ``load_from_disk``), encoded from the MLP's input:
    ``sparsify_clamped``, every token."""
    coder = sparsify_module().SparseCoder.load_from_disk(folder)
    f = coder.num_latents
    kind, value, only = torch.zeros(f, dtype=torch.int8), torch.zeros(f), torch.zeros(f, dtype=torch.int8)
    for c in clamps:
        kind[c["feature"]], value[c["feature"]] = KIND[c["kind"]], c["value"]
        only[c["feature"]] = int(c.get("only_if_active", False))

    def hook(module, args, output):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        n = x.shape[0]
        edit = sparsify_clamped(coder, x, kind.expand(n, f), value.expand(n, f), only.expand(n, f))
        return output + edit.to(output.dtype).reshape(output.shape)

    return hook


def dictlearn_module(name: str) -> types.ModuleType:
    """``dictionary_learning.<name>`` (``dictionary``, ``trainers.top_k``, ...), imported without the package's
    ``__init__`` files (they import the activation buffer, hence nnsight, which the locks leave out)."""
    full = f"dictionary_learning.{name}"
    if "dictionary_learning" not in sys.modules:
        spec = importlib.util.find_spec("dictionary_learning")
        assert spec is not None, "dictionary-learning is not installed: ./dev setup installs ci/requirements.lock"
        root = list(spec.submodule_search_locations)[0]
        for pkg, path in (("dictionary_learning", root),
                          ("dictionary_learning.trainers", os.path.join(root, "trainers"))):
            module = types.ModuleType(pkg)
            module.__path__ = [path]
            sys.modules[pkg] = module
    return importlib.import_module(full)


# dict_class -> (trainer module, trainer class, its extra arguments): the trainer dictionary_learning pairs with it
DICTLEARN_TRAINERS = {
    "AutoEncoder": ("standard", "StandardTrainer", {}),
    "AutoEncoderNew": ("standard", "StandardTrainerAprilUpdate", {"dict_class": "AutoEncoderNew"}),
    "GatedAutoEncoder": ("gdm", "GatedSAETrainer", {}),
    "JumpReluAutoEncoder": ("jumprelu", "JumpReluTrainer", {}),
    "AutoEncoderTopK": ("top_k", "TopKTrainer", {"k": True}),
    "BatchTopKSAE": ("batch_top_k", "BatchTopKTrainer", {"k": True}),
    "MatryoshkaBatchTopKSAE": ("matryoshka_batch_top_k", "MatryoshkaBatchTopKTrainer",
                               {"k": True, "group_fractions": [0.25, 0.75]}),
}


def dictlearn_trainer(dict_class: str, d: int, f: int, k: int, layer: int, seed: int = 0, scale: float = 0.3,
                      threshold: float = 0.2):
    """dictionary_learning's own trainer for ``dict_class`` (built as its ``trainSAE`` builds it), its dictionary's
    parameters and buffers random (std ``scale``; every bias nonzero; a BatchTopK / Matryoshka global ``threshold``,
    a JumpReLU's per latent around it): (the dictionary, the ``config.json`` its ``trainSAE`` writes)."""
    module, cls, extra = DICTLEARN_TRAINERS[dict_class]
    kwargs = {key: value for key, value in extra.items() if key not in ("k", "dict_class")}
    if extra.get("k"):
        kwargs["k"] = k
    if "dict_class" in extra:
        kwargs["dict_class"] = getattr(dictlearn_module("dictionary"), extra["dict_class"])
    trainer = getattr(dictlearn_module(f"trainers.{module}"), cls)(
        steps=10_000, activation_dim=d, dict_size=f, layer=layer, lm_name="google/gemma-2-2b", device="cpu",
        submodule_name=f"resid_post_layer_{layer}", **kwargs)
    ae = trainer.ae
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        if hasattr(ae, "threshold"):
            if ae.threshold.dim():
                ae.threshold.copy_(threshold + torch.rand(ae.threshold.shape, generator=g) * threshold)
            else:
                ae.threshold.fill_(threshold)
    config = {"trainer": dict(trainer.config),
              "buffer": {"d_submodule": d, "io": "out", "n_ctxs": 30, "ctx_len": 128, "refresh_batch_size": 32,
                         "out_batch_size": 4096, "device": "cpu"}}
    return ae, config
