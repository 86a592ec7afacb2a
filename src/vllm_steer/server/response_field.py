"""Adds ``"steering": {"prefill": key, "decode": key, ...}`` to OpenAI completion/chat responses of
steered requests (every SSE event when streaming, spliced in as bytes), so a client can see that
steering happened and what it was (``frontend.applied_report``: the module, its version and strength,
the count of steered sites, SAEs, condition, projections, capture consumers). Responses of unsteered requests pass through untouched.

A pure ASGI middleware: it opens an applied-holder per request (vllm_steer.frontend.applied) and rewrites
only responses whose holder was filled; everything else streams through untouched. Responses of
capturing requests also get ``"capture"``: the driver consumers' per-request results, in the body
(non-streaming) or, when streaming, in one last chunk with empty ``choices`` just before
``data: [DONE]`` (the shape of the usage chunk, which OpenAI clients accept). Results come to this process's
inbox (``capture.inbox``: the workers push them, nothing is asked of the engine): a response waits for its
own requests' driver results at most ``steer.capture_result_timeout_s``, and not at all once the engine
client reports the engine dead (each missing result is then ``{"error": "engine_dead", ...}``).

A request the engine refused after accepting it (no steering row within ``steer.max_row_wait_s``,
``core.refusals``) is answered with the refusal's status (503, or 400) and message instead of vLLM's
500 or its error event: a streaming response's start is held until its first event for that.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from vllm_steer.core.refusals import Refusal
from vllm_steer.server.errors import error_response
from vllm_steer.capture.collect import DEFAULT_TIMEOUT_S
from vllm_steer.capture.inbox import inbox
from vllm_steer.frontend.applied import close_holder, open_holder, steering_field

PATHS = ("/v1/completions", "/v1/chat/completions")


def _enc_hook(obj: Any) -> Any:
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # a numpy scalar in a consumer's result
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


_ENCODE = msgspec.json.Encoder(enc_hook=_enc_hook).encode


def _inject(obj: Any, applied: dict) -> Any:
    if isinstance(obj, dict) and ("prefill" in applied or "decode" in applied):
        obj["steering"] = _field(applied)
    return obj


def _is_object(raw: bytes) -> bool:
    return raw.lstrip()[:1] == b"{"


def with_fields(raw: bytes, applied: dict, capture: Any = None) -> bytes:
    """vLLM's JSON body with ``"steering"`` (a steered request's) and ``"capture"`` (when not None) added: spliced
    in before the object's closing brace as bytes (msgspec), not parsed and dumped again (s36: ~130 us a response
    with an activations result, on the API process's event loop; the splice ~25). A body that is not a non-empty
    object goes through ``json`` as before."""
    fields = b""
    if "prefill" in applied or "decode" in applied:
        fields += b',"steering":' + _ENCODE(_field(applied))
    if capture is not None:
        fields += b',"capture":' + _ENCODE(capture)
    if not fields:
        return raw
    head = raw.rstrip()
    if _is_object(head) and head.endswith(b"}") and not head[:-1].rstrip().endswith(b"{"):
        return head[:-1] + fields + b"}"
    obj = _inject(json.loads(raw), applied)
    if capture is not None and isinstance(obj, dict):
        obj["capture"] = capture
    return json.dumps(obj).encode()


def _field(applied: dict) -> dict:
    return steering_field(applied.get("prefill"), applied.get("decode"), applied.get("report"))


async def _capture_results(scope: dict, holder: dict) -> dict:
    """Driver consumers' results for the finished requests of a response."""
    state = scope["app"].state
    engine = getattr(state, "steer_engine_client", None)
    if engine is None:
        return {}
    cfg = getattr(state, "steer_config", None)
    timeout = cfg.capture_result_timeout_s if cfg is not None else DEFAULT_TIMEOUT_S
    return await inbox().wait(holder["capture_ids"], timeout, holder.get("capture_instances"),
                              dead=lambda: bool(getattr(engine, "errored", False)))


_ENVELOPE = ("id", "object", "created", "model")
_DONE = b"data: [DONE]"


def _steering_bytes(applied: dict) -> bytes:
    """``"steering":{...},`` once per response, spliced after the ``{`` of every SSE event."""
    field = _field(applied)
    return b'"steering":' + json.dumps(field, separators=(",", ":")).encode() + b","


def _note_envelope(chunk: bytes, envelope: dict) -> None:
    """Keep id/object/created/model of the first event (for the closing capture event)."""
    start = chunk.find(b"data: {")
    if start >= 0 and not envelope:
        line = chunk[start + 6 :].split(b"\n", 1)[0]
        obj = json.loads(line)
        envelope.update({k: obj[k] for k in _ENVELOPE if k in obj})
        envelope.setdefault("object", obj.get("object"))


def _rewrite_sse(chunk: bytes, splice: bytes) -> bytes:
    """Splice the steering field into each ``data: {...}`` event: byte replaces, no JSON. Events
    start a line, and a JSON string never holds a raw newline, so ``\ndata: {`` is only ever an
    event's start, never generated text."""
    lines = b"\n" + chunk
    out = lines.replace(b"\ndata: {", b"\ndata: {" + splice)
    if b"\ndata: {}" in lines:  # an empty object takes the field without its trailing comma
        out = out.replace(b"\ndata: {" + splice + b"}", b"\ndata: {" + splice[:-1] + b"}")
    return out[1:]


def _capture_field(results: dict, ids: list[str]) -> dict:
    return results.get(ids[0], {}) if len(ids) == 1 else results


async def _send_refusal(send: Any, refusal: Refusal) -> None:
    """The engine refused the request after accepting it: its status and reason, vLLM's error shape."""
    start, body = error_response(refusal.status, refusal.message, refusal.param)
    if refusal.status == 503:
        start["headers"].append((b"retry-after", b"1"))
    await send(start)
    await send({"type": "http.response.body", "body": body})


class SteeringResponseMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        holder, token = open_holder()
        state: dict[str, Any] = {"mode": None, "start": None, "body": [], "envelope": {}, "splice": None}

        async def wrapped_send(message: dict) -> None:
            if state["mode"] == "refused":
                return  # answered already: the rest of vLLM's response is dropped
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                if b"event-stream" in ctype:
                    state["mode"], state["start"] = "sse", message
                    return  # held until the first event: an engine refusal is answered with its status
                elif holder and b"json" in ctype:
                    state["mode"], state["start"] = "json", message
                    return  # held until the whole body is here (its length changes)
                await send(message)
            elif message["type"] == "http.response.body" and state["mode"] == "sse" and state["start"]:
                if "refused" in holder:  # refused before its first token: vLLM sends an error event or [DONE]
                    state["mode"] = "refused"
                    await _send_refusal(send, holder["refused"])
                    return
                await send(state["start"])
                state["start"] = None
                await wrapped_send(message)
            elif message["type"] == "http.response.body" and state["mode"] == "json":
                state["body"].append(message.get("body", b""))
                if message.get("more_body"):
                    return
                start = state["start"]
                if "refused" in holder and start.get("status", 200) >= 500:
                    await _send_refusal(send, holder["refused"])
                    return
                raw = b"".join(state["body"])
                ids = holder.get("capture_ids")
                capture = None
                if ids and start.get("status", 200) == 200 and _is_object(raw):
                    capture = _capture_field(await _capture_results(scope, holder), ids)
                body = with_fields(raw, holder, capture)
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            elif message["type"] == "http.response.body" and state["mode"] == "sse" and holder:
                if state["splice"] is None:
                    state["splice"] = _steering_bytes(holder) if ("prefill" in holder or "decode" in holder) else b""
                body = message.get("body", b"")
                ids = holder.get("capture_ids")
                if ids and not state["envelope"]:
                    _note_envelope(body, state["envelope"])
                if state["splice"]:
                    body = _rewrite_sse(body, state["splice"])
                if ids and _DONE in body:  # the stream is complete: its requests have finished
                    event = _inject({**state["envelope"], "choices": [],
                                     "capture": _capture_field(await _capture_results(scope, holder), ids)}, holder)
                    body = body.replace(_DONE, b"data: " + json.dumps(event, separators=(",", ":")).encode()
                                        + b"\n\n" + _DONE, 1)
                await send({**message, "body": body})
            else:
                await send(message)

        try:
            await self.app(scope, receive, wrapped_send)
        finally:
            close_holder(token)
            # wrapped_send calls itself (its closure holds it): without this the request's scope, headers and
            # holder would wait for the API process's cyclic collector (s41: generation-2 pauses under load)
            del wrapped_send
