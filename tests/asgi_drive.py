"""One ``POST /v1/completions`` through an ASGI app with no server, as uvicorn hands a request over (the body in
64 KiB messages), for the request middleware's tests and ``bench/request_path_cost.py``: the app state our
middleware reads, the scope, and the drive (the response must start with 200)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

CHUNK = 65536


def completion_scope(fe: Any, body: bytes, msgpack: bool) -> dict:
    """The HTTP scope of a completion request whose app state holds the front end ``fe`` (no engine client)."""
    app = SimpleNamespace(state=SimpleNamespace(steer_config=fe.cfg, steer_frontend=fe,
                                                steer_engine_client=SimpleNamespace(collective_rpc=None)))
    ctype = b"application/msgpack" if msgpack else b"application/json"
    return {"type": "http", "method": "POST", "path": "/v1/completions", "app": app,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]}


async def post(asgi: Any, scope: dict, body: bytes) -> None:
    """Send ``body`` to ``asgi`` in CHUNK-byte messages; the response must start with status 200."""
    parts = [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    it = iter(range(len(parts)))

    async def receive() -> dict:
        i = next(it)
        return {"type": "http.request", "body": parts[i], "more_body": i < len(parts) - 1}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message

    await asgi(scope, receive, send)


async def reply_ok(send: Any) -> None:
    """What a handler sends back: 200 and an empty JSON object."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})
