"""Steering fields of OpenAI request bodies are validated and prepared before the response starts.

A pure ASGI middleware on /v1/completions and /v1/chat/completions. For a body that carries steering
fields (top level or inside ``vllm_xargs``), it decodes the body, takes the fields out and runs
the front end (validate, resolve modules and tiers, hash, pack) on the event loop where that costs less
than a hop (``_prepare_request``), else in the preparation pool, awaited before vLLM's handler sees the
request: a bad field is a 400 naming it, in streaming and non-streaming mode alike, before any byte of a
response. The handler then parses a body without
the vectors (megabytes of base64 never go through vLLM's JSON parse on the event loop), carrying a
token that hands the prepared payload to ``process_inputs`` (frontend.prepared).

Bodies may also be msgpack (``Content-Type: application/msgpack``): the same object as the JSON
body, where a packed vector's ``data`` is a msgpack bin of the raw little-endian rows instead of
base64. A key that looks like a steering field but is not one is a 400 with a "did you mean"
(``field_names``). Bodies without steering fields pass through untouched. With steering on, a body larger than
``steer.max_body_bytes`` is a 413 before it is read further (declared length first, then as it arrives).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any

import msgspec

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.payload import PAYLOAD_KEY, ROWS_KEY
from vllm_steer.server.metrics import PREPARE_SECONDS, count_rejected, count_request
from vllm_steer.core.vectors import REQUEST_FIELDS
from vllm_steer.frontend import path_trace
from vllm_steer.frontend.module_store import MODULE_SYNC
from vllm_steer.frontend.sae_registry import SAE_SYNC
from vllm_steer.frontend.prepared import PREPARED, TOKEN_FIELD, pool
from vllm_steer.server import base64_lift
from vllm_steer.server.errors import error_response
from vllm_steer.frontend import field_names
from vllm_steer.server.openai_fields import steering_fields

logger = logging.getLogger("vllm.steer")

PATHS = ("/v1/completions", "/v1/chat/completions")
MSGPACK_TYPES = (b"application/msgpack", b"application/x-msgpack", b"application/vnd.msgpack")
_RESERVED = (TOKEN_FIELD, PAYLOAD_KEY, ROWS_KEY)  # keys only vllm-steer writes into extra_args
# a steering field's key anywhere in the raw body, or '"vllm_steer' (the prefix of every reserved key), found in one
# pass: `any(marker in body)` over the eleven markers scanned a body without the first one eleven times (a 700 KB
# projection request: 1.7 ms of the API process's 2.9, s29)
_MARKERS = re.compile(b'"(?:' + b"|".join(re.escape(k.encode()) for k in REQUEST_FIELDS) + b')"|"vllm_steer')
_MODULE_MARKER = b"steering_module"  # JSON or msgpack: the key's bytes appear either way
_SAE_MARKER = b"sae"
_JSON_DECODER = msgspec.json.Decoder()
INLINE_BYTES = 64 * 1024  # bodies up to this size may be prepared on the event loop (``_prepare_request``)
# ... and bodies up to this size that shrink to INLINE_BYTES without their vectors (JSON: once lifted; msgpack: outside
# the top-level steering fields, whose packed blocks are bins already): an 8b model's three hooks in float32 are 2.1 MB
# of JSON (s33: the same float32 body again, a wave of 16 in the API process 70.8 -> 18.1 ms, CPU box)
INLINE_LIFTED_BYTES = 4 * 1024 * 1024
_NOT_TRIED = object()  # ``_decode``'s ``lifted``: the lift is still to be tried
_MSGPACK_DECODER = msgspec.msgpack.Decoder()
# a msgpack body's top level, each value left undecoded (a bin is skipped by its length: ~1 us for 1 MB of vectors)
_MSGPACK_TOP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def _decode(body: bytes, msgpack: bool, lifted: Any = _NOT_TRIED) -> dict | None:
    """The body as a dict; None for a JSON body this cannot read (vLLM reports its own error). A large JSON
    body's packed vector blocks come out as bytes, decoded from the body's own base64 (``base64_lift``;
    ``lifted``: its result when the caller tried it already)."""
    if lifted is _NOT_TRIED:
        lifted = base64_lift.lift(body) if not msgpack and len(body) >= base64_lift.MIN_CHARS else None
    if lifted is not None:
        obj = _decode_plain(lifted[0], False)
        if obj is not None and base64_lift.restore(obj, lifted[1]):
            return obj
    return _decode_plain(body, msgpack)


def _decode_plain(body: bytes, msgpack: bool) -> dict | None:
    try:
        obj = (_MSGPACK_DECODER if msgpack else _JSON_DECODER).decode(body)
    except (msgspec.DecodeError, RecursionError, ValueError):
        if msgpack:
            raise SteeringSpecError("body", "invalid msgpack") from None
        try:  # vLLM's own parser (the stdlib's) also reads NaN / Infinity literals: so must we
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
    if not isinstance(obj, dict):
        if msgpack:
            raise SteeringSpecError("body", "expected a msgpack map")
        return None
    return obj


def _fields(body: bytes, msgpack: bool, lifted: Any = _NOT_TRIED) -> tuple[dict | None, dict]:
    """(the decoded body, or None to pass it through untouched; its steering fields, taken out of it)."""
    obj = _decode(body, msgpack, lifted)
    if obj is None:
        return None, {}
    xargs = obj.get("vllm_xargs")
    for key in _RESERVED:
        if key in obj or (isinstance(xargs, dict) and key in xargs):
            raise SteeringSpecError(key, "is reserved for vllm-steer's engine payload")
    field_names.check(obj)  # a misspelled steering field is a 400, not a silent 200 unsteered
    return obj, steering_fields(obj)


def _prepare_fields(frontend: Any, fields: dict, trace: Any = None) -> Any:
    """The front end's one pass over a request's steering fields: the prepared payload."""
    if trace is not None:
        trace.stamp("prepare_start")
    with PREPARE_SECONDS.time():
        prepared = frontend.engine_extra_args(fields)
    count_request(fields)
    if trace is not None:
        trace.stamp("prepare_end")
    return prepared


def _prepare(frontend: Any, body: bytes, msgpack: bool, trace: Any = None,
             lifted: Any = _NOT_TRIED) -> tuple[dict | None, Any]:
    """In the pool: (the body without steering fields, or None to pass it through; prepared)."""
    obj, fields = _fields(body, msgpack, lifted)
    if obj is None or not fields:
        return (obj if msgpack else None), None
    return obj, _prepare_fields(frontend, fields, trace)


def _msgpack_rest(body: bytes) -> int | None:
    """The bytes of a msgpack body outside its top-level steering fields (None: not a map with string keys)."""
    try:
        top = _MSGPACK_TOP.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return sum(len(v) for k, v in top.items() if k not in REQUEST_FIELDS)


async def _prepare_request(frontend: Any, body: bytes, msgpack: bool, trace: Any) -> tuple[dict | None, Any]:
    """``_prepare``, on the event loop where that is cheaper than a hop to the pool and back: a small
    body (or a body up to INLINE_LIFTED_BYTES that is small without its vectors: a JSON body once its base64
    blocks are lifted, a msgpack body outside its top-level steering fields) whose fields the front end resolves
    without heavy work (``SteeringFrontend.cheap``). Each hop waits for the GIL twice behind whatever the loop and
    the other threads run (up to the 5 ms switch interval each time) and costs ~0.2 ms of CPU; a module reference
    costs ~20 us to prepare, a 1 MB packed body ~0.5 ms."""
    loop = asyncio.get_running_loop()
    lifted = _NOT_TRIED
    large = len(body) > INLINE_BYTES
    if large:
        small_rest = False
        if len(body) <= INLINE_LIFTED_BYTES:
            if msgpack:
                rest = _msgpack_rest(body)
                small_rest = rest is not None and rest <= INLINE_BYTES
            else:
                lifted = base64_lift.lift(body)
                small_rest = lifted is not None and len(lifted[0]) <= INLINE_BYTES
        if not small_rest:
            return await loop.run_in_executor(pool(), _prepare, frontend, body, msgpack, trace, lifted)
    obj, fields = _fields(body, msgpack, lifted)
    if obj is None or not fields:
        return (obj if msgpack else None), None
    if frontend is not None and not frontend.cheap(fields, large=large):
        return obj, await loop.run_in_executor(pool(), _prepare_fields, frontend, fields, trace)
    return obj, _prepare_fields(frontend, fields, trace)


class BodyTooLarge(Exception):
    def __init__(self, whole: bool = False) -> None:
        super().__init__()
        self.whole = whole  # the body's last message was read: nothing is left to drain


async def _read_body(receive: Any, cap: int | None) -> tuple[bytes, bool]:
    """The whole request body, and whether the client went away; BodyTooLarge past ``cap``
    bytes (what was read so far is dropped)."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunk = message.get("body", b"")
        size += len(chunk)
        if cap is not None and size > cap:
            raise BodyTooLarge(whole=not message.get("more_body"))
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks), False


DRAIN_BYTES = 1 << 30  # of a body over the cap, read and dropped so that the client reads the 413
DRAIN_SECONDS = 30.0


async def drain_refused_body(receive: Any, headers: dict, refusal: BodyTooLarge) -> None:
    """Read the rest of a refused body (at most DRAIN_BYTES / DRAIN_SECONDS): a server that answers
    and closes while the client still sends makes most clients (httpx, urllib, the openai client)
    see a connection reset instead of the 413. Nothing is read when the client waits for our answer
    before sending (``Expect: 100-continue``, as curl does for large bodies), nor when the message that
    passed the cap was the body's last (``refusal.whole``: reading on would wait for a disconnect)."""
    if refusal.whole or headers.get(b"expect", b"").lower() == b"100-continue":
        return
    size, deadline = 0, time.monotonic() + DRAIN_SECONDS
    while size <= DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body"):
            return
        size += len(message.get("body", b""))


class SteeringRequestMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        cfg = getattr(scope["app"].state, "steer_config", None)
        cap = cfg.body_cap if cfg is not None else None  # steering off: vLLM's behaviour, no cap
        headers = dict(scope.get("headers") or [])
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        try:
            if cap is not None and declared > cap:
                raise BodyTooLarge
            body, gone = await _read_body(receive, cap)
        except BodyTooLarge as e:
            await drain_refused_body(receive, headers, e)
            await _send_error(send, 413, f"request body larger than the server's cap of {cap} bytes "
                                         "(steer.max_body_bytes)", "body")
            return
        msgpack = headers.get(b"content-type", b"").split(b";")[0].strip() in MSGPACK_TYPES
        if gone or not (msgpack or _MARKERS.search(body) or field_names.suspect(body)):
            await self.app(scope, _replay(body, receive), send)
            return
        trace = path_trace.Trace() if path_trace.ON else None
        frontend = getattr(scope["app"].state, "steer_frontend", None)
        rpc = scope["app"].state.steer_engine_client.collective_rpc if frontend is not None else None
        if MODULE_SYNC.stale() and _MODULE_MARKER in body:  # another API process changed the modules
            await MODULE_SYNC.refresh(rpc, frontend.shape.hidden_size)
        if SAE_SYNC.stale() and _SAE_MARKER in body:  # ... or the runtime SAEs
            await SAE_SYNC.refresh(rpc, frontend)
        try:
            obj, prepared = await _prepare_request(frontend, body, msgpack, trace)
        except SteeringSpecError as e:
            await _send_error(send, 400, str(e), e.field)
            return
        except Exception as e:  # no input may become a 500: the engine never saw this request
            logger.exception("vllm-steer: preparing a request's steering fields failed")
            await _send_error(send, 400, f"steering fields could not be processed: {type(e).__name__}: {e}",
                              "steering_vectors")
            return
        if obj is None:
            await self.app(scope, _replay(body, receive), send)
            return
        if SAE_SYNC.stale() and prepared is not None:  # changed while this one was prepared: check it anew
            await SAE_SYNC.refresh(rpc, frontend)
        try:
            token = PREPARED.put(prepared) if prepared is not None else None
        except SteeringSpecError as e:  # its SAE was deleted or replaced meanwhile
            await _send_error(send, 400, str(e), e.field)
            return
        if token is not None:  # vLLM's own vllm_xargs carries it into SamplingParams.extra_args
            xargs = obj.get("vllm_xargs")
            if xargs is None or isinstance(xargs, dict):  # else vLLM refuses the body (400)
                obj["vllm_xargs"] = {**(xargs or {}), TOKEN_FIELD: token}
        if trace is not None:
            trace.stamp("back_on_loop")
            trace.bind(token)
            send = _first_byte(send, trace, token, len(body))
        new_body = msgspec.json.encode(obj)
        headers[b"content-type"] = b"application/json"
        headers[b"content-length"] = str(len(new_body)).encode()
        scope = {**scope, "headers": list(headers.items())}
        try:
            await self.app(scope, _replay(new_body, receive), send)
        finally:
            if token is not None:
                PREPARED.drop(token)


def _first_byte(send: Any, trace: Any, token: str | None, size: int) -> Any:
    """``send`` that closes ``trace`` at the response's first body bytes (VLLM_STEER_TRACE_PATH only)."""
    async def traced(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body") and trace.stamps[-1][0] != "first_byte":
            trace.close(token, size)
        await send(message)

    return traced


def _replay(body: bytes, receive: Any) -> Any:
    """A receive callable that yields ``body`` once, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Any, status: int, message: str, param: str | None) -> None:
    count_rejected(status, param)
    start, body = error_response(status, message, param)
    await send(start)
    await send({"type": "http.response.body", "body": body})
