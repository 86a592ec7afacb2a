"""``collect(llm, outputs)``: for ``vllm.LLM`` users, publish the captures of finished requests and
attach driver consumers' per-request results to the outputs as ``output.capture``.

(The OpenAI server does this itself: results appear as ``"capture"`` in the response.) Needed on
the in-process LLM because vLLM tells workers a request finished only at the next engine step.
"""

from __future__ import annotations

from typing import Any


def collect(llm: Any, outputs: list[Any]) -> list[Any]:
    ids = [o.request_id for o in outputs]
    per_worker = llm.collective_rpc("vllm_steer_capture_collect", args=(ids,))
    merged: dict[str, dict] = {}
    for results in per_worker:
        for rid, res in results.items():
            merged.setdefault(rid, {}).update(res)
    for o in outputs:
        o.capture = merged.get(o.request_id, {})
    return outputs
