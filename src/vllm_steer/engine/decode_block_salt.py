"""Prefix-cache keys for the KV of tokens a request generated under its own decode steering.

The prompt's blocks are salted by the prefill key (``cache_salt``, set in frontend/prepare.py), and
decode-only steering keeps sharing them. But the KV of a generated token is computed with the
request's *decode* vector, while a later prompt that extends over the reply (a multi-turn
follow-up) computes those positions with *its* prefill vector. Where the two differ
(``decode key != prefill key``), a block holding any position past the prompt gets a hash of its
own, keyed by the decode config and the prompt length (where the phase changed), so no other
request can hit it. Requests with equal phases, or unsteered ones, keep vLLM's hashes untouched.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from vllm_steer.core.payload import SteerPayload

_DOMAIN = b"vllm-steer-decode-kv\0"


def decode_salt_key(payload: SteerPayload | None) -> str | None:
    """The salt (decode key, or ``"-"`` for an unsteered decode) when a request's generated KV
    differs from what a prompt would compute there; None when vLLM's hashes are right as they are."""
    if payload is None or payload.prefill == payload.decode:
        return None
    return payload.decode or "-"


class DecodeSaltedHasher:
    """Wraps a request's block hasher: new blocks that reach past the prompt are re-keyed."""

    __slots__ = ("inner", "key", "block_size")

    def __init__(self, inner: Callable[[Any], list[bytes]], key: str, block_size: int) -> None:
        self.inner, self.key, self.block_size = inner, key.encode(), block_size

    def __call__(self, request: Any) -> list[bytes]:
        first = len(request.block_hashes)
        hashes = self.inner(request)
        n_prompt = request.num_prompt_tokens
        salt = _DOMAIN + self.key + b"\0" + n_prompt.to_bytes(8, "little")
        for k, h in enumerate(hashes):
            if (first + k + 1) * self.block_size > n_prompt:
                hashes[k] = type(h)(hashlib.sha256(salt + h).digest())
        return hashes
