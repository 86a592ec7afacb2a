"""``Client`` / ``AsyncClient``: typed HTTP access to a vllm-steer server's ``/v1/steering`` routes
and to steered completions, next to (not instead of) the ``openai`` client.

    from vllm_steer import Client
    c = Client("http://127.0.0.1:8000", api_key="...")      # api_key: steer.api_key / vLLM's --api-key
    c.register_module("joy", steering_vectors={"post_mlp": {14: vector}})
    out = c.complete("The weather today is", module={"name": "joy", "scale": 0.5}, max_tokens=16)
    c.delete_module("joy")

Vectors (``{hook: {layer: vector}}``, numpy / torch / lists) are packed with ``client.pack`` before
they are sent. Answers are typed (``client_types``: ``Status``, ``Module``, ``Sae``, ``Completion`` with
its ``steering`` report and ``.raw``, ...); a 2xx body that is not the documented shape raises
``msgspec.ValidationError`` (a ``ValueError``). Every non-2xx answer raises ``SteeringAPIError`` with the
server's status, message and ``param`` (the field at fault). ``AsyncClient`` has the same methods, as coroutines.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import numpy as np

from vllm_steer.client import pack
from vllm_steer.client_types import (
    Completion,
    Deleted,
    Module,
    ModuleList,
    Sae,
    SaeList,
    Status,
    decoded,
)
from vllm_steer.core.vectors import TIER_FIELDS

if TYPE_CHECKING:
    from vllm_steer.extract import Extraction


class SteeringAPIError(Exception):
    """A non-2xx answer: ``status``, ``message`` and ``param`` (vLLM's error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status} {f'{param}: ' if param else ''}{message}")
        self.status, self.message, self.param = status, message, param

    @property
    def detail(self) -> str:
        """The message led by the field at fault (the server's messages often start with it already)."""
        return self.message if not self.param or self.message.startswith(self.param) else f"{self.param}: {self.message}"


@dataclass
class _Call:
    method: str
    path: str
    kwargs: dict = field(default_factory=dict)
    post: Callable[[Any], Any] = lambda body: body


def _packed(vectors: dict) -> dict:
    """``{hook: {layer: vector}}`` -> ``{hook: packed}``; already-packed hooks pass as they are."""
    out = {}
    for hook, per_layer in vectors.items():
        if not isinstance(per_layer, dict) or "data" in per_layer:  # packed, or one site's vector
            out[hook] = per_layer if isinstance(per_layer, dict) else np.asarray(_numpy(per_layer), np.float32).tolist()
            continue
        layers = [int(l) for l in per_layer]
        out[hook] = pack(np.stack([np.asarray(_numpy(v), np.float32) for v in per_layer.values()]), layers)
    return out


def _numpy(v: Any) -> Any:
    return v.detach().cpu().float().numpy() if hasattr(v, "detach") else v


def _steering(tiers: dict, module: Any, capture: Any, sae: Any, condition: Any = None,
              projections: Any = None) -> dict:
    body = {name: _packed(v) for name, v in tiers.items() if v}
    if projections is not None:
        body["steering_projections"] = _projections(projections)
    if module is not None:
        body["steering_module"] = module
    if condition is not None:
        body["steering_condition"] = _condition(condition)
    if capture is not None:
        body["capture"] = capture
    if sae is not None:
        body["sae"] = sae
    return body


def _projections(spec: dict) -> dict:
    """``steering_projections`` ({hook: {layer: [op, ...]}} or {site: [op, ...]}) with numpy (or torch)
    directions packed as float32 bytes in base64; other values as given."""
    def op(o: dict) -> dict:
        d = o.get("direction")
        return {**o, "direction": _float32_packed(d)} if hasattr(d, "tolist") else dict(o)

    return {key: ({str(layer): [op(o) for o in ops] for layer, ops in val.items()} if isinstance(val, dict)
                  else [op(o) for o in val]) for key, val in spec.items()}


def _condition(condition: dict) -> dict:
    """A ``steering_condition`` with a numpy (or torch) probe packed as float32 bytes in base64."""
    probe = condition.get("probe")
    return {**condition, "probe": _float32_packed(probe)} if hasattr(probe, "tolist") else dict(condition)


def _float32_packed(v: Any) -> dict:
    """A numpy (or torch) vector as the packed float32 form requests take (base64 bytes)."""
    raw = np.ascontiguousarray(_numpy(v), dtype=np.float32)
    return {"dtype": "float32", "data": base64.b64encode(raw.tobytes()).decode("ascii")}


def _as(kind: type) -> Callable[[Any], Any]:
    return lambda body: decoded(body, kind)


def _raise_for(status: int, body: Any, text: str) -> None:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        raise SteeringAPIError(status, str(err.get("message")), err.get("param"))
    raise SteeringAPIError(status, text[:500])


class _Routes:
    """The requests, built once for both clients; ``_send`` runs them (sync or async)."""

    def __init__(self, base_url: str, api_key: str | None, model: str | None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _send(self, call: _Call) -> Any:
        raise NotImplementedError

    # -- steering state ---------------------------------------------------------------
    def status(self) -> Status:
        """``GET /v1/steering``: the plugin's ``version``, ``enabled``, the served ``model``'s sites (``num_layers``,
        ``hidden_size``, ``hooks``, ``dtype``), the ``config`` (the steer block) and each worker's view
        (``workers``: pid, ops, rows in use, capture counters). Modules and SAEs: ``modules()``, ``saes()``."""
        return self._send(_Call("GET", "/v1/steering", post=_as(Status)))

    # -- named modules ----------------------------------------------------------------
    def register_module(self, name: str, *, file: str | Path | tuple[str, bytes] | None = None,
                        description: str | None = None, replace: bool = False, condition: dict | None = None,
                        site_norms: dict | None = None, as_ablation: bool = False, **tiers: Any) -> Module:
        """Register from vectors (``steering_vectors=``, ``prefill_steering_vectors=``,
        ``decode_steering_vectors=``, and a ``condition`` for the requests naming it) or from a ``file``
        (.safetensors, .gguf, .json: a path, or ``(filename, bytes)``); ``site_norms``: typical residual
        norms per site (``{"post_mlp.14": 9.8}`` or a ``vllm-steer calibrate`` file's object) for its
        ``norm`` strengths; ``as_ablation``: its vectors become directions ablated at their sites. Its summary."""
        bad = set(tiers) - set(TIER_FIELDS)
        if bad:
            raise TypeError(f"unknown tier {sorted(bad)[0]!r}; expected some of {list(TIER_FIELDS)}")
        if file is not None:
            data = {"name": name, "replace": "true" if replace else "false",
                    **({"description": description} if description is not None else {}),
                    **({"site_norms": json.dumps(site_norms)} if site_norms is not None else {}),
                    **({"as_ablation": "true"} if as_ablation else {})}
            upload = file if isinstance(file, tuple) else (Path(file).name, Path(file).read_bytes())
            return self._send(_Call("POST", "/v1/steering/modules", {"data": data, "files": {"file": upload}},
                                    _as(Module)))
        body = {"name": name, "replace": replace, **_steering(tiers, None, None, None, condition),
                **({"description": description} if description is not None else {}),
                **({"site_norms": site_norms} if site_norms is not None else {}),
                **({"as_ablation": True} if as_ablation else {})}
        return self._send(_Call("POST", "/v1/steering/modules", {"json": body}, _as(Module)))

    def modules(self) -> list[Module]:
        """``GET /v1/steering/modules``: every registered module, with its ``in_flight`` requests."""
        return self._send(_Call("GET", "/v1/steering/modules", post=lambda b: decoded(b, ModuleList).data))

    def served_models(self) -> list[str]:
        """``GET /v1/models``: the ids of the models this server serves."""
        return self._send(_Call("GET", "/v1/models", post=lambda b: [m["id"] for m in b["data"]]))

    def module(self, name: str) -> Module:
        return self._send(_Call("GET", f"/v1/steering/modules/{name}", post=_as(Module)))

    def delete_module(self, name: str) -> Deleted:
        return self._send(_Call("DELETE", f"/v1/steering/modules/{name}", post=_as(Deleted)))

    # -- runtime SAEs -----------------------------------------------------------------
    def register_sae(self, name: str, path: str, *, site: str | None = None, features: list[int] | None = None,
                     replace: bool = False, **entry: Any) -> Sae:
        """``POST /v1/steering/sae``: a ``steer.sae`` entry (``path`` under the server's ``sae_root``)."""
        body = {"name": name, "path": path, "site": site, "features": features, "replace": replace, **entry}
        return self._send(_Call("POST", "/v1/steering/sae", {"json": {k: v for k, v in body.items() if v is not None}},
                                _as(Sae)))

    def saes(self) -> SaeList:
        """``GET /v1/steering/sae``: the SAEs requests may clamp (``data``) and the reserved sites (``slots``)."""
        return self._send(_Call("GET", "/v1/steering/sae", post=_as(SaeList)))

    def sae(self, name: str) -> Sae:
        return self._send(_Call("GET", f"/v1/steering/sae/{name}", post=_as(Sae)))

    def delete_sae(self, name: str) -> Deleted:
        return self._send(_Call("DELETE", f"/v1/steering/sae/{name}", post=_as(Deleted)))

    # -- steered generation -----------------------------------------------------------
    def complete(self, prompt: str | list[int], *, module: str | dict | None = None, capture: dict | None = None,
                 sae: dict | list | None = None, steering_vectors: dict | None = None,
                 prefill_steering_vectors: dict | None = None, decode_steering_vectors: dict | None = None,
                 condition: dict | None = None, projections: dict | None = None, **params: Any) -> Completion:
        """``POST /v1/completions`` with steering fields (``projections``: ``steering_projections``, numpy
        directions packed); ``params``: any OpenAI / vLLM completion parameter (``max_tokens``,
        ``temperature``, ...). The answer: ``.text``, ``.choices``, ``.usage``, ``.steering`` (what was applied),
        ``.capture`` (the driver consumers' results) and ``.raw`` (the whole JSON)."""
        tiers = {"steering_vectors": steering_vectors, "prefill_steering_vectors": prefill_steering_vectors,
                 "decode_steering_vectors": decode_steering_vectors}
        body = {**({"model": self.model} if self.model else {}), "prompt": prompt, **params,
                **_steering(tiers, module, capture, sae, condition, projections)}
        return self._send(_Call("POST", "/v1/completions", {"json": body}, _as(Completion)))

    def chat(self, messages: list[dict], *, module: str | dict | None = None, capture: dict | None = None,
             sae: dict | list | None = None, steering_vectors: dict | None = None, condition: dict | None = None,
             projections: dict | None = None, **params: Any) -> Completion:
        """``POST /v1/chat/completions`` with steering fields (as ``complete``); ``.text``: the first message's."""
        body = {**({"model": self.model} if self.model else {}), "messages": messages, **params,
                **_steering({"steering_vectors": steering_vectors}, module, capture, sae, condition, projections)}
        return self._send(_Call("POST", "/v1/chat/completions", {"json": body}, _as(Completion)))


class Client(_Routes):
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0) -> None:
        import httpx

        super().__init__(base_url, api_key, model)
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def _send(self, call: _Call) -> Any:
        r = self.http.request(call.method, call.path, **call.kwargs)
        return _answer(r, call)

    def extract(self, pairs: Any, **kwargs: Any) -> Extraction:
        """``vllm_steer.extract`` against this server (its ``activations`` consumer)."""
        from vllm_steer.extract import extract

        return extract(self.base_url, pairs, model=self.model, api_key=self.api_key, **kwargs)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient(_Routes):
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0) -> None:
        import httpx

        super().__init__(base_url, api_key, model)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout)

    async def _send(self, call: _Call) -> Any:
        r = await self.http.request(call.method, call.path, **call.kwargs)
        return _answer(r, call)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def _answer(r: Any, call: _Call) -> Any:
    try:
        body = r.json()
    except ValueError:
        body = None
    if not 200 <= r.status_code < 300:
        _raise_for(r.status_code, body, r.text)
    if body is None:
        raise msgspec.ValidationError(f"expected a JSON body, got {r.text[:80]!r}")
    return call.post(body)
