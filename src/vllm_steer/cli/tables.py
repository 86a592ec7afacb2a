"""Plain-text output of the ``vllm-steer`` listing commands: aligned tables and compact layer ranges."""

from __future__ import annotations

from typing import Any, Iterable


def layer_ranges(layers: Iterable[Any]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (the form ``--layers`` and a reference's ``layers`` take)."""
    nums = sorted({int(l) for l in layers})
    out, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(out) or "-"


def table(header: list[str], rows: list[list[Any]]) -> str:
    """Columns left-aligned to their widest cell, two spaces apart; a cell is ``str()`` of its value, ``-`` for
    None or empty, on one line."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    lines = [header] + cells
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def fields(pairs: list[tuple[str, Any]]) -> str:
    """``key: value`` lines, keys aligned."""
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k + ':':<{width + 1}} {_cell(v)}" for k, v in pairs)


def _cell(v: Any) -> str:
    if v is None or v == "" or v == [] or v == {}:
        return "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    return " ".join(str(v).split())
