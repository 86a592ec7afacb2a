"""SAE weight files: Gemma Scope ``params.npz``, sae-lens directories, EleutherAI sparsify checkpoints,
dictionary_learning trainer folders and our ``manifest.json``.

sae-lens transcoders (``transcoder``, ``skip_transcoder`` and their ``jumprelu_`` kinds) load from sae-lens
directories as SAEs whose meta says ``transcoder``: they encode layer L's MLP input (no b_dec subtracted) and
decode its output (``d_out`` = ``d_in``); their site is ``post_attn.L``, the norm that makes that input. W_skip
is checked, never read: a clamp's edit, ``dec(f') - dec(f)``, does not involve it (nor b_dec). One hooked at
TransformerLens' ``blocks.L.ln2.hook_normalized`` (Gemma Scope's) reads that norm's output without its gain (TL's
RMSNorm hooks ``x / scale`` before ``* w``): its meta says ``input="gain_free"``, and the worker folds the norm's
gain into W_enc (``runtime.sae_tables``). ``blocks.L.mlp.hook_in`` and the HF names read the norm's output as it is.

This module owns reading those formats into float32 numpy arrays (numpy, json, zipfile; no torch),
with every array, shape, dtype and activation checked. ``read_sae_meta`` reads headers only (the API
process validates requests against an SAE without loading its weights); ``load_sae`` reads the arrays.
Every problem is a ``SaeFileError`` naming the file and the key at fault; messages never quote a
file's bytes beyond short field values (parse errors give a line and column, not the text). Safetensors
files are read by a small reader of our own, since numpy has no bfloat16; a header is checked against
the file's size (its length field, every tensor's data) before anything it describes is read. Every
file is opened through a ``core.sae_paths.FileAccess`` (runtime registrations: inside steer.sae_root,
regular files, size cap; ``SaePathError`` passes through unchanged). sparsify's layout and config are
``core.sae_sparsify``'s, dictionary_learning's ``core.sae_dictlearn``'s (each imported on use: they read through
this module's helpers; the latter reads ``ae.pt`` with torch).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from vllm_steer.core.bf16 import from_bits
from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.sae_paths import UNRESTRICTED, FileAccess, SaeFileRefused, SaePathError
from vllm_steer.core.site_names import SITE_FORMS, parse_site_name

SITE_HOOKS: tuple[str, ...] = HOOK_NAMES  # ("pre_attn", "post_attn", "post_mlp")
ACTIVATIONS = ("relu", "jumprelu", "topk")
INPUTS = ("site", "gain_free")
FORMATS = ("gemma_scope", "sae_lens", "manifest", "sparsify", "dictionary_learning")

MANIFEST_FORMAT = "vllm-steer-sae"
MANIFEST_VERSION = 1
GEMMA_FILE, LENS_CFG, LENS_WEIGHTS, MANIFEST_FILE = "params.npz", "cfg.json", "sae_weights.safetensors", "manifest.json"
CORE_ARRAYS = ("W_enc", "W_dec", "b_enc", "b_dec")

_ST_DTYPES = {"F32": ("float32", "<f4"), "F16": ("float16", "<f2"), "BF16": ("bfloat16", "<u2")}
_RAW_DTYPES = {name: raw for name, raw in _ST_DTYPES.values()}
_MAX_ST_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB too
_HF_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]*)")  # sae-lens' name for a HF layer's output
_LENS_ARCHITECTURES = ("standard", "jumprelu", "topk")
_LENS_TRAINING_ONLY = ("batchtopk", "matryoshka_batchtopk")  # saved for inference as jumprelu (batchtopk_sae.py)
# sae-lens transcoders (saes/transcoder.py): architecture -> activation; "skip" ones also hold W_skip [d_out, d_in]
_LENS_TRANSCODERS = {"transcoder": "relu", "skip_transcoder": "relu", "jumprelu_transcoder": "jumprelu",
                     "jumprelu_skip_transcoder": "jumprelu"}
# the hook names sae-lens gives a transcoder's input (the MLP's input: layer L's pre-MLP norm output) and output
# (what the MLP block adds to the residual stream, after Gemma's post-MLP norm too)
# (blocks.L.hook_mlp_in is TransformerLens' stream before that norm: sae-lens gives it to Gemma Scope 2's transcoders,
# whose hf_hook_name, read first, says the norm's output). blocks.L.mlp.hook_in (TransformerLens 3's bridge, circuit-
# tracer's ReplacementMLP) is the MLP module's input, after ln2 and its gain; ln2.hook_normalized is before the gain.
_TC_IN = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(?:ln2\.hook_normalized|mlp\.hook_in)"
                    r"|model\.layers\.(0|[1-9][0-9]*)\.(?:mlp|mlp\.input|post_attention_layernorm\.output"
                    r"|pre_feedforward_layernorm\.output)")
_GAIN_FREE = re.compile(r"blocks\.(0|[1-9][0-9]*)\.ln2\.hook_normalized")  # TL hooks x / scale, before * w
_TC_OUT = re.compile(r"blocks\.(0|[1-9][0-9]*)\.hook_mlp_out")
_MANIFEST_KEYS = {"format", "version", "activation", "k", "b_dec_in", "sites"}

Site = tuple[str, int]
Shapes = dict[str, tuple[tuple[int, ...], str]]  # array name -> (shape, dtype name)


class SaeFileError(ValueError):
    """A bad SAE file; ``path`` is the file, ``key`` the key or field at fault (a ValueError)."""

    def __init__(self, path: str | None, key: str, message: str) -> None:
        self.path, self.key, self.detail = path, key, message
        super().__init__(f"{path}: {key}: {message}" if path else f"{key}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.key, self.detail)


@dataclass(frozen=True)
class SaeMeta:
    """What the API process needs to validate requests; read from headers only."""

    d_model: int
    d_sae: int
    activation: str  # one of ACTIVATIONS
    k: int  # TopK's k (0 otherwise)
    dtype: str  # stored weight dtype: "float32" | "float16" | "bfloat16"
    b_dec_in: bool  # subtract b_dec from the input before encoding (sae-lens apply_b_dec_to_input)
    transcoder: bool = False  # reads layer L's MLP input, writes its output; its site is post_attn.L (the norm)
    input: str = "site"  # one of INPUTS: "site" the site's stream as hooked (a transcoder: its norm's output),
    # "gain_free" that norm's output divided by its gain (TransformerLens' ln2.hook_normalized)


@dataclass(frozen=True)
class SaeWeights:
    meta: SaeMeta
    w_enc: np.ndarray  # [d_model, d_sae] float32
    b_enc: np.ndarray  # [d_sae] float32
    w_dec: np.ndarray  # [d_sae, d_model] float32
    b_dec: np.ndarray  # [d_model] float32
    threshold: np.ndarray | None  # [d_sae] float32 for jumprelu, else None


@dataclass(frozen=True)
class _Plan:
    """One site's SAE as read from headers: its weights file, meta and how to read its arrays."""

    file: str
    meta: SaeMeta
    read: Callable[[], dict[str, np.ndarray]]  # array name -> float32, checked finite


def _shown(value: Any) -> str:
    """A file's value in a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _open(files: FileAccess, path: str) -> Any:
    """``path`` opened through ``files``; SaeFileError for a refused or unreadable file."""
    try:
        return files.open(path)
    except SaePathError:
        raise
    except SaeFileRefused as e:
        raise SaeFileError(path, "file", str(e)) from None
    except FileNotFoundError:
        raise SaeFileError(path, "file", "not found") from None
    except OSError as e:
        raise SaeFileError(path, "file", f"cannot read ({e.strerror or type(e).__name__})") from None


def _json_error(e: ValueError) -> str:
    """A JSON parse error without the text it failed on."""
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON (line {e.lineno}, column {e.colno})"
    return "not valid UTF-8 JSON"


# --- sites -------------------------------------------------------------------------------------


def parse_site(text: str, field: str) -> tuple[str, int]:
    """``"post_mlp.12"`` or ``"blocks.12.hook_resid_post"`` -> ``("post_mlp", 12)`` (``core.site_names``);
    SaeFileError naming ``field`` otherwise."""
    return _parse_site(text, field, None)


def _parse_site(text: Any, field: str, path: str | None) -> Site:
    try:
        return parse_site_name(text)
    except ValueError as e:
        raise SaeFileError(path, field, str(e)) from None


def _lens_site(hook_name: Any) -> Site | None:
    """The site of a sae-lens ``hook_name`` (a site name, or ``model.layers.L``: post_mlp.L), or None
    when it is not one we know."""
    m = _HF_LAYER.fullmatch(hook_name) if isinstance(hook_name, str) else None
    if m:
        return "post_mlp", int(m.group(1))
    try:
        return parse_site_name(hook_name)
    except ValueError:
        return None


# --- format detection --------------------------------------------------------------------------


def _is_file(*parts: str) -> bool:
    return _present(os.path.join(*parts))


def _present(path: str) -> bool:
    """A file, or a symlink whatever it points at: opening it (``FileAccess.open``) decides, so a link
    out of ``steer.sae_root`` is refused alike whether its target exists or not (no existence oracle)."""
    return os.path.isfile(path) or os.path.islink(path)


def _matching_formats(path: str) -> list[str]:
    if os.path.isfile(path):
        return ["gemma_scope"] if path.endswith(".npz") else []
    if not os.path.isdir(path):
        return []
    found = []
    if _is_file(path, GEMMA_FILE):
        found.append("gemma_scope")
    if _is_file(path, LENS_CFG) and _is_file(path, LENS_WEIGHTS):
        found.append("sae_lens")
    if _is_file(path, MANIFEST_FILE):
        found.append("manifest")
    if _dictlearn().is_folder(path):
        found.append("dictionary_learning")
    sparsify = _sparsify()
    if sparsify.is_folder(path) or (not found and sparsify.is_root(path)):
        found.append("sparsify")
    return found


def detect_format(path: str) -> str:
    """The format of ``path`` (one of FORMATS), from the files present."""
    found = _matching_formats(path)
    if len(found) == 1:
        return found[0]
    if found:
        raise SaeFileError(path, "format", f"ambiguous: the directory holds files of {', '.join(found)}; pass format=")
    what = "no such file or directory" if not os.path.exists(path) else "not an SAE file or directory"
    raise SaeFileError(path, "format", f"{what}: looked for a .npz file, a directory with {GEMMA_FILE} (gemma_scope), "
                                       f"{LENS_CFG} + {LENS_WEIGHTS} (sae_lens), {MANIFEST_FILE} (manifest), or "
                                       f"{LENS_CFG} + sae.safetensors (sparsify: the folder, or a folder of them), or "
                                       "config.json + ae.pt (dictionary_learning)")


# --- .npz headers and arrays (Gemma Scope) -----------------------------------------------------


def _dtype_name(dt: np.dtype) -> str | None:
    if dt.kind == "f" and dt.itemsize in (2, 4):
        return "float16" if dt.itemsize == 2 else "float32"
    return None


def _npy_header(path: str, key: str, fp: Any, size: int) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of one member, whose data must fit its ``size`` (uncompressed bytes)."""
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
    except ValueError:
        raise SaeFileError(path, key, "bad .npy header") from None
    name = _dtype_name(dtype)
    if name is None:
        raise SaeFileError(path, key, f"unsupported dtype {dtype.str!r} (supported: float32, float16, bfloat16)")
    if math.prod(shape) * dtype.itemsize > size:
        raise SaeFileError(path, key, f"data truncated (shape {list(shape)} does not fit the member's {size} bytes)")
    return tuple(int(d) for d in shape), name


def _npz_shapes(path: str, files: FileAccess) -> Shapes:
    """Array name -> (shape, dtype) from the .npy headers of the zip members (no array data read);
    each member's uncompressed size is held to the size cap too."""
    shapes: Shapes = {}
    with _open(files, path) as raw:
        try:
            with zipfile.ZipFile(raw) as zf:
                for info in zf.infolist():
                    key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                    if files.max_bytes is not None and info.file_size > files.max_bytes:
                        raise SaeFileError(path, key[:40], f"{info.file_size} bytes uncompressed, over "
                                                              f"steer.max_sae_bytes ({files.max_bytes})")
                    with zf.open(info) as fp:
                        shapes[key] = _npy_header(path, key[:40], fp, info.file_size)
        except (zipfile.BadZipFile, OSError, EOFError):
            raise SaeFileError(path, "file", "not a readable .npz archive") from None
    return shapes


def _npz_read(path: str, names: tuple[str, ...], files: FileAccess) -> dict[str, np.ndarray]:
    try:
        with _open(files, path) as raw, np.load(raw, allow_pickle=False) as z:
            arrays = {n: np.ascontiguousarray(z[n], dtype=np.float32) for n in names}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
        if isinstance(e, (SaeFileError, SaePathError)):
            raise
        raise SaeFileError(path, "file", f"cannot read the arrays ({type(e).__name__})") from None
    return {n: _finite(path, n, a) for n, a in arrays.items()}


# --- safetensors headers and arrays ------------------------------------------------------------


@dataclass(frozen=True)
class _StEntry:
    dtype: str  # our name: float32 | float16 | bfloat16
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the data
    count: int  # number of elements


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return value
    return None


def _st_entry(path: str, name: str, spec: Any, base: int) -> _StEntry:
    if not isinstance(spec, dict):
        raise SaeFileError(path, name, "bad safetensors header entry")
    if spec.get("dtype") not in _ST_DTYPES:
        raise SaeFileError(path, name, f"unsupported dtype {_shown(spec.get('dtype'))} (supported: F32, F16, BF16)")
    dtype, raw = _ST_DTYPES[spec["dtype"]]
    shape, offsets = _int_list(spec.get("shape")), _int_list(spec.get("data_offsets"))
    if shape is None or offsets is None or len(offsets) != 2:
        raise SaeFileError(path, name, "bad safetensors header entry (shape / data_offsets)")
    count = math.prod(shape)
    if offsets[1] - offsets[0] != count * np.dtype(raw).itemsize:
        raise SaeFileError(path, name, f"data_offsets {offsets} do not fit shape {shape} of {spec['dtype']}")
    return _StEntry(dtype, tuple(shape), base + offsets[0], count)


def _st_header(path: str, files: FileAccess) -> dict[str, _StEntry]:
    """Tensor name -> entry, from the safetensors header (8-byte little-endian length, JSON); the
    length and every tensor's data must lie within the file, checked before they are read."""
    try:
        with _open(files, path) as f:
            total = os.fstat(f.fileno()).st_size
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            fits = 0 <= size <= min(_MAX_ST_HEADER, total - 8)
            raw = f.read(size) if fits else b""
    except OSError as e:
        raise SaeFileError(path, "file", f"cannot read ({e.strerror or type(e).__name__})") from None
    if not fits or len(raw) != size:
        raise SaeFileError(path, "header", "not a safetensors file (short or oversized header)")
    try:
        header = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise SaeFileError(path, "header", f"not a safetensors file (bad JSON header: {_json_error(e)})") from None
    if not isinstance(header, dict):
        raise SaeFileError(path, "header", "not a safetensors file (header is not a JSON object)")
    entries = {k: _st_entry(path, k[:40], v, 8 + size) for k, v in header.items() if k != "__metadata__"}
    for k, e in entries.items():
        if e.offset + e.count * np.dtype(_RAW_DTYPES[e.dtype]).itemsize > total:
            raise SaeFileError(path, k[:40], "data truncated (file shorter than its header says)")
    return entries


def _st_shapes(entries: dict[str, _StEntry]) -> Shapes:
    return {k: (e.shape, e.dtype) for k, e in entries.items()}


def _st_read(path: str, entries: dict[str, _StEntry], names: tuple[str, ...],
             files: FileAccess) -> dict[str, np.ndarray]:
    """The named tensors as float32 (bf16 and fp16 converted), each checked finite."""
    out = {}
    try:
        with _open(files, path) as f:
            for name in names:
                e = entries[name]
                words = np.empty(e.count, dtype=_RAW_DTYPES[e.dtype])
                f.seek(e.offset)
                if f.readinto(memoryview(words).cast("B")) != words.nbytes:
                    raise SaeFileError(path, name, "data truncated (file shorter than its header says)")
                values = from_bits(words) if e.dtype == "bfloat16" else words.astype(np.float32, copy=False)
                out[name] = _finite(path, name, values.reshape(e.shape))
    except OSError as e:
        if isinstance(e, SaePathError):
            raise
        raise SaeFileError(path, "file", f"cannot read ({e.strerror or type(e).__name__})") from None
    return out


# --- shared checks -----------------------------------------------------------------------------


def _finite(path: str, name: str, values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all():
        raise SaeFileError(path, name, f"non-finite values ({int((~np.isfinite(values)).sum())} of {values.size})")
    return values


def _needed(activation: str) -> tuple[str, ...]:
    return CORE_ARRAYS + (("threshold",) if activation == "jumprelu" else ())


def _check_shapes(path: str, shapes: Shapes, activation: str, extra: tuple[str, ...] = ()) -> tuple[int, int]:
    """(d_model, d_sae) once every array is present, of the right rank and shape; SaeFileError otherwise."""
    needed = _needed(activation)
    for name in needed:
        if name not in shapes:
            why = " (jumprelu needs a threshold)" if name == "threshold" else ""
            held = _shown(sorted(shapes)) if shapes else "none"
            raise SaeFileError(path, name, f"missing array{why}; the file holds {held}")
    unexpected = sorted(set(shapes) - set(needed) - set(extra))
    if unexpected:
        raise SaeFileError(path, unexpected[0][:40], f"unexpected array for a {activation} SAE "
                                                f"(expected {', '.join(needed)})")
    w_enc = shapes["W_enc"][0]
    if len(w_enc) != 2 or 0 in w_enc:
        raise SaeFileError(path, "W_enc", f"wrong rank or empty: expected [d_model, d_sae], got {list(w_enc)}")
    d, f = w_enc
    want = {"W_dec": (f, d), "b_enc": (f,), "b_dec": (d,), "threshold": (f,), "scaling_factor": (f,), "W_skip": (d, d)}
    for name in sorted(shapes):
        shape = shapes[name][0]
        if name in want and len(shape) != len(want[name]):
            raise SaeFileError(path, name, f"wrong rank: expected {len(want[name])} dims, got shape {list(shape)}")
        if name in want and shape != want[name]:
            raise SaeFileError(path, name, f"shape {list(shape)} does not match W_enc {list(w_enc)}: "
                                           f"expected {list(want[name])}")
    return d, f


def _check_k(path: str, field: str, k: int, d_sae: int) -> None:
    if not 1 <= k <= d_sae:
        raise SaeFileError(path, field, f"topk needs 1 <= k <= d_sae ({d_sae}), got {k}")


def _int_field(path: str, field: str, value: Any) -> int:
    """An integer config value (an integral float like 64.0 is accepted; bools are not)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SaeFileError(path, field, f"expected an integer, got {_shown(value)}")
    return value


def _bool_field(path: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SaeFileError(path, field, f"expected true or false, got {_shown(value)}")
    return value


def _read_json(path: str, files: FileAccess) -> dict[str, Any]:
    with _open(files, path) as f:
        try:
            data = json.loads(f.read().decode("utf-8"))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
            raise SaeFileError(path, "file", _json_error(e)) from None
        except OSError as e:
            raise SaeFileError(path, "file", f"cannot read ({e.strerror or type(e).__name__})") from None
    if not isinstance(data, dict):
        raise SaeFileError(path, "file", "expected a JSON object")
    return data


def _site_arg(path: str, site: str | None, default: Site | None, what: str) -> Site:
    if site is not None:
        return _parse_site(site, "site", path)
    if default is None:
        raise SaeFileError(path, "site", f"{what}; pass site={SITE_FORMS}")
    return default


# --- gemma_scope -------------------------------------------------------------------------------


def _gemma_file(path: str) -> str:
    return path if os.path.isfile(path) or path.endswith(".npz") else os.path.join(path, GEMMA_FILE)


def _gemma_plans(path: str, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    file = _gemma_file(path)
    if not _present(file):
        raise SaeFileError(file, "file", "not found")
    shapes = _npz_shapes(file, files)
    d, f = _check_shapes(file, shapes, "jumprelu")
    meta = SaeMeta(d_model=d, d_sae=f, activation="jumprelu", k=0, dtype=shapes["W_enc"][1], b_dec_in=False)
    where = _site_arg(file, site, None, "a Gemma Scope file does not name its site")
    return {where: _Plan(file, meta, lambda: _npz_read(file, _needed("jumprelu"), files))}


# --- sae_lens ----------------------------------------------------------------------------------


def _lens_k(cfg_path: str, cfg: dict[str, Any]) -> tuple[int, str]:
    """(k, the field it came from): ``k`` (sae-lens 6) or ``activation_fn_kwargs.k`` (older)."""
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if "k" in cfg:
        return _int_field(cfg_path, "k", cfg["k"]), "k"
    if isinstance(kwargs, dict) and "k" in kwargs:
        return _int_field(cfg_path, "activation_fn_kwargs.k", kwargs["k"]), "activation_fn_kwargs.k"
    raise SaeFileError(cfg_path, "k", "a topk SAE needs k (or activation_fn_kwargs.k)")


def _lens_activation(cfg_path: str, cfg: dict[str, Any]) -> tuple[str, int, str]:
    """(activation, k, k's field): old cfgs say architecture 'standard' + activation_fn[_str] 'relu' | 'topk';
    sae-lens 6 says architecture 'standard' | 'jumprelu' | 'topk' (with k)."""
    arch = cfg.get("architecture", "standard")
    act_key = next((k for k in ("activation_fn_str", "activation_fn") if k in cfg), "activation_fn")
    act = cfg.get(act_key) or None
    if arch in _LENS_TRANSCODERS and act in (None, "relu"):
        return _LENS_TRANSCODERS[arch], 0, ""
    if arch not in _LENS_ARCHITECTURES and arch not in _LENS_TRANSCODERS:
        hint = ("; a BatchTopK training checkpoint: sae-lens saves it for inference as a JumpReLU SAE (its threshold the "
                "learned top-k threshold), which loads" if arch in _LENS_TRAINING_ONLY else "")
        raise SaeFileError(cfg_path, "architecture", f"unsupported architecture {_shown(arch)} (supported: "
                                                     f"{', '.join(_LENS_ARCHITECTURES + tuple(_LENS_TRANSCODERS))}){hint}")
    if arch == "standard" and act in (None, "relu"):
        return "relu", 0, ""
    if arch in ("standard", "topk") and act in (None, "topk"):
        return ("topk", *_lens_k(cfg_path, cfg))
    if arch == "jumprelu" and act in (None, "relu"):
        return "jumprelu", 0, ""
    raise SaeFileError(cfg_path, act_key, f"unsupported activation {_shown(act)} for architecture {_shown(arch)}")


def _lens_field(cfg: dict[str, Any], *keys: str) -> tuple[Any, str]:
    """(value, field) of the first of ``keys`` set: top level (sae-lens < 6), else under metadata (6) or meta
    (6 rc); (None, keys[0]) when none is."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key], key
    for outer in ("metadata", "meta"):
        for key in keys:
            if isinstance(cfg.get(outer), dict) and cfg[outer].get(key) is not None:
                return cfg[outer][key], f"{outer}.{key}"
    return None, keys[0]


def _lens_hook_name(cfg: dict[str, Any]) -> Any:
    """hook_name: top level (sae-lens < 6, or hook_point older still), else under metadata (6) or meta (6 rc)."""
    return _lens_field(cfg, "hook_name", "hook_point")[0]


def _tc_layer(pattern: re.Pattern, value: Any) -> int | None:
    m = pattern.fullmatch(value) if isinstance(value, str) else None
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def _lens_transcoder(cfg_path: str, cfg: dict[str, Any], arch: str, d_in: int | None) -> tuple[Site | None, str]:
    """A transcoder's checks (sae-lens saes/transcoder.py), its site, post_attn.L: the norm whose output is
    layer L's MLP input (its ``hf_hook_name``, else ``hook_name``; None when neither names one), whose output
    ``hook_name_out`` must be that layer's ``hook_mlp_out`` (what the MLP block adds to the stream), and its input
    (``SaeMeta.input``: "gain_free" when the name read is ``blocks.L.ln2.hook_normalized``)."""
    if _bool_field(cfg_path, "apply_b_dec_to_input", cfg.get("apply_b_dec_to_input", False)):
        raise SaeFileError(cfg_path, "apply_b_dec_to_input", "true is not supported for a transcoder (b_dec is "
                                                              "the output's bias; sae-lens refuses it too)")
    if "d_out" not in cfg:
        raise SaeFileError(cfg_path, "d_out", f"missing (architecture {arch} needs it)")
    if _int_field(cfg_path, "d_out", cfg["d_out"]) != d_in and d_in is not None:
        raise SaeFileError(cfg_path, "d_out", f"{_shown(cfg['d_out'])} != d_in {d_in}: a transcoder writes the MLP's "
                                              "output, as wide as its input")
    hf, hf_field = _lens_field(cfg, "hf_hook_name")
    name, name_field = (hf, hf_field) if hf is not None else _lens_field(cfg, "hook_name", "hook_point")
    layer = _tc_layer(_TC_IN, name)
    if layer is None and name is not None:
        raise SaeFileError(cfg_path, name_field, f"{_shown(name)} is not an MLP input (expected blocks.L.ln2."
                                                 "hook_normalized, blocks.L.mlp.hook_in, or an hf_hook_name "
                                                 "model.layers.L.mlp)")
    out, out_field = _lens_field(cfg, "hook_name_out")
    out_layer = _tc_layer(_TC_OUT, out)
    if out is not None and (out_layer is None or (layer is not None and out_layer != layer)):
        raise SaeFileError(cfg_path, out_field, f"{_shown(out)}: a transcoder must write the MLP output of the layer "
                                                f"it reads (blocks.{layer if layer is not None else 'L'}.hook_mlp_out)")
    gain_free = isinstance(name, str) and _GAIN_FREE.fullmatch(name) is not None
    return (None if layer is None else ("post_attn", layer)), ("gain_free" if gain_free else "site")


def _lens_refusals(cfg_path: str, cfg: dict[str, Any], hook_name: Any) -> None:
    """What sae-lens does at run time that plain weights cannot express: refused, naming the key."""
    norm = cfg.get("normalize_activations")
    if norm not in (None, "none", False):
        raise SaeFileError(cfg_path, "normalize_activations", f"{_shown(norm)} is not supported (only 'none'): "
                                                              "fold the normalization into the weights first")
    reshape = cfg.get("reshape_activations")
    if reshape is None and isinstance(hook_name, str) and "hook_z" in hook_name:
        reshape = "hook_z"  # what sae-lens < 6 infers
    if reshape not in (None, "none"):
        raise SaeFileError(cfg_path, "reshape_activations", f"{_shown(reshape)} (an attention-head SAE) is not supported")
    if cfg.get("finetuning_scaling_factor"):
        raise SaeFileError(cfg_path, "finetuning_scaling_factor", "a finetuning scaling factor is not supported")


def _lens_dims(cfg_path: str, cfg: dict[str, Any], d: int, f: int, weights: str) -> None:
    for key, got in (("d_in", d), ("d_sae", f)):
        if key not in cfg:
            raise SaeFileError(cfg_path, key, "missing")
        if _int_field(cfg_path, key, cfg[key]) != got:
            raise SaeFileError(cfg_path, key, f"{_shown(cfg[key])} disagrees with W_enc [{d}, {f}] in "
                                             f"{os.path.basename(weights)}")


def _lens_read(file: str, entries: dict[str, _StEntry], activation: str, fold_norm: bool,
               files: FileAccess) -> dict[str, np.ndarray]:
    names = tuple(n for n in entries if n in _needed(activation) + ("log_threshold", "scaling_factor"))
    arrays = _st_read(file, entries, names, files)
    if "log_threshold" in arrays:
        arrays["threshold"] = _finite(file, "log_threshold", np.exp(arrays.pop("log_threshold")))
    scaling = arrays.pop("scaling_factor", None)
    if scaling is not None and not np.all(scaling == 1.0):
        raise SaeFileError(file, "scaling_factor", "a scaling factor other than all ones is not supported")
    if fold_norm:  # topk with rescale_acts_by_decoder_norm: fold the decoder norms in, as sae-lens saves them
        norms = np.linalg.norm(arrays["W_dec"], axis=1)
        if not (norms > 0).all():
            raise SaeFileError(file, "W_dec", "a zero row cannot be folded (rescale_acts_by_decoder_norm)")
        arrays["W_enc"], arrays["b_enc"] = arrays["W_enc"] * norms, arrays["b_enc"] * norms
        arrays["W_dec"] = arrays["W_dec"] / norms[:, None]
    return arrays


def _lens_plans(path: str, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    cfg_path, file = os.path.join(path, LENS_CFG), os.path.join(path, LENS_WEIGHTS)
    cfg = _read_json(cfg_path, files)
    activation, k, k_field = _lens_activation(cfg_path, cfg)
    hook_name = _lens_hook_name(cfg)
    _lens_refusals(cfg_path, cfg, hook_name)
    arch = cfg.get("architecture")
    transcoder = arch in _LENS_TRANSCODERS
    b_dec_in = not transcoder and _bool_field(cfg_path, "apply_b_dec_to_input", cfg.get("apply_b_dec_to_input", True))
    d_in = _int_field(cfg_path, "d_in", cfg["d_in"]) if "d_in" in cfg else None  # None: _lens_dims says it is missing
    tc_site, tc_input = _lens_transcoder(cfg_path, cfg, arch, d_in) if transcoder else (None, "site")
    fold = activation == "topk" and _bool_field(cfg_path, "rescale_acts_by_decoder_norm",
                                                cfg.get("rescale_acts_by_decoder_norm", False))
    if not _present(file):
        raise SaeFileError(file, "file", "not found")
    entries = _st_header(file, files)
    shapes = _st_shapes(entries)
    if "threshold" not in shapes and "log_threshold" in shapes:
        shapes["threshold"] = shapes.pop("log_threshold")
    skip = transcoder and "skip" in arch
    if skip and "W_skip" not in shapes:
        raise SaeFileError(file, "W_skip", f"missing array (architecture {arch} has a skip connection)")
    d, f = _check_shapes(file, shapes, activation, extra=("scaling_factor",) + (("W_skip",) if skip else ()))
    _lens_dims(cfg_path, cfg, d, f, file)
    if activation == "topk":
        _check_k(cfg_path, k_field, k, f)
    meta = SaeMeta(d_model=d, d_sae=f, activation=activation, k=k, dtype=shapes["W_enc"][1], b_dec_in=b_dec_in,
                   transcoder=transcoder, input=tc_input)
    if transcoder:
        where = _site_arg(cfg_path, site, tc_site,
                          f"hook_name {_shown(hook_name)} does not name the MLP input of a layer")
        if where[0] != "post_attn":
            raise SaeFileError(cfg_path, "site", f"a transcoder of layer L sits at post_attn.L (the norm that makes "
                                                 f"the MLP's input), got {where[0]}.{where[1]}")
        return {where: _Plan(file, meta, lambda: _lens_read(file, entries, activation, False, files))}
    where = _site_arg(cfg_path, site, _lens_site(hook_name),
                      f"hook_name {_shown(hook_name)} is not a residual-stream hook")
    return {where: _Plan(file, meta, lambda: _lens_read(file, entries, activation, fold, files))}


# --- manifest ----------------------------------------------------------------------------------


def _manifest_header(mpath: str, m: dict[str, Any]) -> tuple[str, int, bool]:
    """(activation, k, b_dec_in) from manifest.json, every key checked."""
    unknown = sorted(set(m) - _MANIFEST_KEYS)
    if unknown:
        raise SaeFileError(mpath, unknown[0][:40], f"unknown key (expected {', '.join(sorted(_MANIFEST_KEYS))})")
    if m.get("format") != MANIFEST_FORMAT:
        raise SaeFileError(mpath, "format", f"expected {MANIFEST_FORMAT!r}, got {_shown(m.get('format'))}")
    if _int_field(mpath, "version", m.get("version")) != MANIFEST_VERSION:
        raise SaeFileError(mpath, "version", f"unsupported version {_shown(m['version'])} (supported: {MANIFEST_VERSION})")
    activation = m.get("activation")
    if activation not in ACTIVATIONS:
        raise SaeFileError(mpath, "activation", f"unknown activation {_shown(activation)} "
                                                f"(expected {', '.join(ACTIVATIONS)})")
    if activation == "topk" and "k" not in m:
        raise SaeFileError(mpath, "k", "a topk SAE needs k")
    k = _int_field(mpath, "k", m.get("k", 0))
    if activation != "topk" and k != 0:
        raise SaeFileError(mpath, "k", f"k is for topk only (activation is {activation})")
    return activation, k, _bool_field(mpath, "b_dec_in", m.get("b_dec_in", False))


def _manifest_file(mpath: str, root: str, field: str, rel: Any) -> str:
    """A site's weights file, which must lie inside the manifest's directory."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise SaeFileError(mpath, field, f"expected a relative file path, got {_shown(rel)}")
    real_root = os.path.realpath(root)
    file = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([real_root, file]) != real_root:
        raise SaeFileError(mpath, field, f"{_shown(rel)} escapes the manifest's directory")
    if not os.path.isfile(file):
        raise SaeFileError(mpath, field, f"{_shown(rel)}: file not found")
    return file


def _manifest_site(mpath: str, file: str, activation: str, k: int, b_dec_in: bool,
                   files: FileAccess) -> _Plan:
    entries = _st_header(file, files)
    shapes = _st_shapes(entries)
    d, f = _check_shapes(file, shapes, activation)
    if activation == "topk":
        _check_k(mpath, "k", k, f)
    meta = SaeMeta(d_model=d, d_sae=f, activation=activation, k=k, dtype=shapes["W_enc"][1], b_dec_in=b_dec_in)
    return _Plan(file, meta, lambda: _st_read(file, entries, _needed(activation), files))


def _manifest_plans(path: str, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    mpath = os.path.join(path, MANIFEST_FILE)
    if site is not None:
        raise SaeFileError(mpath, "site", "must not be given for a manifest (it lists its own sites)")
    m = _read_json(mpath, files)
    activation, k, b_dec_in = _manifest_header(mpath, m)
    sites = m.get("sites")
    if not isinstance(sites, dict) or not sites:
        raise SaeFileError(mpath, "sites", "expected a non-empty object of 'hook.layer': file")
    plans = {}
    for text, rel in sites.items():
        field = f"sites[{_shown(text)}]"
        where = _parse_site(text, field, mpath)
        if where in plans:
            raise SaeFileError(mpath, field, f"site {where[0]}.{where[1]} is named twice")
        plans[where] = _manifest_site(mpath, _manifest_file(mpath, path, field, rel), activation, k, b_dec_in,
                                       files)
    return plans


# --- sparsify (core/sae_sparsify.py) ----------------------------------------------------------


def _sparsify() -> Any:
    """``core.sae_sparsify``, imported on use (it imports this module's readers)."""
    from vllm_steer.core import sae_sparsify

    return sae_sparsify


def _sparsify_plans(path: str, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    return _sparsify().sparsify_plans(path, site, files)


# --- dictionary_learning (core/sae_dictlearn.py) ------------------------------------------------


def _dictlearn() -> Any:
    """``core.sae_dictlearn``, imported on use (it imports this module's readers)."""
    from vllm_steer.core import sae_dictlearn

    return sae_dictlearn


def _dictlearn_plans(path: str, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    return _dictlearn().dictlearn_plans(path, site, files)


# --- public entry points -----------------------------------------------------------------------

_PLANNERS: dict[str, Callable[[str, str | None, FileAccess], dict[Site, _Plan]]] = {
    "gemma_scope": _gemma_plans, "sae_lens": _lens_plans, "manifest": _manifest_plans, "sparsify": _sparsify_plans,
    "dictionary_learning": _dictlearn_plans,
}


def _plans(path: str, format: str | None, site: str | None, files: FileAccess) -> dict[Site, _Plan]:
    path = os.fspath(path)
    files.resolve(path)  # SaePathError for a path outside steer.sae_root (or none there), whatever the reason
    if format is None:
        format = detect_format(path)
    elif format not in FORMATS:
        raise SaeFileError(path, "format", f"unknown format {_shown(format)} (expected one of {', '.join(FORMATS)})")
    return _PLANNERS[format](path, site, files)


def read_sae_meta(path: str, format: str | None = None, site: str | None = None,
                  files: FileAccess = UNRESTRICTED) -> dict[tuple[str, int], SaeMeta]:
    """Per site, what the SAE at ``path`` is, from its headers only (no weights read)."""
    return {where: plan.meta for where, plan in _plans(path, format, site, files).items()}


def _weights(plan: _Plan) -> SaeWeights:
    a = plan.read()
    # sae-lens' JumpReLU is relu(pre) * (pre > t); ours is pre * (pre > t), the same once t >= 0
    threshold = np.maximum(a["threshold"], 0, dtype=np.float32) if plan.meta.activation == "jumprelu" else None
    return SaeWeights(meta=plan.meta, w_enc=a["W_enc"], b_enc=a["b_enc"], w_dec=a["W_dec"], b_dec=a["b_dec"],
                      threshold=threshold)


def load_sae(path: str, format: str | None = None, site: str | None = None,
             files: FileAccess = UNRESTRICTED) -> dict[tuple[str, int], SaeWeights]:
    """Per site, the SAE at ``path`` as float32 arrays, every array checked (every header first)."""
    return {where: _weights(plan) for where, plan in _plans(path, format, site, files).items()}
