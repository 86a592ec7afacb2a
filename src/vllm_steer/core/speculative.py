"""Speculative decoding and the features that read a step's tokens as final: what is refused, and the words.

With speculative decoding a step's forward runs the request's draft tokens too; those the verifier rejects are run
again, as other tokens, in a later step. Capture plans each position once (a rejected draft's row would be delivered
as the request's own, and never replaced), and ``stop_when`` reads the gate at a step's last token (a draft, maybe
rejected). Until both follow rejections, a server that drafts refuses them: a request's ``capture`` field or
``stop_when`` is a 400 naming the field (``frontend.prepare``), and a consumer whose global spec captures every request
does not start (``core.engine_config``). Steering itself is per token and holds for every token verified.
"""

from __future__ import annotations

from typing import Any


def drafting(vllm_config: Any) -> str | None:
    """How this engine drafts ("ngram, 3 tokens a step"), or None when it does not decode speculatively."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    n = getattr(spec, "num_speculative_tokens", None)
    method = getattr(spec, "method", None) or "a draft model"
    return f"{method}, {n} tokens a step" if n else str(method)


def refusal(what: str, how: str) -> str:
    """The reason ``what`` (a field or a consumer) is refused on a server drafting ``how``."""
    return (f"{what} is not supported with speculative decoding (this server drafts: {how}): a rejected draft token's "
            f"rows and gates would be taken as the request's own; serve capture and stop_when without "
            f"--speculative-config")
