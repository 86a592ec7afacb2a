"""saprmarks/dictionary_learning trainer folders (PyPI ``dictionary-learning``; SAEBench's and many public SAEs').

What its trainer saves (``training.py`` 170-186, 241-246 of 0.1.0): ``config.json``, ``{"trainer": <the trainer's
config: dict_class, activation_dim, dict_size, k?, layer, lm_name, submodule_name, ...>, "buffer": {...}}``, and
``ae.pt``, the dictionary's ``state_dict()`` by ``torch.save``. With ``normalize_activations`` the biases (and a
threshold) are scaled back before saving (``scale_biases(norm_factor)``), so the saved SAE reads raw activations.

Each class, its ``encode`` / ``decode`` (``dictionary.py``; ``trainers/top_k.py``, ``batch_top_k.py``,
``matryoshka_batch_top_k.py``), and what it loads as (our ``pre = (x - b_dec·b_dec_in) @ W_enc + b_enc``):

- ``AutoEncoder`` (standard): ``relu(encoder(x - bias))``, ``decoder(f) + bias``: relu, W_enc = encoder.weight.T,
  W_dec = decoder.weight.T, b_dec = ``bias``, b_dec_in.
- ``AutoEncoderNew`` (April update): ``relu(encoder(x))``, ``decoder(f)`` (decoder.bias is b_dec): relu, no b_dec_in.
  ``StandardTrainerAprilUpdate``'s config says ``AutoEncoder`` whatever class it trained, so an ``AutoEncoder``
  whose state dict holds ``decoder.bias`` and no ``bias`` loads as this one.
- ``GatedAutoEncoder``: ``x_enc = encoder(x - decoder_bias)``, ``f = (x_enc + gate_bias > 0) · relu(exp(r_mag)·x_enc
  + mag_bias)``. With W_enc = encoder.weight.T · exp(r_mag) and b_enc = mag_bias, the gate is pre > mag_bias -
  exp(r_mag)·gate_bias =: threshold (exp > 0), so it is exactly a JumpReLU: relu(pre) · (pre > threshold).
- ``JumpReluAutoEncoder``: ``relu(pre · (pre > threshold))`` = relu(pre) · (pre > threshold), W_enc [D, F] as
  stored; ``apply_b_dec_to_input`` is an attribute (not saved), False unless loaded from sae-lens: no b_dec_in.
- ``AutoEncoderTopK``: ``topk(relu(encoder(x - b_dec)), k)`` (its ``threshold`` buffer is read only with
  ``use_threshold``, off by default): topk with the saved ``k`` buffer, b_dec_in.
- ``BatchTopKSAE``: at inference (``use_threshold`` True by default) ``relu(pre) · (relu(pre) > threshold)`` with one
  learned global threshold: a JumpReLU with it broadcast to every latent (the same for a negative one: both are
  relu(pre) then), b_dec_in.
- ``MatryoshkaBatchTopKSAE``: the same encode on W_enc [D, F]; its groups (``group_sizes``, summing to dict_size)
  zero latents past the active groups, which are all groups once loaded: a JumpReLU like BatchTopK.

The site: ``submodule_name`` ``resid_post_layer_N`` (the demo's and SAEBench's name for decoder layer N's output) is
post_mlp.N (``layer``, when given, must agree); none (null or absent) needs ``site``; any other is refused. Refused,
naming the field: an unknown ``dict_class`` (CrossCoders included), a missing or unexpected array, a shape that
disagrees with the encoder or the config's ``activation_dim`` / ``dict_size`` / ``k``. ``ae.pt`` is read by
``torch.load(weights_only=True, mmap=True)`` (never an arbitrary unpickle; tensors mapped, not read, for headers)
on the descriptor ``core.sae_paths.FileAccess`` opened (root, regular file, size cap), torch imported on use.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from vllm_steer.core.sae_files import (
    SaeFileError, SaeMeta, Site, _check_k, _finite, _int_field, _open, _parse_site, _Plan, _present, _read_json, _shown,
)
from vllm_steer.core.sae_paths import FileAccess

CONFIG, WEIGHTS = "config.json", "ae.pt"
_RESID_POST = re.compile(r"resid_post_layer_(0|[1-9][0-9]*)")

# dict_class -> (activation, b_dec_in, arrays: state-dict name -> shape in terms of D / F, "" for a scalar)
_CLASSES: dict[str, tuple[str, bool, dict[str, tuple[str, ...]]]] = {
    "AutoEncoder": ("relu", True, {"encoder.weight": ("F", "D"), "encoder.bias": ("F",), "decoder.weight": ("D", "F"),
                                   "bias": ("D",)}),
    "AutoEncoderNew": ("relu", False, {"encoder.weight": ("F", "D"), "encoder.bias": ("F",),
                                       "decoder.weight": ("D", "F"), "decoder.bias": ("D",)}),
    "GatedAutoEncoder": ("jumprelu", True, {"encoder.weight": ("F", "D"), "decoder.weight": ("D", "F"),
                                            "decoder_bias": ("D",), "r_mag": ("F",), "gate_bias": ("F",),
                                            "mag_bias": ("F",)}),
    "JumpReluAutoEncoder": ("jumprelu", False, {"W_enc": ("D", "F"), "b_enc": ("F",), "W_dec": ("F", "D"),
                                                "b_dec": ("D",), "threshold": ("F",)}),
    "AutoEncoderTopK": ("topk", True, {"encoder.weight": ("F", "D"), "encoder.bias": ("F",),
                                       "decoder.weight": ("D", "F"), "b_dec": ("D",), "k": (), "threshold": ()}),
    "BatchTopKSAE": ("jumprelu", True, {"encoder.weight": ("F", "D"), "encoder.bias": ("F",),
                                        "decoder.weight": ("D", "F"), "b_dec": ("D",), "k": (), "threshold": ()}),
    "MatryoshkaBatchTopKSAE": ("jumprelu", True, {"W_enc": ("D", "F"), "b_enc": ("F",), "W_dec": ("F", "D"),
                                                  "b_dec": ("D",), "k": (), "threshold": (), "group_sizes": ("G",)}),
}
_FLOAT = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def is_folder(path: str) -> bool:
    """A trainer folder: ``config.json`` + ``ae.pt`` (each a file or a symlink: opening decides)."""
    return os.path.isdir(path) and _present(os.path.join(path, CONFIG)) and _present(os.path.join(path, WEIGHTS))


def _state(file: str, files: FileAccess) -> dict[str, Any]:
    """``ae.pt``'s state dict, its tensors memory-mapped (nothing read until used): ``torch.load`` with
    ``weights_only`` on the descriptor ``files`` opened and checked (``/proc/self/fd``, so the file mapped is the
    one checked), every value a tensor."""
    import pickle

    import torch

    with _open(files, file) as f:
        fd_path = f"/proc/self/fd/{f.fileno()}"
        try:
            if os.path.exists(fd_path):
                state = torch.load(fd_path, map_location="cpu", weights_only=True, mmap=True)
            else:
                state = torch.load(f, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
            first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise SaeFileError(file, "file", f"not a torch.save state dict torch.load(weights_only=True) reads "
                                             f"({first})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise SaeFileError(file, "file", "expected a state dict (names -> tensors)")
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise SaeFileError(file, name[:40], f"expected a tensor, got {type(value).__name__}")
    return state


def _class(cfg_path: str, trainer: dict[str, Any]) -> str:
    if "dict_class" not in trainer:
        raise SaeFileError(cfg_path, "trainer.dict_class", "missing")
    name = trainer["dict_class"]
    if name not in _CLASSES:
        raise SaeFileError(cfg_path, "trainer.dict_class", f"{_shown(name)} is not served (served: "
                                                           f"{', '.join(_CLASSES)})")
    return name


def _site(cfg_path: str, trainer: dict[str, Any], site: str | None) -> Site:
    """post_mlp.N for ``submodule_name`` resid_post_layer_N (``layer`` and ``site``, when given, agree), or ``site``
    when the config names no submodule."""
    name = trainer.get("submodule_name")
    given = _parse_site(site, "site", cfg_path) if site is not None else None
    if name is None:
        if given is None:
            raise SaeFileError(cfg_path, "trainer.submodule_name", "missing: the config does not say which "
                                                                   "activation the SAE reads; pass site=")
        return given
    m = _RESID_POST.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise SaeFileError(cfg_path, "trainer.submodule_name", f"{_shown(name)} is not served: only resid_post_"
                                                               "layer_N (decoder layer N's output, post_mlp.N)")
    own = ("post_mlp", int(m.group(1)))
    if trainer.get("layer") is not None and _int_field(cfg_path, "trainer.layer", trainer["layer"]) != own[1]:
        raise SaeFileError(cfg_path, "trainer.layer", f"{trainer['layer']} disagrees with submodule_name {name}")
    if given is not None and given != own:
        raise SaeFileError(cfg_path, "site", f"{given[0]}.{given[1]} disagrees with submodule_name {name} "
                                             f"(post_mlp.{own[1]})")
    return own


def _dims(file: str, cls: str, state: dict[str, Any]) -> tuple[int, int]:
    """(D, F) once every array of ``cls`` is present with its shape, and nothing else is."""
    arrays = _CLASSES[cls][2]
    for name in arrays:
        if name not in state:
            raise SaeFileError(file, name, f"missing array for a {cls}; the file holds {_shown(sorted(state))}")
    unexpected = sorted(set(state) - set(arrays))
    if unexpected:
        raise SaeFileError(file, unexpected[0][:40], f"unexpected array for a {cls} (expected {', '.join(arrays)})")
    first = next(iter(arrays))
    enc = tuple(state[first].shape)
    if len(enc) != 2 or 0 in enc:
        raise SaeFileError(file, first, f"wrong rank or empty: expected [{', '.join(arrays[first])}], got {list(enc)}")
    sizes = dict(zip(arrays[first], enc))
    sizes["G"] = tuple(state["group_sizes"].shape)[0] if "group_sizes" in state and state["group_sizes"].dim() else -1
    for name, dims in arrays.items():
        want = tuple(sizes[d] for d in dims)
        if tuple(state[name].shape) != want:
            raise SaeFileError(file, name, f"shape {list(state[name].shape)} does not match {first} {list(enc)}: "
                                           f"expected {list(want)}")
        if name not in ("k", "group_sizes") and str(state[name].dtype) not in _FLOAT:
            raise SaeFileError(file, name, f"unsupported dtype {str(state[name].dtype).removeprefix('torch.')} "
                                           "(float32, float16 or bfloat16)")
    return sizes["D"], sizes["F"]


def _check_cfg(cfg_path: str, file: str, cls: str, trainer: dict[str, Any], state: dict[str, Any],
               d: int, f: int) -> int:
    """The config's sizes agree with the arrays; returns k (TopK's, from the state dict; 0 otherwise)."""
    for key, have in (("activation_dim", d), ("dict_size", f)):
        if key in trainer and _int_field(cfg_path, f"trainer.{key}", trainer[key]) != have:
            raise SaeFileError(cfg_path, f"trainer.{key}", f"{_shown(trainer[key])} disagrees with the arrays "
                                                           f"(activation_dim {d}, dict_size {f})")
    if "group_sizes" in state:
        sizes = state["group_sizes"]
        if sizes.is_floating_point() or bool((sizes <= 0).any()) or int(sizes.sum()) != f:
            raise SaeFileError(file, "group_sizes", f"expected positive sizes summing to dict_size {f}, got "
                                                    f"{_shown(sizes.tolist())}")
    if "k" not in state:
        return 0
    k = state["k"]
    if k.is_floating_point():
        raise SaeFileError(file, "k", f"expected an integer, got {k.dtype}")
    k = int(k)
    _check_k(file, "k", k, f)
    if trainer.get("k") is not None and _int_field(cfg_path, "trainer.k", trainer["k"]) != k:
        raise SaeFileError(cfg_path, "trainer.k", f"{_shown(trainer['k'])} disagrees with ae.pt's k ({k})")
    return k if _CLASSES[cls][0] == "topk" else 0


def _arrays(file: str, cls: str, files: FileAccess, f: int) -> dict[str, np.ndarray]:
    """Our W_enc [D, F], b_enc, W_dec [F, D], b_dec (and threshold [F] for a JumpReLU), float32, checked finite."""
    import torch

    state = _state(file, files)
    a = {n: _finite(file, n, t.detach().to(torch.float32).numpy()) for n, t in state.items() if n not in
         ("k", "group_sizes")}
    if cls in ("JumpReluAutoEncoder", "MatryoshkaBatchTopKSAE"):
        out = {"W_enc": a["W_enc"], "b_enc": a["b_enc"], "W_dec": a["W_dec"], "b_dec": a["b_dec"]}
    elif cls == "GatedAutoEncoder":
        with np.errstate(over="ignore"):  # an overflow is refused below, naming r_mag
            scale = np.exp(a["r_mag"])
        out = {"W_enc": a["encoder.weight"].T * scale[None, :], "b_enc": a["mag_bias"], "W_dec": a["decoder.weight"].T,
               "b_dec": a["decoder_bias"], "threshold": a["mag_bias"] - scale * a["gate_bias"]}
        _finite(file, "r_mag", out["W_enc"])  # exp(r_mag) may overflow
    else:
        b_dec = {"AutoEncoder": "bias", "AutoEncoderNew": "decoder.bias"}.get(cls, "b_dec")
        out = {"W_enc": a["encoder.weight"].T, "b_enc": a["encoder.bias"], "W_dec": a["decoder.weight"].T,
               "b_dec": a[b_dec]}
    if cls == "JumpReluAutoEncoder":
        out["threshold"] = a["threshold"]
    elif cls in ("BatchTopKSAE", "MatryoshkaBatchTopKSAE"):
        out["threshold"] = np.full(f, a["threshold"], np.float32)
    return {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in out.items()}


def dictlearn_plans(path: str, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    """One trainer folder (``config.json`` + ``ae.pt``): its site from ``submodule_name`` (or ``site``)."""
    if not is_folder(path):
        raise SaeFileError(path, "format", f"not a dictionary_learning trainer folder ({CONFIG} + {WEIGHTS})")
    cfg_path, file = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    cfg = _read_json(cfg_path, files)
    trainer = cfg.get("trainer")
    if not isinstance(trainer, dict):
        raise SaeFileError(cfg_path, "trainer", "missing or not an object (dictionary_learning writes "
                                                "{\"trainer\": {...}, \"buffer\": {...}})")
    cls = _class(cfg_path, trainer)
    where = _site(cfg_path, trainer, site)
    state = _state(file, files)
    if cls == "AutoEncoder" and "decoder.bias" in state and "bias" not in state:
        cls = "AutoEncoderNew"
    d, f = _dims(file, cls, state)
    k = _check_cfg(cfg_path, file, cls, trainer, state, d, f)
    activation, b_dec_in, arrays = _CLASSES[cls]
    meta = SaeMeta(d_model=d, d_sae=f, activation=activation, k=k, dtype=_FLOAT[str(state[next(iter(arrays))].dtype)],
                   b_dec_in=b_dec_in)
    del state
    return {where: _Plan(file, meta, lambda: _arrays(file, cls, files, f))}
