"""The SAEs a server knows, checked against the model: for each name, its sites, its clampable
features and their slots, whether it may reconstruct. Those of ``steer.sae`` are built at start-up by
the API process from file headers only (to validate requests) and by every worker before loading the
weights of its sites, so both agree on slots and sites. Those registered at runtime take sites that
``steer.sae_slots`` reserved (``runtime_entry``): a clamp-only region, which may share its site with start-up
clamp-only SAEs, or a full reservation (TopK, reconstruct), alone at its site. Several SAEs at one site form one
pack (``site_regions``)."""

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
        for f in sorted(os.listdir(path)):
            stats.append(os.stat(os.path.join(path, f)))
            if os.path.isdir(os.path.join(path, f)):  # a sparsify checkpoint root: a folder per hookpoint
                stats += [os.stat(os.path.join(path, f, g)) for g in sorted(os.listdir(os.path.join(path, f)))]
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


@dataclass(frozen=True)
class Slot:
    """A site's reservation for a runtime SAE (``steer.sae_slots``): ``features`` clampable ones; ``d_sae`` > 0: a
    full one (the whole SAE staged, up to ``d_sae`` features; TopK of ``k`` only, or ReLU / JumpReLU when 0;
    ``reconstruct`` allowed or not), alone at its site; 0: a clamp-only region of the site's pack."""

    features: int
    d_sae: int = 0
    k: int = 0
    reconstruct: bool = False

    @property
    def full(self) -> bool:
        return self.d_sae > 0

    def describe(self) -> str:
        if not self.full:
            return f"{self.features} clampable features, ReLU / JumpReLU, delta only"
        arch = f"TopK k={self.k}" if self.k else "ReLU / JumpReLU"
        return (f"{self.features} clampable features of at most d_sae {self.d_sae}, {arch}, "
                f"{'delta or reconstruct' if self.reconstruct else 'delta only'}")


def slot_sites(cfg: SteerConfig | None, num_layers: int) -> dict[Site, Slot]:
    """``steer.sae_slots`` as sites -> reservation; SteerConfigError naming the key of a bad one (a
    site no config SAE holds, steerable, not pre_attn.0)."""
    if cfg is None or not cfg.sae_slots:
        return {}
    out: dict[Site, Slot] = {}
    for text, raw in cfg.sae_slots.items():
        slot = Slot(raw) if isinstance(raw, int) else Slot(raw.features, raw.d_sae, raw.k, raw.reconstruct)
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
        out[(hook, layer)] = slot
    return out


def sae_catalog(cfg: SteerConfig | None, hidden: int, num_layers: int) -> dict[str, SaeEntry]:
    """name -> entry of every configured SAE; raises SteerConfigError naming the key at fault. Several
    clamp-only SAEs (and a ``sae_slots`` reservation) may share a site (``site_regions``: their encoders all
    read the same stream, their edits add); a full one (TopK, or reconstruct) holds its site alone. A
    transcoder at post_attn.L and a residual SAE at post_attn.L have a pack each: the SAE edits the stream
    entering the norm, the transcoder the MLP's output after it."""
    if cfg is None or not cfg.sae:
        return {}
    out = {name: _entry(name, c, cfg, hidden, num_layers, _config_fail(f"additional_config.steer.sae.{name}"))
           for name, c in cfg.sae.items()}
    owners: dict[tuple[Site, bool], list[str]] = {}
    for name, e in out.items():
        for site in e.sites:
            there = owners.setdefault((site, e.transcoder), [])
            full = next((n for n in there + [name] if out[n].full), None)
            if there and full is not None:
                what = "transcoder" if e.transcoder else "SAE"
                raise SteerConfigError(f"additional_config.steer.sae.{name}: site {site[0]}.{site[1]} already has "
                                       f"the {what} {there[0]!r}, and {full!r} is a full {what} (TopK or "
                                       "reconstruct), which holds its site alone")
            there.append(name)
    for site, slot in slot_sites(cfg, num_layers).items():
        key = f"additional_config.steer.sae_slots.{site[0]}.{site[1]}"
        full = next((n for n in owners.get((site, False), []) if out[n].full), None)
        if full is not None:
            raise SteerConfigError(f"{key}: the SAE {full!r} loaded there is a full SAE (TopK or reconstruct), "
                                   "which holds its site alone")
        if slot.full and owners.get((site, False)):
            raise SteerConfigError(f"{key}: a full reservation (d_sae) holds its site alone, and the SAE "
                                   f"{owners[(site, False)][0]!r} is loaded there")
    return out


@dataclass(frozen=True)
class Region:
    """A part of a site's pack (kernels/sae_clamp/packed.py): the clamp slots ``[offset, offset + size)``
    belong to the SAE ``name`` (None: the ``sae_slots`` reservation, for the runtime SAE registered there)."""

    name: str | None
    offset: int
    size: int


def site_regions(catalog: dict[str, SaeEntry], slots: dict[Site, Slot]) -> dict[tuple[Site, bool], list[Region]]:
    """Per (site, transcoder?) the regions of its one pack: the start-up SAEs there in config order, then the
    reserved region of a runtime SAE. A request's wire slots are each SAE's own (``slot_of``); the workers add
    the region's offset. One pack per site keeps the norm's one clamp walk (CPU and Triton alike): the clamps
    of every SAE at the site read the same stream and their edits add (``README`` "Several SAEs at one site")."""
    out: dict[tuple[Site, bool], list[Region]] = {}
    for name, e in catalog.items():
        for site in e.sites:
            there = out.setdefault((site, e.transcoder), [])
            there.append(Region(name, sum(r.size for r in there), len(e.features)))
    for site, slot in slots.items():
        there = out.setdefault((site, False), [])
        there.append(Region(None, sum(r.size for r in there), slot.features))
    return out


class SlotError(Exception):
    """A runtime SAE that cannot take its sites now (409: the sites are taken or still in use)."""


def runtime_entry(name: str, c: SaeModuleConfig, cfg: SteerConfig, hidden: int, num_layers: int,
                  slots: dict[Site, Slot], version: int) -> SaeEntry:
    """The entry of an SAE registered while the server runs, checked against its reserved slots (a
    clamp-only one takes ReLU / JumpReLU SAEs for delta; a full one any architecture it was reserved for);
    SteeringSpecError naming the registration's field (``path``, ``site``, ``features``, ``reconstruct``),
    or SaePathError (403) for a path outside ``steer.sae_root`` (``core.sae_paths``)."""
    def fail(sub: str, message: str) -> Exception:
        return SteeringSpecError(sub or "path", message)

    entry = _entry(name, c, cfg, hidden, num_layers, fail, version, runtime_access(cfg.sae_root, cfg.max_sae_bytes))
    if entry.transcoder:
        raise fail("path", "a transcoder cannot be registered at runtime (sae_slots reserve residual SAE sites): "
                           "load it at start-up (steer.sae)")
    for (hook, layer), meta in entry.sites.items():
        where = f"site {hook}.{layer}"
        if (hook, layer) not in slots:
            raise fail("site", f"{where} is not reserved for SAEs registered at runtime (reserved: "
                               f"{sorted(f'{h}.{l}' for h, l in slots)}; steer.sae_slots)")
        slot = slots[(hook, layer)]
        held = f"{where} holds {slot.describe()} (steer.sae_slots)"
        if len(entry.features) > slot.features:
            raise fail("features", f"{len(entry.features)} clampable features, but {where} holds {slot.features} "
                                   "(steer.sae_slots); list fewer features")
        if c.reconstruct and not slot.reconstruct:
            raise fail("reconstruct", f"{held}: reconstruct needs a site reserved with d_sae and reconstruct: true")
        k = meta.k if meta.activation == "topk" else 0
        if not slot.full and k:
            raise fail("path", f"{held}: a TopK SAE needs a site reserved with d_sae and k (every feature ranks)")
        if slot.full and k != slot.k:
            raise fail("path", f"{held}; this SAE is {f'TopK k={k}' if k else meta.activation}")
        if slot.full and meta.d_sae > slot.d_sae:
            raise fail("path", f"{held}; this SAE has d_sae {meta.d_sae}")
    return entry
