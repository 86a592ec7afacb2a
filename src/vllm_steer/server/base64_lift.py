"""Large base64 ``data`` strings of a JSON body decoded straight from the body's bytes.

A JSON parse builds a ``str`` of every base64 string (msgspec scans 1 MB of them in ~0.3 ms, more than the
base64 decode itself), only for the front end to decode it once more. ``lift`` finds each ``"data": "..."``
whose string is long and has no escape, decodes the base64 in place (pybase64, validated, from a view of the
body), and hands back the body with a short placeholder instead of each such string. ``restore`` then puts,
into the decoded body, the raw bytes where a placeholder stands for a packed block (a tier's
``{tier: {hook: {"data": ...}}}``, or any ``{"dtype", "data"}`` in the steering fields: a projection's direction,
a probe), what the msgpack form carries as a bin already, and the original text anywhere else in them; a
placeholder outside them (a key that merely ends in ``"data``, say) makes ``restore`` answer False and the caller
decode the original body. So the decoded body equals the plain
parse but for those bytes, and a string that is not valid base64 stays a string (its error unchanged).
A string's closing quote is first looked for where the last lifted string's length puts it (a request's blocks,
and the next request's, are mostly as long): the quote there and valid base64 before it (which holds no quote)
prove it, and the text is not scanned for its end.

Clients often send the same vectors with every request: a text equal to one decoded lately (``TEXTS``: the same
length and ends, then one comparison with a copy of the text, kept from its second time on) gives back the bytes
object decoded then, which ``core.layout.checked_rows`` then knows by identity: a block sent again and again is
decoded, checked and hashed twice, not every time. Nothing else of a request (its prompt) is kept.
"""

from __future__ import annotations

import binascii
import re
import secrets
from typing import Any

import pybase64

from vllm_steer.core.recent_blocks import PROBE, Recent
from vllm_steer.core.vectors import REQUEST_FIELDS, TIER_FIELDS

MIN_CHARS = 16 * 1024  # a shorter string costs less to parse than to lift
_PREFIX = f"vllm-steer-lifted-{secrets.token_hex(8)}-"  # drawn once per process: no body holds it by chance
_KEY = b'"data"'
_COLON = re.compile(rb'[ \t\r\n]*:[ \t\r\n]*"')


TEXTS = Recent(64 * 1024 * 1024)  # (length, head, tail) -> (the text, its decoded bytes): core.recent_blocks


class Lifted:
    """The strings taken out of one body: placeholder -> (decoded bytes, start and end of the text in the body)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.strings: dict[str, tuple[bytes, int, int]] = {}

    def text(self, placeholder: str) -> str:
        _, start, end = self.strings[placeholder]
        return self.body[start:end].decode("ascii")


def lift(body: bytes) -> tuple[bytes, Lifted] | None:
    """(the body with placeholders, what they stand for), or None when no string was worth lifting."""
    pieces: list[bytes] = []
    lifted = Lifted(body)
    done = 0  # the body up to here is in pieces
    view = memoryview(body)
    at = body.find(_KEY)
    while at >= 0:
        colon = _COLON.match(body, at + len(_KEY))  # the key's colon and the value's opening quote
        if colon is None:
            at = body.find(_KEY, at + len(_KEY))
            continue
        start = colon.end()
        end, raw = _hinted(body, view, start)
        if end < 0:
            end = body.find(b'"', start)
            if end < 0:
                break
            # an escape (a backslash) fails the validation: left as it is
            raw = _decoded(body, view, start, end) if end - start >= MIN_CHARS else None
        if raw is not None:
            placeholder = f"{_PREFIX}{len(lifted.strings)}"
            lifted.strings[placeholder] = (raw, start, end)
            pieces += (body[done:start], placeholder.encode())
            done = end
        at = body.find(_KEY, end + 1)
    if not lifted.strings:
        return None
    pieces.append(body[done:])
    return b"".join(pieces), lifted


# the length of the last string lifted: a request's blocks are often all as long, and so are the next request's
_LAST = [0]


def _hinted(body: bytes, view: memoryview, start: int) -> tuple[int, bytes | None]:
    """(end, decoded bytes) of the string at ``start`` when it is as long as the last one lifted, else (-1, None):
    its closing quote found without scanning the text for it (a 1 MB body: -0.07 ms, s30). Sound whatever the hint:
    a quote stands where the last string's did, and the text before it is valid base64, which holds no quote."""
    end = start + _LAST[0]
    if _LAST[0] < MIN_CHARS or body[end:end + 1] != b'"':
        return -1, None
    raw = _decoded(body, view, start, end)
    return (end, raw) if raw is not None else (-1, None)


def _decoded(body: bytes, view: memoryview, start: int, end: int) -> bytes | None:
    """The base64 text ``body[start:end]`` decoded (from ``TEXTS`` when it came lately), None when it is not valid
    base64."""
    key = (end - start, body[start:start + PROBE], body[end - PROBE:end])
    known = TEXTS.get(key)
    raw = known[1] if known is not None and body.startswith(known[0], start) else None
    if raw is None:
        try:
            raw = pybase64.b64decode(view[start:end], validate=True)
        except (binascii.Error, ValueError):
            return None  # left as text: the front end reports it
        TEXTS.put(key, lambda: ((body[start:end], raw), 2 * len(raw) + end - start))
    _LAST[0] = end - start
    return raw


def restore(obj: dict, lifted: Lifted) -> bool:
    """Put back what ``lift`` took out of the decoded body ``obj`` (see the module docstring); False when a
    placeholder was not found where it may stand (``obj`` must then be decoded again from the body)."""
    left = dict(lifted.strings)
    xargs = obj.get("vllm_xargs")
    for where in (obj, xargs) if isinstance(xargs, dict) else (obj,):
        for tier in TIER_FIELDS:
            hooks = where.get(tier)
            if not isinstance(hooks, dict):
                continue
            for packed in hooks.values():
                data = packed.get("data") if isinstance(packed, dict) else None
                if isinstance(data, str) and data in left:
                    packed["data"] = left.pop(data)[0]
    if left:
        for where in (obj, xargs) if isinstance(xargs, dict) else (obj,):
            for field in REQUEST_FIELDS:
                if field in where:
                    where[field] = _texts(where[field], left, lifted)
    return not left


def _texts(node: Any, left: dict, lifted: Lifted) -> Any:
    """``node`` with every placeholder still ``left`` replaced by its original text (popped from ``left``)."""
    if not left:
        return node
    if isinstance(node, str):
        if node in left:
            left.pop(node)
            return lifted.text(node)
        return node
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "data" and "dtype" in node and isinstance(v, str) and v in left:
                node[k] = left.pop(v)[0]  # a packed block (a projection's direction, a probe): its bytes, as msgpack
            elif isinstance(v, (str, dict, list)):
                node[k] = _texts(v, left, lifted)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, (str, dict, list)):
                node[i] = _texts(v, left, lifted)
    return node
