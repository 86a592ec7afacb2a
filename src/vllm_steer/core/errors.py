"""The one error type for bad steering input: raised wherever input is checked, answered as a 400."""

from __future__ import annotations

try:  # vLLM's OpenAI server maps this to a 400 with ``param`` set to the field
    from vllm.exceptions import VLLMValidationError as _ValidationBase
except ImportError:  # pragma: no cover - the client side has no vLLM
    _ValidationBase = ValueError  # type: ignore[misc,assignment]

# vLLM 0.26's VLLMValidationError is a ValueError; from 0.27 it is not (VLLMClientError): stay both,
# so callers (and vLLM's LLM path) that catch ValueError keep catching it.
_BASES = (_ValidationBase,) if issubclass(_ValidationBase, ValueError) else (_ValidationBase, ValueError)


class SteeringSpecError(*_BASES):  # type: ignore[misc]
    """Invalid steering input; ``field`` is the dotted path of the offending field (a ValueError)."""

    status = 400  # the HTTP status of routes that answer by the error's kind (module registration)

    def __init__(self, field: str, message: str) -> None:
        if _ValidationBase is ValueError:
            super().__init__(f"{field}: {message}")
        else:
            super().__init__(f"{field}: {message}", parameter=field)
        self.field = field
        self._text = f"{field}: {message}"

    def __str__(self) -> str:  # one form on every vLLM (0.27+ would append "(parameter=...)")
        return self._text


class SteeringTooLarge(SteeringSpecError):
    """Input over a byte cap (``max_request_bytes`` for requests, ``max_module_bytes`` for modules).
    Module registration answers it with a 413; requests keep their 400."""

    status = 413
