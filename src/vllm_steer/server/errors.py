"""vLLM's error shape for every answer the plugin's HTTP surface gives: one builder for the routes
and the request middleware."""

from __future__ import annotations

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
          413: "RequestEntityTooLarge"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``, as vLLM's own OpenAI server answers."""
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}
