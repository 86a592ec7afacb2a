"""What a failed ``vllm-steer`` command prints: ONE line naming the problem, and for a server's refusal the
command-line flag to change instead of the REST parameter the server's message names (``replace=true`` ->
``--replace``). ``CliError`` is a problem the command found itself (an answer that is not vllm-steer's,
steering off); ``one_line`` turns any of the errors ``main`` catches into the line."""

from __future__ import annotations

import json

import httpx

from vllm_steer.extract import ExtractError
from vllm_steer.http_client import SteeringAPIError
from vllm_steer.cli.options import API_KEY_ENV


class CliError(Exception):
    """A problem a command found itself: its message is the whole line (after ``vllm-steer CMD: error:``)."""


# REST wording in the server's messages -> what to type instead (applied to every command's error text)
PHRASES = {
    "pass replace=true to replace it": "pass --replace to replace it",
    "unless `replace=true`": "unless --replace",
    "or replace an existing name": "(vllm-steer modules delete NAME) or register an existing name with --replace",
    "(Authorization: Bearer ...)": f"(--api-key KEY, or ${API_KEY_ENV})",
}
# a registration's form fields (``param``) -> the ``modules register`` argument that sets them
REGISTER_FLAGS = {"name": "NAME", "file": "FILE", "description": "--description", "site_norms": "--site-norms",
                  "as_ablation": "--as-ablation", "replace": "--replace", "body": "FILE"}


def translated(text: str) -> str:
    for rest, flag in PHRASES.items():
        text = text.replace(rest, flag)
    return " ".join(text.split())  # one line, whatever the server's message held


def refusal(e: SteeringAPIError, flags: dict[str, str] | None = None) -> str:
    """A server's 4xx / 5xx as one line: the status, the argument at fault (its CLI name where ``flags`` has
    one), the server's message with REST wording translated, and what to do for the statuses that say."""
    param = e.param or ""
    root = param.split(".")[0]
    where = flags.get(root) if flags and root else None
    message = e.message
    if where and param and message.startswith(param):
        message = message[len(param):].lstrip(": ")
    where = f"{where}{param[len(root):] and f' ({param[len(root) + 1:]})'}" if where else param
    hint = ""
    if e.status == 401 and "--api-key" not in translated(message):
        hint = f"; pass the server's key with --api-key (or ${API_KEY_ENV})"
    body = translated(f"{where}: {message}" if where else message)[:400] or "(no message)"
    if e.status >= 500:
        return f"the server failed ({e.status}): {body}; its log says why"
    return f"the server refused it ({e.status}): {body}{hint}"


def one_line(e: BaseException, server: str | None, flags: dict[str, str] | None = None) -> str:
    """The line (after ``vllm-steer CMD: error:``) for an error ``main`` catches."""
    if isinstance(e, SteeringAPIError):
        return refusal(e, flags)
    if isinstance(e, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return f"--server {server!r} is not a URL the client can reach ({e}); e.g. --server http://127.0.0.1:8000"
    if isinstance(e, httpx.TimeoutException):
        return f"{server} did not answer in time ({type(e).__name__}); is the server busy or stuck? (--server)"
    if isinstance(e, httpx.TransportError):
        return f"cannot reach {server} ({type(e).__name__}: {e}); is the server up? (--server)"
    if isinstance(e, json.JSONDecodeError):
        return translated(f"not JSON: {e}")
    if isinstance(e, CliError | ExtractError | OSError):
        return translated(str(e))
    raise TypeError(f"no line for {type(e).__name__}")  # main catches only what this function knows


CAUGHT = (CliError, ExtractError, OSError, json.JSONDecodeError, SteeringAPIError, httpx.TransportError,
          httpx.InvalidURL)
"""The errors ``main`` turns into one line and exit status 2 (anything else is a bug: its traceback shows)."""
