"""A request the engine refuses after it was accepted (no steering row within ``steer.max_row_wait_s``,
a named module version that is gone): how the reason travels back to the caller.

The scheduler finishes such a request with vLLM's ``finish_reason="error"`` and puts the reason in
the output's ``stop_reason`` as one string, ``"vllm-steer refused <status> <param>: <message>"``.
``LLM`` users read it there; the OpenAI server turns it into an error response with that status and
``param`` before any byte of the response is sent (``server.response_field``).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "vllm-steer refused "


@dataclass(frozen=True)
class Refusal:
    status: int  # the HTTP status the OpenAI server answers with
    param: str | None  # the request field at fault, if one is
    message: str

    def encode(self) -> str:
        return f"{PREFIX}{self.status} {self.param or '-'}: {self.message}"


def decode(stop_reason: object) -> Refusal | None:
    """The refusal a ``stop_reason`` carries (None: it is not one of ours)."""
    if not isinstance(stop_reason, str) or not stop_reason.startswith(PREFIX):
        return None
    head, _, message = stop_reason[len(PREFIX):].partition(": ")
    status, _, param = head.partition(" ")
    try:
        return Refusal(int(status), None if param in ("", "-") else param, message)
    except ValueError:
        return None
