"""Front-end side of a request (API server / LLM process): validate, resolve, hash, pack, salt.

Runs once per request inside ``InputProcessor.process_inputs``, before the request reaches the
engine. Errors raise SteeringSpecError (a ValueError), which vLLM's OpenAI server answers with a
400 carrying the message; the engine never sees a bad request.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_steer.config import SteerConfig, steer_config_of
from vllm_steer.hashing import config_hash
from vllm_steer.payload import PAYLOAD_KEY, encode_payload
from vllm_steer.spec import (
    REQUEST_FIELDS,
    ModelShape,
    SteeringSpecError,
    Vectors,
    merge,
    nonzero,
    parse_spec,
    scaled,
)

logger = logging.getLogger("vllm_steer")


def _table_layout(vectors: Vectors) -> dict[str, tuple[list[int], np.ndarray]]:
    out = {}
    for hook, layers in vectors.items():
        ids = sorted(layers)
        out[hook] = (ids, np.stack([layers[i] for i in ids]))
    return out


class SteeringFrontend:
    """Turns the steering fields of a request into the engine payload."""

    def __init__(self, vllm_config: Any, module_lookup: Any = None) -> None:
        self.cfg: SteerConfig | None = steer_config_of(vllm_config)
        mc = vllm_config.model_config
        self.dtype = mc.dtype
        cfg = self.cfg
        self.shape = ModelShape(
            num_layers=mc.hf_text_config.num_hidden_layers,
            hidden_size=mc.get_hidden_size(),
            hooks=tuple(cfg.hooks) if cfg else (),
            layers=frozenset(cfg.layers) if cfg and cfg.layers is not None else None,
            max_bytes=cfg.max_request_bytes if cfg else 0,
        )
        self.module_lookup = module_lookup  # name -> Vectors per tier, or None

    def resolve(self, extra_args: dict[str, Any]) -> tuple[dict | None, str | None, str | None]:
        """(payload or None, prefill key, decode key) for a request's extra_args."""
        if PAYLOAD_KEY in extra_args:
            raise SteeringSpecError(PAYLOAD_KEY, "is reserved for vllm-steer's engine payload")
        fields = {k: extra_args[k] for k in REQUEST_FIELDS if k in extra_args}
        if not any(v is not None for v in fields.values()):
            return None, None, None
        if self.cfg is None:
            raise SteeringSpecError(
                next(iter(fields)),
                "steering is disabled on this server (start it with "
                "--additional-config '{\"steer\": {}}')",
            )
        spec = parse_spec(fields, self.shape)
        base, pre, dec = (spec.tiers[f] for f in ("steering_vectors", "prefill_steering_vectors", "decode_steering_vectors"))
        if spec.module is not None:
            if self.module_lookup is None:
                raise SteeringSpecError("steering_module.name", f"unknown steering module {spec.module.name!r}")
            m_base, m_pre, m_dec = self.module_lookup(spec.module.name)
            s = spec.module.scale
            base = merge(scaled(m_base, s), base)
            pre = merge(scaled(m_pre, s), pre)
            dec = merge(scaled(m_dec, s), dec)
        prefill = nonzero(merge(base, pre))
        decode = nonzero(merge(base, dec))
        pk, dk = config_hash(prefill), config_hash(decode)
        configs = {}
        for key, vecs in ((pk, prefill), (dk, decode)):
            if key is not None and key not in configs:
                configs[key] = _table_layout(vecs)
        if not configs:
            return None, None, None
        return encode_payload(pk, dk, configs, self.dtype), pk, dk

    def prepare(self, engine_request: Any) -> None:
        """Rewrite an EngineCoreRequest in place: payload into extra_args, prefill key into salt."""
        sp = engine_request.sampling_params
        if sp is None or not sp.extra_args:
            return
        payload, pk, dk = self.resolve(sp.extra_args)
        extra = {k: v for k, v in sp.extra_args.items() if k not in REQUEST_FIELDS}
        if payload is not None:
            extra[PAYLOAD_KEY] = payload
        sp.extra_args = extra or None
        if pk is not None:
            salt = f"vllm-steer:{pk}"
            engine_request.cache_salt = f"{engine_request.cache_salt}|{salt}" if engine_request.cache_salt else salt
        if payload is not None:
            logger.info(
                "vllm-steer: request %s steering prefill=%s decode=%s",
                engine_request.request_id, pk, dk,
            )


def patch_input_processor() -> None:
    """Patch: ``vllm.v1.engine.input_processor.InputProcessor.process_inputs`` (0.26).
    Why: it is where every request (LLM and OpenAI server alike) becomes an EngineCoreRequest,
    before the engine computes block hashes from its cache_salt. Remove if vLLM grows a hook."""
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor.process_inputs, "_vllm_steer", False):
        return
    original = InputProcessor.process_inputs

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        frontend = self.__dict__.get("_steer_frontend")
        if frontend is None:
            frontend = self._steer_frontend = SteeringFrontend(self.vllm_config)
        frontend.prepare(request)
        return request

    process_inputs._vllm_steer = True  # type: ignore[attr-defined]
    InputProcessor.process_inputs = process_inputs
