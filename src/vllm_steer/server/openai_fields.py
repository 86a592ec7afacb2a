"""Steering fields in OpenAI request bodies: top level (the ``openai`` client's ``extra_body``) or
inside ``vllm_xargs`` as JSON strings, copied into ``SamplingParams.extra_args``.

Patch: ``CompletionRequest.to_sampling_params`` and ``ChatCompletionRequest.to_sampling_params``
(0.26). Why: vLLM keeps unknown top-level fields (``extra="allow"``) but only forwards
``vllm_xargs``, whose values must be flat. Applied by the endpoint plugin, in the API server only.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_steer.spec import REQUEST_FIELDS, SteeringSpecError


def steering_fields(request: Any) -> dict[str, Any]:
    """The steering fields of an OpenAI request: top level first, then vllm_xargs (JSON strings)."""
    found: dict[str, Any] = {}
    xargs = getattr(request, "vllm_xargs", None) or {}
    for key in REQUEST_FIELDS:
        if key in xargs:
            value = xargs[key]
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise SteeringSpecError(f"vllm_xargs.{key}", f"invalid JSON: {e.msg}") from None
            found[key] = value
    extra = request.model_extra or {}
    for key in REQUEST_FIELDS:
        if key in extra:
            found[key] = extra[key]
    return found


def _patch(cls: type) -> None:
    original = cls.to_sampling_params
    if getattr(original, "_vllm_steer", False):
        return

    def to_sampling_params(self, *args, **kwargs):
        params = original(self, *args, **kwargs)
        fields = steering_fields(self)
        if fields:
            params.extra_args = {**(params.extra_args or {}), **fields}
        return params

    to_sampling_params._vllm_steer = True  # type: ignore[attr-defined]
    cls.to_sampling_params = to_sampling_params


def patch_openai_requests() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    _patch(CompletionRequest)
    _patch(ChatCompletionRequest)
