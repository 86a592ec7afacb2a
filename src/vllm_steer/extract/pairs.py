"""Contrastive inputs for extraction: pairs of texts, read from JSONL or from two files of prompts.

JSONL, one pair per line: ``{"positive": ..., "negative": ...}``, optionally with ``"prompt"``: a
shared prompt both completions follow (CAA's question + answer). Two plain files: line i of the
positive file pairs with line i of the negative one (blank lines skipped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ExtractError(ValueError):
    """A user-facing extraction error: bad inputs, a site the server does not have, a refused request."""


@dataclass(frozen=True)
class Pair:
    positive: str
    negative: str
    prompt: str | None = None


def as_pair(item: object, where: str) -> Pair:
    """A Pair from a dict (``positive``, ``negative``, optional ``prompt``), a 2-tuple or a Pair."""
    if isinstance(item, Pair):
        return item
    if isinstance(item, (tuple, list)) and len(item) == 2:
        item = {"positive": item[0], "negative": item[1]}
    if not isinstance(item, dict):
        raise ExtractError(f"{where}: expected an object with 'positive' and 'negative'")
    extra = set(item) - {"positive", "negative", "prompt"}
    if extra:
        raise ExtractError(f"{where}: unknown key {sorted(extra)[0]!r} (a pair has positive, negative, prompt)")
    for key in ("positive", "negative"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise ExtractError(f"{where}.{key}: expected a non-empty string")
    prompt = item.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ExtractError(f"{where}.prompt: expected a string")
    return Pair(item["positive"], item["negative"], prompt)


def read_jsonl(path: str | Path) -> list[Pair]:
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as e:
                raise ExtractError(f"{path}:{n}: not JSON ({e})") from None
            pairs.append(as_pair(item, f"{path}:{n}"))
    if not pairs:
        raise ExtractError(f"{path}: no pairs")
    return pairs


def read_two_files(positive: str | Path, negative: str | Path) -> list[Pair]:
    def lines(path: str | Path) -> list[str]:
        return [ln.rstrip("\n") for ln in open(path, encoding="utf-8") if ln.strip()]

    pos, neg = lines(positive), lines(negative)
    if not pos or not neg:
        raise ExtractError(f"{positive if not pos else negative}: no prompts")
    if len(pos) != len(neg):
        raise ExtractError(f"{len(pos)} positive prompts but {len(neg)} negative ones: line i of one pairs with line i of the other")
    return [Pair(p, n) for p, n in zip(pos, neg)]
