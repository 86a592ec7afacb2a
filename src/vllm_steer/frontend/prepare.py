"""Front-end side of a request (API server / LLM process): validate, resolve, hash, pack, salt.

Runs once per request inside ``InputProcessor.process_inputs``, before the request reaches the
engine. Errors raise SteeringSpecError (a ValueError), which vLLM's OpenAI server answers with a
400 carrying the message; the engine never sees a bad request.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import threading
from typing import Any

from msgspec.structs import replace

from vllm_steer.capture.consumer import consumer_class, mergeable, response_waits
from vllm_steer.capture.spec import CaptureSpec, CaptureSpecError, parse_capture_spec, spec_params
from vllm_steer.frontend.capture_rows import row_cost
from vllm_steer.core.config import SteerConfig, steer_config_of
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.hooks import receiving_layer
from vllm_steer.core.speculative import drafting, refusal
from vllm_steer.core.layout import layout_key, table_layout
from vllm_steer.core.payload import PAYLOAD_KEY, ROWS_KEY, ModuleRef, SteerPayload, dtype_name
from vllm_steer.core.sae_catalog import SaeEntry, sae_catalog, slot_sites
from vllm_steer.core.sae_rows import SaeWire, sae_config_key
from vllm_steer.core.vectors import (CAPTURE_FIELD, CONDITION_FIELD, MODULE_FIELD, PROJECTION_FIELDS,
                                     REQUEST_FIELDS, SAE_FIELD, TIER_FIELDS, effective_phases, selected)
from vllm_steer.frontend import field_names, path_trace
from vllm_steer.frontend.condition_spec import check_sites, condition_key, parse_condition
from vllm_steer.frontend.applied_report import report
from vllm_steer.frontend.module_store import STORE
from vllm_steer.core.site_names import parse_site_name
from vllm_steer.frontend.projection_spec import ProjWire, parse_projections, projection_key
from vllm_steer.frontend.projection_spec import summary as projection_summary
from vllm_steer.frontend.prepared import PREPARED, TOKEN_FIELD, Prepared, for_request
from vllm_steer.frontend.sae_registry import REGISTRY as SAE_REGISTRY, SAE_SYNC
from vllm_steer.frontend.sae_spec import parse_sae
from vllm_steer.frontend.site_norms import normed_tiers, server_norms
from vllm_steer.frontend.spec import ModelShape, packed_fast_light, parse_packed_fast, parse_spec

_ALL_FIELDS = REQUEST_FIELDS + (PAYLOAD_KEY, ROWS_KEY, TOKEN_FIELD)
_PHASES = {"steering_vectors": (True, True), "prefill_steering_vectors": (True, False),
           "decode_steering_vectors": (False, True)}


class SteeringFrontend:
    """Turns the steering fields of a request into the engine payload."""

    def __init__(self, vllm_config: Any) -> None:
        self.cfg: SteerConfig | None = steer_config_of(vllm_config)
        mc = vllm_config.model_config
        self.dtype = dtype_name(mc.dtype)
        cfg = self.cfg
        self._module_cache: dict[tuple, tuple[dict, str | None, str | None]] = {}
        # the capture specs ``_capture`` parsed for the request this thread prepares: instance -> (raw, spec);
        # ``capture_rows`` takes a spec from here when its raw dict is the same object (no second parse)
        self._parsed = threading.local()
        # A consumer with a global spec captures every request: each needs a payload (its id).
        self.captures_all = bool(cfg and any(c.params.get("global_spec") for c in cfg.capture))
        self.shape = ModelShape(
            num_layers=mc.hf_text_config.num_hidden_layers,
            hidden_size=mc.get_hidden_size(),
            hooks=tuple(cfg.hooks) if cfg else (),
            layers=frozenset(cfg.layers) if cfg and cfg.layers is not None else None,
            max_bytes=cfg.max_request_bytes if cfg else 0,
            dtype=self.dtype,
            site_norms=server_norms(cfg, mc.hf_text_config.num_hidden_layers),
        )
        # Modules (registered or preloaded) are checked against their own byte cap.
        self.module_shape = dataclasses.replace(self.shape, max_bytes=cfg.max_module_bytes if cfg else 0)
        self.sae_config = sae_catalog(cfg, self.shape.hidden_size, self.shape.num_layers)
        self.sae_slots = slot_sites(cfg, self.shape.num_layers)
        self.drafting = drafting(vllm_config)  # speculative decoding: capture and stop_when refused (core.speculative)
        pp = getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1)
        self.pipeline_stages = pp
        self.stage_starts = [0]  # the first decoder layer of each pipeline stage
        if pp > 1:
            from vllm.distributed.utils import get_pp_indices

            self.stage_starts = [get_pp_indices(self.shape.num_layers, s, pp)[0] for s in range(pp)]

    @property
    def sae(self) -> dict[str, SaeEntry]:
        """Every SAE requests may name: those of ``steer.sae`` and those registered since."""
        return {**self.sae_config, **SAE_REGISTRY.entries} if SAE_REGISTRY.entries else self.sae_config

    def resolve(self, extra_args: dict[str, Any]) -> tuple[SteerPayload | None, str | None, str | None]:
        """(payload or None, prefill key, decode key) for a request's extra_args."""
        for reserved in (PAYLOAD_KEY, ROWS_KEY, TOKEN_FIELD):
            if reserved in extra_args:
                raise SteeringSpecError(reserved, "is reserved for vllm-steer's engine payload")
        fields = {k: extra_args[k] for k in REQUEST_FIELDS if k in extra_args}
        if not any(v is not None for v in fields.values()):
            if self.captures_all:
                return SteerPayload(capture={}), None, None
            return None, None, None
        if self.cfg is None:
            raise SteeringSpecError(
                next(iter(fields)),
                "steering is disabled on this server (start it with "
                "--additional-config '{\"steer\": {}}')",
            )
        capture = self._capture(fields.get(CAPTURE_FIELD))
        if capture is None and self.captures_all:
            capture = {}
        sae_raw = fields.pop(SAE_FIELD, None)
        cond_raw = fields.pop(CONDITION_FIELD, None)
        proj = parse_projections({f: fields.pop(f, None) for f in PROJECTION_FIELDS}, self.shape,
                                 self.cfg.max_projections, self._module_projections(fields.get(MODULE_FIELD)))
        if cond_raw is None and (carried := self._module_condition(fields.get(MODULE_FIELD))) is not None:
            try:  # the named module carries one (frontend.condition_spec.module_condition)
                return self._with_condition(carried, sae_raw, fields, capture, proj)
            except SteeringSpecError as e:
                if not e.field.startswith(CONDITION_FIELD):
                    raise
                raise SteeringSpecError(f"{MODULE_FIELD}.name", f"the module's {e.field} does not fit this "
                                                                f"request: {str(e).split(': ', 1)[-1]}") from None
        if cond_raw is not None:
            return self._with_condition(cond_raw, sae_raw, fields, capture, proj)
        out = self._vectors(fields, capture)
        if sae_raw is not None:
            catalog = self.sae
            pre_sae, dec_sae = parse_sae(sae_raw, catalog)
            out = self._with_sae(*out, pre_sae, dec_sae, catalog)
        return self._with_projections(*out, *proj)

    def _cached_module(self, ref: Any) -> tuple[SteerPayload, str | None, str | None] | None:
        """The payload of an earlier request naming the same module version, scale and selection (a bare
        reference depends on nothing else), or None."""
        module = STORE.get(ref.name)
        return self._module_cache.get((ref.name, module.version if module else None, ref.scale, ref.norm,
                                       ref.layers, ref.hooks))

    def cheap(self, fields: dict[str, Any], large: bool = False) -> bool:
        """Whether resolving ``fields`` is light work (server.request_body then prepares a small body on the
        event loop): everything but a named module whose rows would be built (no cached payload, inline
        vectors on top, or a condition, whose rows travel). ``large``: the body was large and its blocks came
        decoded (up to a few MB of them): light only on the packed fast path with nothing to convert (bytes in,
        bytes out; float32 blocks whose conversion is remembered)."""
        if large and not packed_fast_light(fields, self.shape):
            return False
        ref = fields.get(MODULE_FIELD)
        if ref is None:
            return True
        try:
            parsed = parse_spec({MODULE_FIELD: ref}, self.shape).module
        except SteeringSpecError:
            return True  # refused at once
        module = STORE.get(parsed.name)
        if module is None or not module.has_vectors:
            return True  # unknown (refused), or projections only: no rows
        if module.condition is not None or any(fields.get(f) is not None for f in (*TIER_FIELDS, CONDITION_FIELD)):
            return False
        return self._cached_module(parsed) is not None

    def _module_projections(self, ref: Any) -> tuple[dict, tuple | None, tuple | None] | None:
        """The projection fields of the module a request names, with the request's selection (None: none)."""
        if isinstance(ref, str):
            ref = {"name": ref}
        module = STORE.get(ref.get("name")) if isinstance(ref, dict) and isinstance(ref.get("name"), str) else None
        if module is None or not module.projections:
            return None
        sel = parse_spec({MODULE_FIELD: ref}, self.shape).module  # the selection, checked as _vectors will
        sites = [parse_site_name(site) for ops in projection_summary(module.projections).values() for site in ops]
        if not module.has_vectors and not any((sel.layers is None or l in sel.layers) and
                                              (sel.hooks is None or h in sel.hooks) for h, l in sites):
            raise SteeringSpecError("steering_module.layers" if sel.layers else "steering_module.hooks",
                                    f"the selection holds none of module {module.name!r}'s projections")
        return module.projections, sel.layers, sel.hooks

    @staticmethod
    def _module_condition(ref: Any) -> dict | None:
        module = STORE.get(ref.get("name")) if isinstance(ref, dict) and isinstance(ref.get("name"), str) else None
        return module.condition if module is not None else None

    def _with_sae(self, payload: SteerPayload | None, pk: str | None, dk: str | None, pre: list[SaeWire],
                  dec: list[SaeWire], catalog: dict[str, SaeEntry]) -> tuple[SteerPayload | None, str | None, str | None]:
        """The vector payload re-keyed with each phase's SAE clamps (which travel beside the rows)."""
        if not pre and not dec:
            return payload, pk, dk
        identity = {e[0]: catalog[e[0]].identity for e in pre + dec}
        kp = sae_config_key(pk, pre, identity)
        kd = kp if pk == dk and pre == dec else sae_config_key(dk, dec, identity)
        base = payload or SteerPayload()
        configs = _rekeyed_rows(base, ((kp, pk), (kd, dk)))
        sae = {k: entries for k, entries in ((kp, pre), (kd, dec)) if k is not None and entries}
        # the versions are checked when the request is handed over (frontend.prepared) and in the engine core
        versions = {name: catalog[name].version for name in identity if catalog[name].version}
        out = replace(base, prefill=kp, decode=kd, configs=configs, sae=sae, sae_versions=versions or None)
        return out, kp, kd

    @staticmethod
    def _with_projections(payload: SteerPayload | None, pk: str | None, dk: str | None, pre: list[ProjWire],
                          dec: list[ProjWire]) -> tuple[SteerPayload | None, str | None, str | None]:
        """The payload (vectors, clamps) re-keyed with each phase's projections (which travel beside the rows,
        as SAE clamps do): one key, one row for the phase's whole config."""
        if not pre and not dec:
            return payload, pk, dk
        kp = projection_key(pk, pre)
        kd = kp if pk == dk and pre == dec else projection_key(dk, dec)
        base = payload or SteerPayload()
        configs = _rekeyed_rows(base, ((kp, pk), (kd, dk)))
        renamed = [(old, new) for old, new in ((pk, kp), (dk, kd)) if old is not None]
        sae = _renamed(base.sae, renamed)
        projections = {k: entries for k, entries in ((kp, pre), (kd, dec)) if k is not None and entries}
        return replace(base, prefill=kp, decode=kd, configs=configs, sae=sae, projections=projections), kp, kd

    def _with_condition(self, raw: Any, sae_raw: Any, fields: dict[str, Any], capture: dict | None,
                        proj: tuple[list, list] = ([], [])) -> tuple[SteerPayload | None, str | None, str | None]:
        """The payload of a conditional request (``frontend.condition_spec``): its vector rows always
        travel (a module's too), with its SAE clamps if any, each gated phase re-keyed with the
        condition, which travels beside them."""
        if not self.cfg.conditions:
            raise SteeringSpecError(CONDITION_FIELD, "conditional steering is off on this server "
                                                     "(start it with steer.conditions: true)")
        if self.pipeline_stages > 1:
            raise SteeringSpecError(CONDITION_FIELD, "conditions are not served under pipeline parallelism "
                                                     "(the gate would have to cross stages)")
        wire, phase, stop = parse_condition(raw, self.shape, STORE)
        if stop is not None and self.drafting:
            raise SteeringSpecError(f"{CONDITION_FIELD}.stop_when", refusal("stop_when", self.drafting))
        payload, pk, dk = self._vectors(fields, capture, ship_rows=True)
        catalog = self.sae if sae_raw is not None else {}
        clamps = parse_sae(sae_raw, catalog)  # ([], []) without an sae field
        configs = payload.configs if payload is not None else {}
        gated = [phase in (name, "both") for name in ("prefill", "decode")]
        sites = {(hook, layer) for key, g in zip((pk, dk), gated) if g and key is not None
                 for hook, (layers, _) in configs[key].items() for layer in layers}
        clamp_sites = {(e[1], e[2]) for entries, g in zip(clamps, gated) if g for e in entries}
        proj_sites = {(e[0], e[1]) for entries, g in zip(proj, gated) if g for e in entries}
        sae_sites = set(self.sae_slots) | {site for e in self.sae.values() for site in e.sites}
        check_sites(wire, sites, clamp_sites, sae_sites, phase, proj_sites)
        if sae_raw is not None:  # the clamps first: the condition keys the phase's whole config
            payload, pk, dk = self._with_sae(payload, pk, dk, *clamps, catalog)
        payload, pk, dk = self._with_projections(payload, pk, dk, *proj)
        # each phase's key: the gated ones re-keyed with the condition, the other kept (pk may equal dk)
        npk, ndk = (condition_key(k, wire) if g and k is not None else k for k, g in zip((pk, dk), gated))
        renamed = [(old, new) for old, new in ((pk, npk), (dk, ndk)) if old is not None]
        payload = payload or SteerPayload()
        sae, projections = _renamed(payload.sae, renamed), _renamed(payload.projections, renamed)
        # stop_when: (above, tokens, whether the last prompt position's gate counts: prefill gated)
        out = replace(payload, prefill=npk, decode=ndk,
                      configs=_renamed(payload.configs, renamed),
                      condition={new: tuple(wire) for old, new in renamed if new != old}, sae=sae,
                      projections=projections,
                      stop_when=(*stop, phase == "both") if stop is not None else None)
        return out, npk, ndk

    def _vectors(self, fields: dict[str, Any], capture: dict | None,
                 ship_rows: bool = False) -> tuple[SteerPayload | None, str | None, str | None]:
        """(payload, prefill key, decode key) of the vector fields (and capture) of a request;
        ``ship_rows``: a module's rows travel too (the worker does not build them)."""
        fast = parse_packed_fast(fields, self.shape)
        if fast is not None:  # one tier, packed in the model dtype: bytes in, bytes out
            tier, layout, key = fast
            if key is None and capture is None:
                return None, None, None
            pre, dec = _PHASES[tier]
            pk, dk = (key if pre else None), (key if dec else None)
            configs = {key: layout} if key is not None else {}
            return SteerPayload(prefill=pk, decode=dk, configs=configs, capture=capture), pk, dk
        spec = parse_spec(fields, self.shape)
        if spec.module is not None and (named := STORE.get(spec.module.name)) is not None and not named.has_vectors:
            spec = dataclasses.replace(spec, module=None)  # projections only (``_module_projections``): no rows
        bare_module = spec.module is not None and not any(spec.tiers.values()) and not ship_rows
        # a ``norm`` strength is a factor per site: the front end builds those rows (workers know one scale)
        ship_rows = ship_rows or (spec.module is not None and spec.module.norm is not None)
        if bare_module:
            hit = self._cached_module(spec.module)
            if hit is not None:  # depends only on (name, version, scale, selection): reuse, no rehash
                payload, pk, dk = hit
                return (replace(payload, capture=capture) if capture is not None else payload), pk, dk
        module = None
        module_tiers = None
        scale = 1.0
        if spec.module is not None:
            module = STORE.get(spec.module.name)
            if module is None:
                raise SteeringSpecError("steering_module.name", f"unknown steering module {spec.module.name!r}")
            module_tiers, scale = selected(module.tiers, spec.module.layers, spec.module.hooks), spec.module.scale
            if not any(module_tiers.values()):
                raise SteeringSpecError("steering_module.layers" if spec.module.layers else "steering_module.hooks",
                                        f"the selection holds none of module {module.name!r}'s vectors "
                                        f"(hooks {module.summary()['hooks']}, layers {module.summary()['layers']})")
            if spec.module.norm is not None:
                module_tiers = normed_tiers(module_tiers, spec.module.norm, module, self.shape.site_norms)
        prefill, decode = effective_phases(spec.tiers, module_tiers, scale)
        try:
            layouts = {"prefill": table_layout(prefill, self.dtype)}
            layouts["decode"] = layouts["prefill"] if decode is prefill else table_layout(decode, self.dtype)
        except ValueError as e:
            raise SteeringSpecError(_overflow_field(fields, spec), str(e)) from None
        pk = layout_key(layouts["prefill"], self.dtype)
        dk = pk if decode is prefill else layout_key(layouts["decode"], self.dtype)
        if pk is None and dk is None and capture is None:
            return None, None, None
        ref = None
        if module is not None:
            ref = ModuleRef(module.name, module.version, scale,
                            **{k: tuple(v) for k, v in spec.module.selection().items()})
        configs = {}
        if module is None or any(spec.tiers.values()) or ship_rows:
            # Inline vectors (alone or on top of a module) travel; a bare module ref does not.
            for key, phase in ((pk, "prefill"), (dk, "decode")):
                if key is not None and key not in configs:
                    configs[key] = layouts[phase]
        payload = SteerPayload(prefill=pk, decode=dk, configs=configs, module=ref, capture=capture)
        if bare_module:
            if len(self._module_cache) > 1024:
                self._module_cache.clear()
            cached = replace(payload, capture=None) if capture is not None else payload
            self._module_cache[(module.name, module.version, scale, spec.module.norm, spec.module.layers,
                                spec.module.hooks)] = (cached, pk, dk)
        return payload, pk, dk

    def needs_whole_prompt(self, capture: dict) -> bool:
        """Whether a request's captures (its own and the consumers' global specs) read prompt
        positions before the last one, which a prefix-cache hit would skip."""
        specs = list(capture.values()) + [c.params["global_spec"] for c in self.cfg.capture
                                          if c.params.get("global_spec")]
        return any(s.get("positions", "all_prompt") not in ("all_generated", "last_prompt") for s in specs)

    # ---- capture registration: which results come back, from which pipeline stages ----------
    def stage_of(self, hook: str, layer: int) -> int:
        """The pipeline stage whose norm receives a site (vLLM's ``get_pp_indices`` partition)."""
        return bisect.bisect_right(self.stage_starts, receiving_layer(hook, layer)) - 1

    def _stages_of(self, spec: CaptureSpec) -> tuple[int, ...]:
        """The stages holding a spec's sites (those of ``steer.layers``: the sites workers hook)."""
        layers = self.shape.layers
        return tuple(sorted({self.stage_of(h, l) for h, l in spec.sites if layers is None or l in layers}))

    def _one_stage(self, field: str, name: str, spec: CaptureSpec) -> None:
        """A driver consumer without ``merge`` cannot join results of several pipeline stages: a spec
        whose sites span stages is refused (naming ``field``, the key that named its sites)."""
        first = {}
        for h, l in spec.sites:
            first.setdefault(self.stage_of(h, l), f"{h}.{l}")
        if len(first) > 1:
            (a, site_a), (b, site_b) = sorted(first.items())[:2]
            raise CaptureSpecError(
                f"{field}: consumer {name!r} cannot merge results of several pipeline stages (its class "
                f"defines no merge) and these sites span stages: {site_a} is on stage {a}, {site_b} on stage "
                f"{b}; ask it for one stage's sites (stage {b} starts at layer {self.stage_starts[b]}; "
                f"post_mlp.L is on the stage of layer L+1)")

    def _consumers(self) -> tuple[set[str], dict[str, Any], dict[str, CaptureSpec], set[str]]:
        """(driver instances, instance -> merge of those that merge, parsed global specs, instances
        with one), derived from the config once."""
        cached = self.__dict__.get("_consumer_info")
        if cached is None:
            cfgs = self.cfg.capture if self.cfg else ()
            classes = self._classes()
            drivers = {i for i, cls in classes.items() if cls.location == "driver"}
            merge = {i: classes[i].merge for i in drivers if mergeable(classes[i])}
            global_ = {c.instance_name: c.params["global_spec"] for c in cfgs if c.params.get("global_spec")}
            specs = {}
            for i, raw in global_.items():
                try:
                    specs[i] = parse_capture_spec(i, raw, self.shape.num_layers, self.shape.hooks)
                except ValueError:  # the workers refuse it when they start
                    pass
            cached = self._consumer_info = (drivers, merge, specs, set(global_))
        return cached

    def driver_instances(self, capture: dict) -> list[str]:
        """Driver consumer instances a request's captures run (its own and global specs'): those
        whose results come back."""
        drivers, _, _, global_ = self._consumers()
        return sorted(drivers & (set(capture) | global_))

    def capture_waits(self, capture: dict) -> bool:
        """Whether a request's response waits for its captures (``consumer.response_waits`` of each consumer it
        runs, own spec or global): a response naming no driver, whose every worker consumer says no (a filesystem
        spec's ``"wait": false``), ends with its last token; nothing is pushed back for it (no reply address)."""
        _, _, global_specs, global_ = self._consumers()
        classes = self._classes()
        for instance in set(capture) | global_:
            raw = capture.get(instance)
            if isinstance(raw, dict):  # the request's own spec replaces a global one
                params = spec_params(raw)
            else:
                params = dict(global_specs[instance].params) if instance in global_specs else {}
            if response_waits(classes[instance], params):
                return True
        return False

    def _classes(self) -> dict[str, type]:
        """instance -> consumer class, of this server's capture consumers."""
        cached = self.__dict__.get("_consumer_classes")
        if cached is None:
            cached = self._consumer_classes = {c.instance_name: consumer_class(c.name)
                                               for c in (self.cfg.capture if self.cfg else ())}
        return cached

    def capture_expectation(self, capture: dict, n: int, waits: bool | None = None) -> dict:
        """``ResultInbox.expect``'s arguments for a request's captures (``n`` engine requests): its driver
        instances and how many worker messages end it: one per engine request from TP rank 0 of every
        pipeline stage that holds a consumer of it, which is every stage when a worker consumer
        captures it (own or global spec), else the stages of the driver instances' sites (a driver
        hears of a request only where its sites are: ``runtime.capture.CaptureRuntime._runs_here``).
        Under pipeline parallelism also each driver instance's stages and the merge of those spanning
        several. ``waits``: ``capture_waits(capture)`` when the caller has it."""
        n = max(1, n)
        if not (self.capture_waits(capture) if waits is None else waits):  # complete at once: nothing awaited (or sent)
            return {"instances": [], "messages": 0}
        instances = self.driver_instances(capture)
        if self.pipeline_stages == 1:
            return {"instances": instances, "messages": n}
        drivers, merge, global_specs, global_ = self._consumers()
        stages = {}
        for i in instances:
            spec = (parse_capture_spec(i, capture[i], self.shape.num_layers, self.shape.hooks) if i in capture
                    else global_specs.get(i))
            if spec is not None and (here := self._stages_of(spec)):
                stages[i] = here
        workers = (set(capture) | global_) - drivers
        senders = (set(range(self.pipeline_stages)) if workers
                   else {s for here in stages.values() for s in here})
        return {"instances": sorted(stages), "messages": n * len(senders), "requests": n, "stages": stages,
                "merge": {i: merge[i] for i in stages if len(stages[i]) > 1 and i in merge}}

    def _capture(self, raw: Any) -> dict | None:
        """Validate a request's ``capture`` field (each consumer checks its own keys)."""
        if raw is None:
            return None
        if not isinstance(raw, dict) or not raw:
            raise SteeringSpecError(CAPTURE_FIELD, "expected {consumer_instance: spec}")
        if self.drafting:
            raise SteeringSpecError(CAPTURE_FIELD, refusal("capture", self.drafting))
        configured = {c.instance_name: c for c in self.cfg.capture}
        out, parsed = {}, {}
        self._parsed.specs = parsed
        for instance, spec_raw in raw.items():
            field = f"{CAPTURE_FIELD}.{instance}"
            if instance not in configured:
                raise SteeringSpecError(field, f"no capture consumer instance {instance!r} on this server "
                                               f"(configured: {sorted(configured)})")
            try:
                spec = parse_capture_spec(instance, spec_raw, self.shape.num_layers, self.shape.hooks)
                named_by = f"{field}.{'sites' if 'sites' in spec_raw else 'layers'}"
                bad = [l for _, l in spec.sites if self.shape.layers is not None and l not in self.shape.layers]
                if bad:
                    raise CaptureSpecError(f"{named_by}: layer {bad[0]} has no capture site (steer.layers)")
                cls = consumer_class(configured[instance].name)
                cls.validate_params(dict(spec.params))
                if self.pipeline_stages > 1 and cls.location == "driver" and not mergeable(cls):
                    self._one_stage(named_by, configured[instance].name, spec)
            except CaptureSpecError as e:
                raise SteeringSpecError(e.field, e.reason) from None
            except ValueError as e:
                raise SteeringSpecError(field, f"consumer {configured[instance].name!r}: {e}") from None
            out[instance] = spec_raw
            parsed[instance] = (spec_raw, spec)
        return out

    def _check_fits(self, extra_args: dict[str, Any], pk: str | None, dk: str | None) -> None:
        """A request whose prefill and decode configs differ needs two rows at once: refused (400)
        where the tables run one config at a time, instead of waiting for a row that never comes."""
        if pk and dk and pk != dk and self.cfg.usable_rows < 2:
            field = next((f for f in ("decode_steering_vectors", "prefill_steering_vectors", SAE_FIELD,
                                      *PROJECTION_FIELDS[::-1])
                          if extra_args.get(f) is not None), "steering_vectors")
            raise SteeringSpecError(field, (
                f"needs 2 steering rows at once (its prefill and decode configs differ), but this server runs "
                f"{self.cfg.usable_rows} config at a time (steer.max_configs = {self.cfg.max_configs}): send one "
                "config for both phases, or raise steer.max_configs"))

    def capture_rows(self, capture: dict) -> tuple[int, int, int] | None:
        """Pool rows one token of a request with these captures takes on a worker, per position class
        (``frontend.capture_rows``); None when it takes none. More than ``steer.capture_max_rows`` for one
        token: refused (400), since no chunking could fit it."""
        if not capture and "_global_rows" in self.__dict__:  # only the consumers' global specs: the same each time
            return self._global_rows
        _, _, global_specs, _ = self._consumers()
        classes = self._classes()
        specs = {i: s for i, s in global_specs.items() if i not in capture}  # a request's own spec replaces it
        parsed = getattr(self._parsed, "specs", {})
        for i, raw in capture.items():
            done = parsed.get(i)
            specs[i] = done[1] if done is not None and done[0] is raw else \
                parse_capture_spec(i, raw, self.shape.num_layers, self.shape.hooks)
        self._parsed.specs = {}
        cost = row_cost(((spec, classes[i]) for i, spec in specs.items()), self.stage_of, self.shape.layers)
        if capture and max(cost) > self.cfg.capture_max_rows:
            raise SteeringSpecError(CAPTURE_FIELD, (
                f"one token captures {max(cost)} (site, token) rows on a worker, more than steer.capture_max_rows "
                f"({self.cfg.capture_max_rows}) holds in a step: capture fewer sites, or raise steer.capture_max_rows"))
        out = cost if any(cost) else None
        if not capture:
            self._global_rows = out
        return out

    def engine_extra_args(self, extra_args: dict[str, Any]) -> Prepared:
        """The payload, the extra_args without the steering fields, and the keys;
        ``prepared.for_request`` then makes it one engine request's."""
        payload, pk, dk = self.resolve(extra_args)
        if payload is not None and payload.capture is not None:
            payload = replace(payload, capture_rows=self.capture_rows(payload.capture))
        if payload is not None:
            self._check_fits(extra_args, pk, dk)
        extra = {k: v for k, v in extra_args.items() if k not in REQUEST_FIELDS}
        said = report(extra_args, payload, STORE) if payload is not None and (pk or dk) else None
        return Prepared(payload, extra or None, pk, dk, said)


def _overflow_field(fields: dict[str, Any], spec: Any) -> str:
    """The field to name when the effective rows overflow the model's dtype."""
    if spec.module is not None and spec.module.norm is not None:
        return f"{MODULE_FIELD}.norm"
    if spec.module is not None and spec.module.scale != 1.0:
        return f"{MODULE_FIELD}.scale"
    return next((f for f in TIER_FIELDS if fields.get(f) is not None), MODULE_FIELD)


def _prepared(frontend: SteeringFrontend, extra: dict, request_id: str) -> Prepared:
    """The request's engine extra_args and keys: prepared off the event loop (a live token), or now; a
    capturing payload names this process's inbox."""
    from vllm_steer.capture.inbox import inbox

    prepared = PREPARED.get(extra[TOKEN_FIELD]) if TOKEN_FIELD in extra else None
    prepared = prepared or frontend.engine_extra_args(extra)
    capture = prepared.payload.capture if prepared.payload is not None else None
    waits = capture is not None and frontend.capture_waits(capture)  # else the workers push nothing back
    out = for_request(prepared, extra, request_id, (lambda: inbox().address) if waits else None)
    if SAE_SYNC.enabled and out.payload is not None:  # the last check before the engine core: moved since the last pull?
        SAE_REGISTRY.check_current(out.payload, SAE_SYNC.stale())
    return out


def salted(cache_salt: str | None, prefill_key: str) -> str:
    """The request's cache_salt with the prefill key folded in (a user salt is kept)."""
    salt = f"vllm-steer:{prefill_key}"
    return f"{cache_salt}|{salt}" if cache_salt else salt


_FRONTEND_LOCK = threading.Lock()


def frontend_of(input_processor: Any) -> SteeringFrontend:
    """The (lazily built, once) front end of an ``InputProcessor``; vLLM 0.27+ may call
    ``process_inputs`` from several threads."""
    frontend = input_processor.__dict__.get("_steer_frontend")
    if frontend is None:
        with _FRONTEND_LOCK:
            frontend = input_processor.__dict__.get("_steer_frontend")
            if frontend is None:
                frontend = input_processor._steer_frontend = SteeringFrontend(input_processor.vllm_config)
    return frontend


def patch_input_processor() -> None:
    """Patch: ``InputProcessor.process_inputs`` (see vllm_steer.patches): every request (LLM and
    OpenAI server alike) becomes an EngineCoreRequest there, before the engine computes block
    hashes from its cache_salt."""
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_steer.capture.inbox import inbox
    from vllm_steer.frontend.applied import record_applied, record_capture, steering_field
    from vllm_steer.frontend.applied_output import mark

    if getattr(InputProcessor.process_inputs, "_vllm_steer", False):
        return
    original = InputProcessor.process_inputs

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        keys = None
        captures = False
        extra = getattr(params, "extra_args", None)
        frontend = frontend_of(self)
        asks = bool(extra) and any(k in extra for k in _ALL_FIELDS)
        if extra:  # a misspelled steering key would be ignored (unsteered): refused, naming it
            field_names.check_extra_args(extra)
        if path_trace.ON and asks:
            path_trace.stamp(extra.get(TOKEN_FIELD), "process_inputs")
        if isinstance(params, SamplingParams) and (asks or frontend.captures_all):
            # Before vLLM clones the params (a deep copy on the LLM path): it then copies the
            # packed payload, not lists of floats. The caller's object is left untouched.
            ready = _prepared(frontend, extra or {}, request_id)
            params = copy.copy(params)
            params.extra_args = ready.extra_args
            keys = (ready.prefill_key, ready.decode_key)
            capture = ready.payload.capture if ready.payload is not None else None
            captures = capture is not None
            if captures:  # driver results come back to this process's inbox, not through the engine
                box = inbox()
                box.ttl = max(box.ttl, 2 * frontend.cfg.capture_result_timeout_s)
                expected = frontend.capture_expectation(capture, getattr(params, "n", 1) or 1,
                                                        waits=ready.payload.capture_reply is not None)
                box.expect(request_id, **expected)
            if captures and frontend.needs_whole_prompt(capture):
                # Cached prompt blocks are never recomputed, so their residuals would be missing.
                params.skip_reading_prefix_cache = True
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if keys is not None and (keys[0] or keys[1]):
            if keys[0]:
                request.cache_salt = salted(request.cache_salt, keys[0])
            record_applied(request.request_id, *keys, ready.report)
            mark(request.sampling_params, steering_field(*keys, ready.report))  # RequestOutput.steering
        if captures:
            record_capture(request_id, expected["instances"])
        if path_trace.ON and asks:
            path_trace.stamp(extra.get(TOKEN_FIELD), "engine_request")
        return request

    process_inputs._vllm_steer = True  # type: ignore[attr-defined]
    InputProcessor.process_inputs = process_inputs


def _rekeyed_rows(base: SteerPayload, renames: tuple) -> dict:
    """The shipped rows under each phase's new key ((new, old) pairs): an old key's rows, none for a phase that
    had no vectors (clamps or projections only), and nothing for a bare module reference (its worker builds them)."""
    configs: dict = {}
    for new, old in renames:
        if new is None:
            continue
        if old is None:
            configs[new] = {}
        elif old in base.configs:
            configs[new] = base.configs[old]
    return configs


def _renamed(by_key: dict | None, renamed: list) -> dict | None:
    """``by_key`` (configs, SAE clamps, projections: each keyed by config key) under the new keys of the
    (old, new) pairs ``renamed``; None / empty stays as it is."""
    return {new: by_key[old] for old, new in renamed if old in by_key} if by_key else by_key
