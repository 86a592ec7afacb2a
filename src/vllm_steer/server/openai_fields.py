"""Steering fields in OpenAI request bodies: top level (the ``openai`` client's ``extra_body``) or
inside ``vllm_xargs`` as JSON strings.

``steering_fields`` finds them in a decoded body (the request middleware takes them out and
prepares them before vLLM parses the body). ``to_sampling_params`` (patched on the completion and
chat request classes) carries, for a body the middleware left alone (its token rides ``vllm_xargs``),
the fields themselves, into ``SamplingParams.extra_args``: vLLM keeps unknown top-level fields
(``extra="allow"``) but only forwards ``vllm_xargs``, whose values must be flat.

The patch is applied by the general plugin in the API server process too, so that a server without
the ``steer`` endpoint plugin answers steering fields with a 400 instead of a 200 without steering.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.vectors import REQUEST_FIELDS
from vllm_steer.frontend import path_trace
from vllm_steer.frontend.prepared import TOKEN_FIELD

MAX_NESTING = 8  # {hook: {layer: [floats]}} is 3 deep; a capture spec 3 or 4
MAX_XARG_CHARS = 256 * 1024 * 1024
_ENDPOINT = {"attached": False}  # the steer endpoint plugin runs in this process (its middleware prepares)


def endpoint_attached() -> None:
    _ENDPOINT["attached"] = True


_SCALARS = frozenset((int, float, str, bool, type(None)))


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, stopping once past ``limit``. Only containers are walked:
    a list of 4096 numbers (a probe, a vector) costs one pass of type checks, no stack entries."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        depth = d + 1 if children else d  # any child, a scalar one too, is one level deeper
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        if children and not _SCALARS.issuperset(map(type, children)):  # C-speed for a list of numbers
            stack.extend((v, d + 1) for v in children if isinstance(v, (dict, list)))
    return deepest


def decode_xarg(key: str, value: Any) -> Any:
    """A steering field given as a JSON string inside vllm_xargs; every failure is a 400."""
    if not isinstance(value, str):
        return value
    field = f"vllm_xargs.{key}"
    if len(value) > MAX_XARG_CHARS:
        raise SteeringSpecError(field, f"longer than {MAX_XARG_CHARS} characters")
    try:
        decoded = msgspec.json.decode(value)
    except (msgspec.DecodeError, RecursionError, ValueError) as e:
        raise SteeringSpecError(field, f"invalid JSON: {str(e)[:200]}") from None
    if _depth(decoded, MAX_NESTING) > MAX_NESTING:
        raise SteeringSpecError(field, f"nested deeper than {MAX_NESTING} levels")
    return decoded


def steering_fields(body: dict) -> dict[str, Any]:
    """Take the steering fields out of a decoded request body (top level wins over vllm_xargs)."""
    found: dict[str, Any] = {}
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for key in REQUEST_FIELDS:
            if key in xargs:
                found[key] = decode_xarg(key, xargs.pop(key))
    for key in REQUEST_FIELDS:
        if key in body:
            value = body.pop(key)
            if _depth(value, MAX_NESTING) > MAX_NESTING:
                raise SteeringSpecError(key, f"nested deeper than {MAX_NESTING} levels")
            found[key] = value
    return found


def _request_fields(request: Any) -> dict[str, Any]:
    """Steering fields the middleware left in a parsed request (its token travels in ``vllm_xargs``,
    which vLLM forwards itself)."""
    extra = request.model_extra or {}
    body = {k: v for k, v in extra.items() if k in REQUEST_FIELDS}
    xargs = getattr(request, "vllm_xargs", None)
    if xargs and any(k in xargs for k in REQUEST_FIELDS):
        body["vllm_xargs"] = dict(xargs)
    return steering_fields(body) if body else {}


def _patch(cls: type) -> None:
    original = cls.to_sampling_params
    if getattr(original, "_vllm_steer", False):
        return

    def to_sampling_params(self, *args, **kwargs):
        params = original(self, *args, **kwargs)
        fields = _request_fields(self)
        if fields and not _ENDPOINT["attached"]:
            raise SteeringSpecError(next(iter(fields)), (
                "this server does not steer: it runs without vllm-steer's endpoint plugin; start it with "
                "VLLM_PLUGINS=steer and --additional-config '{\"steer\": {}}'"))
        if path_trace.ON and params.extra_args:
            path_trace.stamp(params.extra_args.get(TOKEN_FIELD), "to_sampling_params")
        if fields:
            extra = {k: v for k, v in (params.extra_args or {}).items() if k not in REQUEST_FIELDS}
            params.extra_args = {**extra, **fields}
        return params

    to_sampling_params._vllm_steer = True  # type: ignore[attr-defined]
    cls.to_sampling_params = to_sampling_params


def patch_openai_requests_in_api_server() -> None:
    """The general plugin's share: patch where vLLM's OpenAI server runs. Its CLI has loaded the
    request protocol by then (0.26-0.32: the server module moved in 0.31, the protocol did not)."""
    import sys

    if "vllm.entrypoints.openai.completion.protocol" in sys.modules:
        patch_openai_requests()


def patch_openai_requests() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    _patch(CompletionRequest)
    _patch(ChatCompletionRequest)
