"""``collect(llm, outputs)``: for ``vllm.LLM`` users, publish the captures of finished requests and
attach driver consumers' per-request results to the outputs as ``output.capture``.

(The OpenAI server does this itself: results appear as ``"capture"`` in the response.) Needed on
the in-process LLM because vLLM tells workers a request finished only at the next engine step.

Workers answer ``vllm_steer_capture_collect`` at once with what is ready (``done``) and what is not
(``pending``: the driver instances still running); callers poll it (``PendingResults`` keeps what
came back) until every id is done or ``steer.capture_result_timeout_s`` passes, after which each
driver instance without a result gets ``timeout_error(...)``.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from vllm_steer.core.config import steer_config_of
from vllm_steer.core.rpc import CaptureCollect, call_args

METHOD = "vllm_steer_capture_collect"
POLL_S = 0.01
DEFAULT_TIMEOUT_S = 30.0


def timeout_error(timeout: float) -> dict:
    """What ``capture`` holds for a driver instance whose result did not come in time."""
    return {"error": "timeout", "message": f"no result within {timeout:g} s (steer.capture_result_timeout_s)"}


class PendingResults:
    """The per-worker answers for a set of request ids, merged over polls."""

    def __init__(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        self.open = set(ids)  # not yet reported done by every worker
        self.results: dict[str, dict] = {rid: {} for rid in ids}  # done results (handed over once)
        self.partial: dict[str, dict] = {}  # latest results of ids still pending (by instance)
        self.waiting: dict[str, set[str]] = {}  # latest driver instances still running, per open id

    def update(self, answers: list[dict], asked: Iterable[str]) -> None:
        """Fold in one poll's answers (one per worker) to a call that asked for ``asked``."""
        asked = self.open.intersection(asked)
        still: set[str] = set()
        partial: dict[str, dict] = {}
        waiting: dict[str, set[str]] = {}
        for answer in answers:
            for rid, res in answer.get("done", {}).items():
                if rid in self.results:
                    self.results[rid].update(res)
            for rid, p in answer.get("pending", {}).items():
                if rid in asked:
                    still.add(rid)
                    partial.setdefault(rid, {}).update(p.get("results", {}))
                    waiting.setdefault(rid, set()).update(p.get("waiting", ()))
        self.open -= asked - still
        self.partial.update(partial)
        self.waiting.update(waiting)

    def finish(self, timeout: float, expected: dict[str, list[str]] | None = None) -> dict[str, dict]:
        """Results by id; ids still open get what came in and a timeout error for each driver
        instance still running (as the workers last said, else ``expected`` minus those in)."""
        out = {}
        for rid, res in self.results.items():
            res = dict(res)
            if rid in self.open:
                res.update(self.partial.get(rid, {}))
                late = self.waiting.get(rid)
                if late is None:
                    late = set((expected or {}).get(rid, ())) - set(res)
                for instance in sorted(late):
                    res.setdefault(instance, timeout_error(timeout))
            out[rid] = res
        return out


def _timeout_of(llm: Any) -> float:
    try:
        cfg = steer_config_of(llm.llm_engine.vllm_config)
    except Exception:
        cfg = None
    return cfg.capture_result_timeout_s if cfg is not None else DEFAULT_TIMEOUT_S


def collect(llm: Any, outputs: list[Any], timeout: float | None = None) -> list[Any]:
    """Set ``o.capture`` (driver instance -> result) on each output, waiting at most ``timeout``
    seconds (default ``steer.capture_result_timeout_s``) for slow consumers."""
    if timeout is None:
        timeout = _timeout_of(llm)
    pending = PendingResults(o.request_id for o in outputs)
    deadline = time.monotonic() + timeout
    while pending.open:
        asked = sorted(pending.open)
        pending.update(llm.collective_rpc(METHOD, args=call_args(CaptureCollect(asked))), asked)
        if not pending.open or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    results = pending.finish(timeout)
    for o in outputs:
        o.capture = results.get(o.request_id, {})
    return outputs
