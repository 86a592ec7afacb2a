"""Layer selections as users write them: a list of indices, or text: ``"all"``, ``"12"``,
``"5-17"`` (inclusive, as llama.cpp's ``--control-vector-layer-range``) or ``"3,5,8-10"``."""

from __future__ import annotations

from typing import Any


def parse_layers(value: Any, num_layers: int | None = None) -> list[int] | None:
    """Sorted distinct layer indices, or None for ``"all"``; ValueError says what is wrong."""
    if value == "all":
        return None
    if isinstance(value, str):
        out: set[int] = set()
        try:
            for part in value.split(","):
                lo, _, hi = part.strip().partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"expected 'all', N, A-B or a comma list of those, got {value!r}") from None
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        out = set(value)
    else:
        raise ValueError("expected a list of layer indices or a range such as '5-17'")
    if not out:
        raise ValueError(f"empty layer selection {value!r}")
    bad = [l for l in sorted(out) if l < 0 or (num_layers is not None and l >= num_layers)]
    if bad:
        raise ValueError(f"layer {bad[0]} out of range" + (f" (the model has {num_layers} layers)" if num_layers else ""))
    return sorted(out)
