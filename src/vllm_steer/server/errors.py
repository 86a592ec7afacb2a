"""vLLM's error shape for every answer the plugin's HTTP surface gives: one builder for the routes
and the request middleware."""

from __future__ import annotations

from typing import Any

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          409: "ConflictError", 413: "RequestEntityTooLarge", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``, as vLLM's own OpenAI server answers."""
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None) -> tuple[dict, bytes]:
    """vLLM's error shape, as an ASGI start message and body (for middlewares, before any route)."""
    import json

    body = json.dumps(error_body(status, message, param)).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


def error(status: int, message: str, param: str | None = None) -> Any:
    """A JSONResponse in vLLM's error shape."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message, param), status_code=status)


def mutation_denied(raw: Any, what: str) -> Any:
    """A 401 unless the request carries ``Authorization: Bearer <steer.api_key>`` (when one is set)."""
    cfg = raw.app.state.steer_config
    key = cfg.api_key if cfg is not None else None
    if key and raw.headers.get("authorization") != f"Bearer {key}":
        return error(401, f"{what} needs the steer api_key (Authorization: Bearer ...)")
    return None
