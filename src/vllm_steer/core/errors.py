"""The one error type for bad steering input: raised wherever input is checked, answered as a 400."""

from __future__ import annotations

try:  # vLLM's OpenAI server maps this to a 400 with ``param`` set to the field
    from vllm.exceptions import VLLMValidationError as _ValidationBase
except ImportError:  # pragma: no cover - the client side has no vLLM
    _ValidationBase = ValueError  # type: ignore[misc,assignment]


class SteeringSpecError(_ValidationBase):
    """Invalid steering input; ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        if _ValidationBase is ValueError:
            super().__init__(f"{field}: {message}")
        else:
            super().__init__(f"{field}: {message}", parameter=field)
        self.field = field
