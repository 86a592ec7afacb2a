"""Requests whose steering was prepared before they reached the engine, handed over by token.

The OpenAI request middleware (server.request_body) and the ``AsyncLLM.add_request`` patch
(frontend.prepare_async) validate and resolve a request's steering fields in a small thread pool,
off the event loop, then replace those fields in ``extra_args`` by one token (``vllm_steer_prepared``):
a short string that survives vLLM's deep copies of the params. ``process_inputs`` looks the prepared
payload up by that token. Tokens are unguessable and live only while their request is being added;
a token that is not live is refused like any reserved field.
"""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

from msgspec.structs import replace

from vllm_steer.core.payload import PAYLOAD_KEY, ROWS_KEY, SteerPayload, encode_split
from vllm_steer.core.vectors import REQUEST_FIELDS
from vllm_steer.frontend.sae_registry import REGISTRY

TOKEN_FIELD = "vllm_steer_prepared"
_OURS = frozenset((*REQUEST_FIELDS, TOKEN_FIELD, ROWS_KEY))  # what ``for_request`` never passes on from the caller


class Prepared(NamedTuple):
    """A request's steering, prepared: its payload (None: unsteered), the extra_args that go to the engine
    (the caller's others; ``for_request`` adds the encoded payload) and the keys of its two phases."""

    payload: SteerPayload | None
    extra_args: dict | None
    prefill_key: str | None
    decode_key: str | None
    report: dict | None = None  # what the response says was applied (frontend.applied_report)

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The preparation pool (base64, numpy and BLAKE3 release the GIL on large buffers)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="vllm-steer-prepare")
        return _POOL


class PreparedRequests:
    def __init__(self) -> None:
        self._by_token: dict[str, Prepared] = {}

    def put(self, prepared: Prepared) -> str:
        """A token for ``prepared``; SteeringSpecError if a runtime SAE it names went away meanwhile
        (checked here, on the event loop, where SAEs are registered and deleted)."""
        REGISTRY.check_current(prepared.payload)
        token = secrets.token_hex(16)
        self._by_token[token] = prepared
        return token

    def get(self, token: Any) -> Prepared | None:
        return self._by_token.get(token) if isinstance(token, str) else None

    def drop(self, token: str) -> None:
        self._by_token.pop(token, None)

    def payloads(self) -> list[SteerPayload]:
        """The engine payloads of the requests being added now."""
        return [p.payload for p in list(self._by_token.values()) if p.payload is not None]

    def __len__(self) -> int:
        return len(self._by_token)


PREPARED = PreparedRequests()


def for_request(prepared: Prepared, extra_args: dict, request_id: str,
                reply: Callable[[], str] | None = None) -> Prepared:
    """The prepared result for one engine request: the caller's other extra_args kept, the
    request's id in a capturing payload (one HTTP request may become several engine requests;
    vLLM suffixes the id later, and consumers report both) with where its results go (``reply()``:
    this process's capture inbox, asked only for a capturing request), and the payload encoded once:
    the bytes the engine core and the workers decode, its large rows beside it (``core.payload.encode_split``)."""
    merged = {k: v for k, v in extra_args.items() if k not in _OURS}
    merged.update(prepared.extra_args or {})
    payload = prepared.payload
    if payload is not None:
        if payload.capture is not None:
            payload = replace(payload, external_id=request_id, capture_reply=reply() if reply is not None else None)
        merged[PAYLOAD_KEY], side = encode_split(payload)
        if side is not None:
            merged[ROWS_KEY] = side
    return Prepared(payload, merged or None, prepared.prefill_key, prepared.decode_key, prepared.report)
