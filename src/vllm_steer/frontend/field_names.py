"""Near-misses of the steering field names: a body key (or an ``extra_args`` key on the offline path) that looks
like a steering field but is not one.

vLLM keeps unknown top-level fields (``extra="allow"``) and ignores them, so ``"steering_vector": ...``
would be a 200 without steering. The rule (docs/requests.md, "Misspelled fields"): a key K of the body's top level,
of its ``vllm_xargs`` or of an ``extra_body`` object is refused (400, ``param`` K, "did you mean") when K is
not itself a steering field, not a field vLLM's request declares and not one of vllm-steer's reserved keys
(the prepared token, the payload: refused elsewhere as reserved), and,
with k = K lower-cased and ``-`` read as ``_``:

- k contains ``steer`` (``steering``, ``steer_vectors``, ``SteeringVectors``), or
- k is within ``max_distance(f)`` edits (insert, delete, substitute, swap two neighbours) of a field
  name f: 0 for names of up to 3 characters (``sae``: only ``SAE``), 1 up to 8 (``capture``:
  ``capure``, ``captures``), 2 beyond (``steering_vectros``, ``stearing_module``).

Any ``steering_*`` field named inside ``extra_body`` (the openai client's argument, not a body field)
is refused too, saying to put it at the top level. ``suspect`` is the byte scan that decides whether a
body needs decoding for this at all: it finds the quoted keys (``"name":``) anywhere in the raw JSON.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache

from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.payload import PAYLOAD_KEY, ROWS_KEY
from vllm_steer.core.vectors import REQUEST_FIELDS
from vllm_steer.frontend.prepared import TOKEN_FIELD

_FIELDS = frozenset(REQUEST_FIELDS)
_KEY = re.compile(rb'"([A-Za-z0-9_\-]{1,64})"\s*:')  # a JSON key (escaped quotes inside strings never match)
_VLLM_FIELDS: set[str] = set()  # filled once from vLLM's request classes (``declared_by_vllm``)


def max_distance(name: str) -> int:
    return 0 if len(name) <= 3 else 1 if len(name) <= 8 else 2


def distance(a: str, b: str, limit: int | None = None) -> int:
    """Edit distance with adjacent swaps (optimal string alignment). With ``limit``: any value above it once
    the distance must exceed it (two rows in a row all above it: no later cell can come back under)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if limit is not None and min(cur) > limit and min(prev) > limit:
            return limit + 1
        prev2, prev = prev, cur
    return prev[-1]


def declared_by_vllm() -> set[str]:
    """The fields vLLM's completion and chat requests declare (never refused, whatever they look like)."""
    if not _VLLM_FIELDS:
        try:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        except ImportError:  # pragma: no cover - a vLLM whose protocol moved: the rule alone decides
            return {""}
        _VLLM_FIELDS.update(CompletionRequest.model_fields, ChatCompletionRequest.model_fields)
    return _VLLM_FIELDS


_BOUNDS = tuple((f, len(f), max_distance(f)) for f in REQUEST_FIELDS)


def looks_like_steering(key: str) -> bool:
    """The rule alone: ``steer`` in the key, or a key within ``max_distance`` of a field name. The edit distance
    is at least the difference of the lengths, so only fields of a near length are compared: every body key
    of every request is read here once (``suspect``; then cached), and ``distance`` is ~0.1-0.3 ms of Python
    per field (a body with 100 new keys, a ``logit_bias`` or a tool's schema, held the event loop ~0.1 s)."""
    k = key.lower().replace("-", "_")
    n = len(k)
    return "steer" in k or any(abs(n - size) <= most and distance(k, f, most) <= most for f, size, most in _BOUNDS)


@lru_cache(maxsize=4096)
def near_miss(key: str) -> str | None:
    """The steering field ``key`` was probably meant to be, or None when it is not steering-like."""
    if key in _FIELDS or key in (TOKEN_FIELD, PAYLOAD_KEY, ROWS_KEY) or len(key) > 64 or not looks_like_steering(key):
        return None
    if key in declared_by_vllm():
        return None
    k = key.lower().replace("-", "_")
    near = min(REQUEST_FIELDS, key=lambda f: distance(k, f))
    if distance(k, near) <= max_distance(near):
        return near
    close = difflib.get_close_matches(k, REQUEST_FIELDS, n=1, cutoff=0.75)
    return close[0] if close else "steering_vectors"  # "steering", "steer": the field most requests use


def suspect(body: bytes) -> bool:
    """Whether a raw JSON body has a key that ``near_miss`` flags (then ``check`` decides on the decoded body)."""
    return any(near_miss(k.decode()) for k in set(_KEY.findall(body)))


def _refuse(key: str, where: str, meant: str) -> SteeringSpecError:
    return SteeringSpecError(where + key, (
        f"not a steering field: did you mean `{meant}`? (vLLM would ignore it and answer unsteered; "
        f"steering fields: {', '.join(REQUEST_FIELDS)})"))


def check_extra_args(extra: dict) -> None:
    """Refuse ``SamplingParams.extra_args`` with a near-miss key: the offline ``LLM`` path (and what the HTTP
    path forwards), where vLLM would otherwise ignore it as it ignores any unknown key."""
    for key in extra:
        meant = near_miss(key) if isinstance(key, str) else None
        if meant is not None:
            raise _refuse(key, "extra_args.", meant)


def check(body: dict) -> None:
    """Refuse a decoded body whose top level, ``vllm_xargs`` or ``extra_body`` names a near-miss."""
    for where, keys in (("", body), ("vllm_xargs.", body.get("vllm_xargs"))):
        if isinstance(keys, dict):
            for key in keys:
                meant = near_miss(key) if isinstance(key, str) else None
                if meant is not None:
                    raise _refuse(key, where, meant)
    extra = body.get("extra_body")
    if isinstance(extra, dict) and "extra_body" not in declared_by_vllm():
        for key in extra:
            if isinstance(key, str) and (key in _FIELDS or near_miss(key)):
                raise SteeringSpecError(f"extra_body.{key}", (
                    "extra_body is the openai client's argument, not a body field: put the steering fields "
                    "at the top level of the body" + (f" (did you mean `{near_miss(key)}`?)" if key not in _FIELDS
                                                     else "")))
