"""Prometheus metrics of the steering front end, served on vLLM's own ``/metrics`` (the API process;
with ``--api-server-count`` each process writes its share through prometheus_client's multiprocess
files, as vLLM's own metrics do). Labels stay few: kinds of steering, status, top-level field."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter("vllm_steer_requests", "Requests whose steering fields were prepared, by what they carry "
                   "(a request counts once per kind)", ["kind"])
REJECTED = Counter("vllm_steer_rejected", "Requests refused before vLLM saw them, by status and top-level field",
                   ["status", "field"])
PREPARE_SECONDS = Histogram("vllm_steer_prepare_seconds", "Time to decode, check and hash a request's steering "
                            "fields (off the event loop; refused ones too)",
                            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
_KINDS = {"steering_vectors": "vectors", "prefill_steering_vectors": "vectors", "decode_steering_vectors": "vectors",
          "steering_module": "module", "sae": "sae", "capture": "capture"}


def count_request(fields: dict) -> None:
    """One prepared request: a count per kind of steering field it carries."""
    for kind in {_KINDS[k] for k, v in fields.items() if k in _KINDS and v is not None}:
        REQUESTS.labels(kind).inc()


def count_rejected(status: int, param: str | None) -> None:
    field = (param or "body").split(".")[0].split("[")[0]
    REJECTED.labels(str(status), field if field in _KINDS or field in ("body", "vllm_xargs") else "other").inc()
