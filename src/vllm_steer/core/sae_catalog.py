"""The SAEs a server knows, checked against the model: for each name, its sites, its clampable
features and their slots, whether it may reconstruct. Those of ``steer.sae`` are built at start-up by
the API process from file headers only (to validate requests) and by every worker before loading the
weights of its sites, so both agree on slots and sites. Those registered at runtime take sites that
``steer.sae_slots`` reserved (``runtime_entry``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from vllm_steer.core.config import MAX_CLAMPABLE, SaeModuleConfig, SteerConfig, SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.sae_files import SaeFileError, SaeMeta, parse_site, read_sae_meta
from vllm_steer.core.sae_paths import UNRESTRICTED, FileAccess, SaePathError, runtime_access

Site = tuple[str, int]


@dataclass(frozen=True)
class SaeEntry:
    name: str
    config: SaeModuleConfig
    sites: dict[Site, SaeMeta]
    features: tuple[int, ...]  # clampable feature ids, in slot order
    slot_of: dict[int, int]  # feature id -> slot
    identity: str  # changes when the files do (hashed into config keys)
    version: int = 0  # > 0: registered at runtime (POST /v1/steering/sae), its registration number

    @property
    def transcoder(self) -> bool:
        """A transcoder (reads layer L's MLP input, its clamps edit the MLP's output): its sites are post_attn.L."""
        return any(m.transcoder for m in self.sites.values())

    @property
    def full(self) -> bool:
        """Whether the workers keep the whole SAE (reconstruct allowed, or TopK needs every feature)."""
        return self.config.reconstruct or any(m.activation == "topk" for m in self.sites.values())


def _identity(name: str, path: str, version: int = 0) -> str:
    stats = [os.stat(path)]
    if os.path.isdir(path):
        stats += [os.stat(os.path.join(path, f)) for f in sorted(os.listdir(path))]
    tag = f"\0v{version}" if version else ""  # a runtime registration: keys never outlive it
    return f"{name}\0{os.path.abspath(path)}\0" + ",".join(f"{s.st_size}:{s.st_mtime_ns}" for s in stats) + tag


Fail = Callable[[str, str], Exception]  # (sub-field or "", message) -> the error to raise


def _entry(name: str, c: SaeModuleConfig, cfg: SteerConfig, hidden: int, num_layers: int, fail: Fail,
           version: int = 0, files: FileAccess = UNRESTRICTED) -> SaeEntry:
    """SaePathError (a runtime path ``files`` refuses) passes through as it is."""
    try:
        sites = read_sae_meta(c.path, c.format, c.site, files)
    except SaeFileError as e:
        shown = f"{files.shown(e.path)}: {e.key}: {e.detail}" if e.path else str(e)
        raise fail("site" if e.key == "site" else "path", shown) from None
    except SaePathError:
        raise
    except OSError as e:
        raise fail("path", str(e)) from None
    for (hook, layer), meta in sites.items():
        where = f"site {hook}.{layer}"
        if meta.d_model != hidden:
            raise fail("path", f"{where}: d_model {meta.d_model} != the model's hidden size {hidden}")
        if not 0 <= layer < num_layers:
            raise fail("site", f"{where}: the model has {num_layers} layers")
        if hook not in cfg.hooks or (cfg.layers is not None and layer not in cfg.layers):
            raise fail("site", f"{where} is not a steerable site (steer.hooks / steer.layers)")
        if (hook, layer) == ("pre_attn", 0):
            raise fail("site", f"{where}: pre_attn of layer 0 cannot take an SAE (use post_attn.0 or later)")
        if meta.transcoder and c.reconstruct:
            raise fail("reconstruct", f"{where}: a transcoder clamps only (delta); it cannot reconstruct the MLP's "
                                      "output")
    d_sae = {m.d_sae for m in sites.values()}
    features = c.features
    if features is None:
        if max(d_sae) > MAX_CLAMPABLE:
            raise fail("features", f"d_sae is {max(d_sae)}; list the features requests may clamp "
                                   f"(at most {MAX_CLAMPABLE})")
        features = tuple(range(max(d_sae)))
    if len(features) > MAX_CLAMPABLE:
        raise fail("features", f"{len(features)} features, at most {MAX_CLAMPABLE}")
    bad = [f for f in features if f >= min(d_sae)]
    if bad:
        raise fail("features", f"feature {bad[0]} out of range (d_sae {min(d_sae)})")
    return SaeEntry(name, c, sites, features, {f: i for i, f in enumerate(features)},
                    _identity(name, c.path, version), version)


def _config_fail(key: str) -> Fail:
    return lambda sub, message: SteerConfigError(f"{key}{'.' + sub if sub == 'features' else ''}: {message}")


def slot_sites(cfg: SteerConfig | None, num_layers: int) -> dict[Site, int]:
    """``steer.sae_slots`` as sites -> capacity; SteerConfigError naming the key of a bad one (a
    site no config SAE holds, steerable, not pre_attn.0)."""
    if cfg is None or not cfg.sae_slots:
        return {}
    out: dict[Site, int] = {}
    for text, capacity in cfg.sae_slots.items():
        key = f"additional_config.steer.sae_slots.{text}"
        try:
            hook, layer = parse_site(text, key)
        except SaeFileError as e:
            raise SteerConfigError(f"{key}: {e.detail}") from None
        if not 0 <= layer < num_layers or hook not in cfg.hooks or (cfg.layers is not None and layer not in cfg.layers):
            raise SteerConfigError(f"{key}: not a steerable site (steer.hooks / steer.layers, {num_layers} layers)")
        if (hook, layer) == ("pre_attn", 0):
            raise SteerConfigError(f"{key}: pre_attn of layer 0 cannot take an SAE")
        if (hook, layer) in out:
            raise SteerConfigError(f"{key}: site {hook}.{layer} is named twice")
        out[(hook, layer)] = capacity
    return out


def sae_catalog(cfg: SteerConfig | None, hidden: int, num_layers: int) -> dict[str, SaeEntry]:
    """name -> entry of every configured SAE; raises SteerConfigError naming the key at fault
    (two SAEs may not share a site: their clamps would have no defined order; nor may an SAE take
    a site reserved in ``sae_slots``). A transcoder at post_attn.L and a residual SAE at post_attn.L do
    not share: the SAE edits the stream entering the norm, the transcoder the MLP's output after it."""
    if cfg is None or not cfg.sae:
        return {}
    out = {name: _entry(name, c, cfg, hidden, num_layers, _config_fail(f"additional_config.steer.sae.{name}"))
           for name, c in cfg.sae.items()}
    owner: dict[tuple[Site, bool], str] = {}
    for name, e in out.items():
        for site in e.sites:
            if (site, e.transcoder) in owner:
                what = "transcoder" if e.transcoder else "SAE"
                raise SteerConfigError(f"additional_config.steer.sae.{name}: site {site[0]}.{site[1]} already has "
                                       f"the {what} {owner[(site, e.transcoder)]!r}")
            owner[(site, e.transcoder)] = name
    for site in slot_sites(cfg, num_layers):
        if (site, False) in owner:
            raise SteerConfigError(f"additional_config.steer.sae_slots.{site[0]}.{site[1]}: the SAE "
                                   f"{owner[(site, False)]!r} is loaded there")
    return out


class SlotError(Exception):
    """A runtime SAE that cannot take its sites now (409: the sites are taken or still in use)."""


def runtime_entry(name: str, c: SaeModuleConfig, cfg: SteerConfig, hidden: int, num_layers: int,
                  slots: dict[Site, int], version: int) -> SaeEntry:
    """The entry of an SAE registered while the server runs, checked against its reserved slots;
    SteeringSpecError naming the registration's field (``path``, ``site``, ``features``, ...), or
    SaePathError (403) for a path outside ``steer.sae_root`` (``core.sae_paths``)."""
    def fail(sub: str, message: str) -> Exception:
        return SteeringSpecError(sub or "path", message)

    if c.reconstruct:
        raise fail("reconstruct", "an SAE registered at runtime clamps only (delta); reconstruct needs the whole "
                                  "SAE on every worker: load it at start-up (steer.sae)")
    entry = _entry(name, c, cfg, hidden, num_layers, fail, version, runtime_access(cfg.sae_root, cfg.max_sae_bytes))
    if entry.transcoder:
        raise fail("path", "a transcoder cannot be registered at runtime (sae_slots reserve residual SAE sites): "
                           "load it at start-up (steer.sae)")
    for (hook, layer), meta in entry.sites.items():
        if meta.activation == "topk":
            raise fail("path", f"site {hook}.{layer}: a TopK SAE needs every feature on the workers: load it at "
                               "start-up (steer.sae)")
        if (hook, layer) not in slots:
            raise fail("site", f"site {hook}.{layer} is not reserved for SAEs registered at runtime (reserved: "
                               f"{sorted(f'{h}.{l}' for h, l in slots)}; steer.sae_slots)")
        if len(entry.features) > slots[(hook, layer)]:
            raise fail("features", f"{len(entry.features)} clampable features, but site {hook}.{layer} holds "
                                   f"{slots[(hook, layer)]} (steer.sae_slots); list fewer features")
    return entry
