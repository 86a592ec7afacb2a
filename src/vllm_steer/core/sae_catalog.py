"""The SAEs a server was started with (``steer.sae``), checked against the model: for each name, its
sites, its clampable features and their slots, whether it may reconstruct. The API process builds it
from file headers only (to validate requests); every worker builds the same one before loading the
weights of its sites, so both agree on slots and sites."""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_steer.core.config import MAX_CLAMPABLE, SaeModuleConfig, SteerConfig, SteerConfigError
from vllm_steer.core.sae_files import SaeFileError, SaeMeta, read_sae_meta

Site = tuple[str, int]


@dataclass(frozen=True)
class SaeEntry:
    name: str
    config: SaeModuleConfig
    sites: dict[Site, SaeMeta]
    features: tuple[int, ...]  # clampable feature ids, in slot order
    slot_of: dict[int, int]  # feature id -> slot
    identity: str  # changes when the files do (hashed into config keys)

    @property
    def full(self) -> bool:
        """Whether the workers keep the whole SAE (reconstruct allowed, or TopK needs every feature)."""
        return self.config.reconstruct or any(m.activation == "topk" for m in self.sites.values())


def _identity(name: str, path: str) -> str:
    stats = [os.stat(path)]
    if os.path.isdir(path):
        stats += [os.stat(os.path.join(path, f)) for f in sorted(os.listdir(path))]
    return f"{name}\0{os.path.abspath(path)}\0" + ",".join(f"{s.st_size}:{s.st_mtime_ns}" for s in stats)


def _entry(name: str, c: SaeModuleConfig, cfg: SteerConfig, hidden: int, num_layers: int) -> SaeEntry:
    key = f"additional_config.steer.sae.{name}"
    try:
        sites = read_sae_meta(c.path, c.format, c.site)
    except (SaeFileError, OSError) as e:
        raise SteerConfigError(f"{key}: {e}") from None
    for (hook, layer), meta in sites.items():
        where = f"{key}: site {hook}.{layer}"
        if meta.d_model != hidden:
            raise SteerConfigError(f"{where}: d_model {meta.d_model} != the model's hidden size {hidden}")
        if not 0 <= layer < num_layers:
            raise SteerConfigError(f"{where}: the model has {num_layers} layers")
        if hook not in cfg.hooks or (cfg.layers is not None and layer not in cfg.layers):
            raise SteerConfigError(f"{where} is not a steerable site (steer.hooks / steer.layers)")
        if (hook, layer) == ("pre_attn", 0):
            raise SteerConfigError(f"{where}: pre_attn of layer 0 cannot take an SAE (use post_attn.0 or later)")
    d_sae = {m.d_sae for m in sites.values()}
    features = c.features
    if features is None:
        if max(d_sae) > MAX_CLAMPABLE:
            raise SteerConfigError(f"{key}.features: d_sae is {max(d_sae)}; list the features requests may clamp "
                                   f"(at most {MAX_CLAMPABLE})")
        features = tuple(range(max(d_sae)))
    if len(features) > MAX_CLAMPABLE:
        raise SteerConfigError(f"{key}.features: {len(features)} features, at most {MAX_CLAMPABLE}")
    bad = [f for f in features if f >= min(d_sae)]
    if bad:
        raise SteerConfigError(f"{key}.features: feature {bad[0]} out of range (d_sae {min(d_sae)})")
    return SaeEntry(name, c, sites, features, {f: i for i, f in enumerate(features)}, _identity(name, c.path))


def sae_catalog(cfg: SteerConfig | None, hidden: int, num_layers: int) -> dict[str, SaeEntry]:
    """name -> entry of every configured SAE; raises SteerConfigError naming the key at fault
    (two SAEs may not share a site: their clamps would have no defined order)."""
    if cfg is None or not cfg.sae:
        return {}
    out = {name: _entry(name, c, cfg, hidden, num_layers) for name, c in cfg.sae.items()}
    owner: dict[Site, str] = {}
    for name, e in out.items():
        for site in e.sites:
            if site in owner:
                raise SteerConfigError(f"additional_config.steer.sae.{name}: site {site[0]}.{site[1]} already has "
                                       f"the SAE {owner[site]!r}")
            owner[site] = name
    return out
