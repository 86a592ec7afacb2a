"""EleutherAI sparsify checkpoints (PyPI ``eai-sparsify``): a folder per hookpoint, or the checkpoint root holding them.

What sparsify 1.3.3 saves and loads (``sparsify/sparse_coder.py``: ``save_to_disk`` 167-179, ``load_from_disk``
134-165): ``<hookpoint>/cfg.json``, the ``SparseCoderConfig`` fields (``config.py`` 8-36) plus ``d_in``, and
``<hookpoint>/sae.safetensors`` with ``encoder.weight`` [F, d_in], ``encoder.bias`` [F], ``W_dec`` [F, d_in],
``b_dec`` [d_in] (and ``W_skip`` [d_in, d_in] with ``skip_connection``), F = ``num_latents`` or d_in ×
``expansion_factor`` (51). A hookpoint is a module name under the model's ``base_model`` and an SAE reads that
module's output (``trainer.py`` 348-399), so ``layers.N`` is decoder layer N's output: our ``post_mlp.N``.
``encode`` (189-196, ``fused_encoder.py`` 29-33) is ``topk(relu((x - b_dec) @ encoder.weight.T + encoder.bias),
k)``, ``decode`` (198-202) ``Σ acts · W_dec[indices] + b_dec``: a TopK SAE with W_enc = encoder.weight.T and
b_dec applied to the input (``b_dec_in``), which loads as a full pack.

Transcoders (``transcode``: sparsify's TopK transcoders, hookpoint ``layers.L.mlp``): the trainer encodes that
module's input and trains the coder to predict its output (``trainer.py`` 341-399: ``inputs`` / ``outputs`` of the
hooked module); ``encode`` subtracts no b_dec for them (189-196). They load as transcoders (meta ``transcoder``, site
``post_attn.L``: the norm whose output is layer L's MLP input; b_dec_in off), a TopK full pack at that transcoder
site. Skip transcoders (``skip_connection`` with ``transcode``) add ``x @ W_skip.T`` to the decoded output
(``forward`` 226-227): W_skip is checked for its shape and never read, because a clamp's edit ``dec(f') - dec(f)``
does not contain it (the same x for both); b_dec cancels alike. So a transcoder clamps only (delta): reconstruct,
replacing the MLP's output by ``dec(f) + W_skip x``, is refused (``core.sae_catalog``, naming ``reconstruct``).

Refused, naming the field: activation ``groupmax``; ``signed`` (an old sparsify's TopK of |pre| without ReLU, a
field 1.3.3 drops, so it would load such an SAE as unsigned); ``skip_connection`` without ``transcode`` (an SAE of
the residual stream with a skip term: not a transcoder, and its reconstruction would need W_skip); a transcoder
folder not named ``layers.L.mlp`` (without ``site``), an SAE folder not named ``layers.N``; a root mixing SAEs and
transcoders (``transcode``: load each with ``site``). Read as sparsify reads them: ``multi_topk`` (a training loss:
``encode`` uses ``k`` alone, the 4k decode of ``forward`` 265-271 is a metric), ``normalize_decoder`` (init and
training only) and unknown keys (``from_dict(..., drop_extra_fields=True)``, 146). ``d_in`` and ``k`` must be
present (sparsify's default k changed between releases). Reading goes through ``core.sae_files``' safetensors
reader and checks; this module owns the layout and the config.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from vllm_steer.core.sae_files import (
    SaeFileError, SaeMeta, Shapes, Site, _bool_field, _check_k, _int_field, _parse_site, _Plan, _present, _read_json, _shown,
    _st_header, _st_read, _st_shapes,
)
from vllm_steer.core.sae_paths import FileAccess

CFG, WEIGHTS = "cfg.json", "sae.safetensors"
ARRAYS = ("encoder.weight", "encoder.bias", "W_dec", "b_dec")
_RESIDUAL = re.compile(r"layers\.(0|[1-9][0-9]*)")  # decoder layer N's output: post_mlp.N
_MLP = re.compile(r"layers\.(0|[1-9][0-9]*)\.mlp")  # a transcoder's: layer L's MLP (its input is post_attn.L's output)
_SUBMODULE = re.compile(r"layers\.(0|[1-9][0-9]*)\..+")  # e.g. layers.3.self_attn


def is_folder(path: str) -> bool:
    """A hookpoint folder: ``cfg.json`` + ``sae.safetensors`` (each a file or a symlink: opening decides)."""
    return os.path.isdir(path) and _present(os.path.join(path, CFG)) and _present(os.path.join(path, WEIGHTS))


def is_root(path: str) -> bool:
    """A directory holding a hookpoint folder, or a symlink that may be one (opening it decides, so a link out of
    ``steer.sae_root`` is refused alike whether its target exists or not)."""
    if not os.path.isdir(path):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(os.path.islink(os.path.join(path, n)) or is_folder(os.path.join(path, n)) for n in names)


def _order(name: str) -> tuple[int, str]:
    m = _RESIDUAL.fullmatch(name) or _MLP.fullmatch(name)
    return (int(m.group(1)) if m else -1, name)


def _folders(path: str, files: FileAccess) -> dict[str, str]:
    """Hookpoint name -> folder, of the root ``path``, in layer order; SaePathError for a link leaving the root."""
    try:
        names = sorted(os.listdir(path), key=_order)
    except OSError as e:
        raise SaeFileError(path, "file", f"cannot list ({e.strerror or type(e).__name__})") from None
    out = {}
    for name in names:
        sub = os.path.join(path, name)
        if os.path.islink(sub):
            files.resolve(sub)
        if is_folder(sub):
            out[name] = sub
    return out


def _check_cfg(cfg_path: str, cfg: dict[str, Any]) -> tuple[int, bool, bool]:
    """(k, transcode, skip_connection), once the config is one we serve (every refusal names its field)."""
    activation = cfg.get("activation", "topk")
    if activation == "groupmax":
        raise SaeFileError(cfg_path, "activation", "'groupmax' (the max of each of k groups of latents) is not "
                                                   "served: only topk")
    if activation != "topk":
        raise SaeFileError(cfg_path, "activation", f"unknown activation {_shown(activation)} (sparsify has topk "
                                                   "and groupmax; only topk is served)")
    if _bool_field(cfg_path, "signed", cfg.get("signed", False)):
        raise SaeFileError(cfg_path, "signed", "a signed SAE (TopK of |pre-activation|, no ReLU; sparsify before "
                                               "1.0) is not served (sparsify 1.3.3 drops the field and would load "
                                               "it as unsigned)")
    transcode = _bool_field(cfg_path, "transcode", cfg.get("transcode", False))
    skip = _bool_field(cfg_path, "skip_connection", cfg.get("skip_connection", False))
    if skip and not transcode:
        raise SaeFileError(cfg_path, "skip_connection", "a skip connection on an SAE (transcode false) is not served: "
                                                        "only skip transcoders (transcode true), whose clamps' edit "
                                                        "does not read W_skip")
    _bool_field(cfg_path, "multi_topk", cfg.get("multi_topk", False))  # a training loss: encode uses k
    for key in ("d_in", "k"):
        if key not in cfg:
            raise SaeFileError(cfg_path, key, "missing")
    return _int_field(cfg_path, "k", cfg["k"]), transcode, skip


def _site(folder: str, name: str, site: str | None, transcode: bool) -> Site:
    """An SAE's post_mlp.N for hookpoint ``layers.N``, a transcoder's post_attn.L for ``layers.L.mlp`` (``site``,
    if given, must agree); ``site`` for a folder whose name is not a hookpoint (renamed); another hookpoint (a
    submodule's output for an SAE, anything but an MLP for a transcoder) is refused."""
    hook, pattern, what = (("post_attn", _MLP, "layers.L.mlp: layer L's MLP, read at post_attn.L") if transcode else
                           ("post_mlp", _RESIDUAL, "layers.N: decoder layer N's output, post_mlp.N"))
    m = pattern.fullmatch(name)
    if m is None and (_SUBMODULE.fullmatch(name) or _RESIDUAL.fullmatch(name)):
        kind = "a transcoder's" if transcode else "an SAE's"
        raise SaeFileError(folder, "hookpoint", f"{_shown(name)} is not served as {kind} hookpoint: only {what}")
    own = (hook, int(m.group(1))) if m else None
    given = _parse_site(site, "site", folder) if site is not None else None
    if own is not None and given is not None and given != own:
        raise SaeFileError(folder, "site", f"{given[0]}.{given[1]} disagrees with the folder's hookpoint {name} "
                                           f"({hook}.{own[1]})")
    where = own or given
    if where is None:
        raise SaeFileError(folder, "site", f"the folder name {_shown(name)} is not a hookpoint sparsify names "
                                           f"({what}); pass site=")
    if transcode and where[0] != "post_attn":
        raise SaeFileError(folder, "site", f"a transcoder of layer L sits at post_attn.L (the norm that makes the "
                                           f"MLP's input), got {where[0]}.{where[1]}")
    return where


def _dims(cfg_path: str, cfg: dict[str, Any], shapes: Shapes, file: str, skip: bool) -> tuple[int, int]:
    """(d_in, F) once every array is present with its shape (``skip``: W_skip too) and the config agrees."""
    names = ARRAYS + (("W_skip",) if skip else ())
    for name in names:
        if name not in shapes:
            held = _shown(sorted(shapes)) if shapes else "none"
            raise SaeFileError(file, name, f"missing array; the file holds {held}")
    unexpected = sorted(set(shapes) - set(names))
    if unexpected:
        raise SaeFileError(file, unexpected[0][:40], f"unexpected array for a sparsify SAE (expected "
                                                     f"{', '.join(names)})")
    enc = shapes["encoder.weight"][0]
    if len(enc) != 2 or 0 in enc:
        raise SaeFileError(file, "encoder.weight", f"wrong rank or empty: expected [num_latents, d_in], got "
                                                   f"{list(enc)}")
    f, d = enc
    for name, want in (("encoder.bias", (f,)), ("W_dec", (f, d)), ("b_dec", (d,)), ("W_skip", (d, d))):
        if name in shapes and shapes[name][0] != want:
            raise SaeFileError(file, name, f"shape {list(shapes[name][0])} does not match encoder.weight "
                                           f"{list(enc)}: expected {list(want)}")
    if _int_field(cfg_path, "d_in", cfg["d_in"]) != d:
        raise SaeFileError(cfg_path, "d_in", f"{_shown(cfg['d_in'])} disagrees with encoder.weight {list(enc)}")
    latents = _int_field(cfg_path, "num_latents", cfg.get("num_latents", 0))
    if latents and latents != f:
        raise SaeFileError(cfg_path, "num_latents", f"{latents} disagrees with encoder.weight {list(enc)}")
    if not latents:  # sparsify: num_latents or d_in * expansion_factor (its default 32)
        factor = _int_field(cfg_path, "expansion_factor", cfg.get("expansion_factor", 32))
        if d * factor != f:
            raise SaeFileError(cfg_path, "expansion_factor", f"{factor} x d_in {d} disagrees with encoder.weight "
                                                             f"{list(enc)} (num_latents is 0)")
    return d, f


def _read(file: str, entries: dict[str, Any], files: FileAccess) -> dict[str, np.ndarray]:
    a = _st_read(file, entries, ARRAYS, files)
    return {"W_enc": np.ascontiguousarray(a["encoder.weight"].T), "b_enc": a["encoder.bias"], "W_dec": a["W_dec"],
            "b_dec": a["b_dec"]}


def _folder(folder: str, site: str | None, files: FileAccess) -> tuple[Site, _Plan]:
    cfg_path, file = os.path.join(folder, CFG), os.path.join(folder, WEIGHTS)
    cfg = _read_json(cfg_path, files)
    k, transcode, skip = _check_cfg(cfg_path, cfg)
    where = _site(folder, os.path.basename(os.path.normpath(folder)), site, transcode)
    entries = _st_header(file, files)
    shapes = _st_shapes(entries)
    d, f = _dims(cfg_path, cfg, shapes, file, skip)
    _check_k(cfg_path, "k", k, f)
    meta = SaeMeta(d_model=d, d_sae=f, activation="topk", k=k, dtype=shapes["encoder.weight"][1],
                   b_dec_in=not transcode, transcoder=transcode)
    return where, _Plan(file, meta, lambda: _read(file, entries, files))


def sparsify_plans(path: str, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    """One hookpoint folder (its site from its name, or ``site``), or a checkpoint root: every hookpoint folder
    in it (``layers.N`` SAEs or ``layers.L.mlp`` transcoders, not both), or with ``site`` the one folder for it."""
    if is_folder(path):
        where, plan = _folder(path, site, files)
        return {where: plan}
    folders = _folders(path, files) if os.path.isdir(path) else {}
    if not folders:
        raise SaeFileError(path, "format", f"no sparsify hookpoint folder ({CFG} + {WEIGHTS}) here or in the "
                                           "directory's folders")
    if site is not None:
        want = _parse_site(site, "site", path)
        name = {"post_mlp": f"layers.{want[1]}", "post_attn": f"layers.{want[1]}.mlp"}.get(want[0])
        if name not in folders:
            raise SaeFileError(path, "site", f"no hookpoint folder for {want[0]}.{want[1]} (sparsify's layers.N is "
                                             "post_mlp.N, a transcoder's layers.L.mlp post_attn.L; this checkpoint "
                                             f"holds {_shown(list(folders))})")
        return dict([_folder(folders[name], None, files)])
    plans = {}
    for name, folder in folders.items():
        where, plan = _folder(folder, None, files)
        if plans and next(iter(plans.values())).meta.transcoder != plan.meta.transcoder:
            raise SaeFileError(path, "transcode", f"the checkpoint holds SAEs and transcoders ({name}): one "
                                                  "steer.sae entry is one kind; load each with site=")
        plans[where] = plan
    return plans
