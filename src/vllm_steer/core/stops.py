"""``steering_condition.stop_when``: how a request the probe stopped says so.

The scheduler finishes such a request as vLLM finishes one at a stop token (``FINISHED_STOPPED``,
its blocks freed as usual) and puts ``"vllm-steer stop_when <score>"`` in the output's
``stop_reason``. The API process (and ``LLM``) rewrites that output (``frontend.stop_output``):
``finish_reason`` becomes ``"stop_when"`` and ``stop_reason`` the score, as a decimal string: the
probe's gate at the last of the consecutive tokens that stopped it.
"""

from __future__ import annotations

PREFIX = "vllm-steer stop_when "
FINISH_REASON = "stop_when"


def encode(score: float) -> str:
    return f"{PREFIX}{score:.6g}"


def decode(stop_reason: object) -> str | None:
    """The score (a decimal string) a ``stop_reason`` carries (None: not a stop_when stop)."""
    if isinstance(stop_reason, str) and stop_reason.startswith(PREFIX):
        return stop_reason[len(PREFIX):]
    return None
