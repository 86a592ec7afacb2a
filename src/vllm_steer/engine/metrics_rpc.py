"""Engine side of the Prometheus metrics: ``collective_rpc("vllm_steer_metrics")`` is answered by the
engine core (``engine.module_rpc`` dispatches it, between steps, only when the API server asks: a
``/metrics`` scrape) from the row gate and every worker's ``vllm_steer_status``; nothing here runs per
step. Gauges are current values; counters go out as increments since the previous answer (kept on the
EngineCore), so API processes that each add what they were handed never count anything twice
(prometheus' multiprocess mode sums counters over processes)."""

from __future__ import annotations

from typing import Any, Callable

from vllm_steer.core.compat import waiting_queues

_STATE = "_vllm_steer_metrics_reported"  # EngineCore attribute: totals already handed out


def requests_waiting_for_row(scheduler: Any, gate: Any) -> int:
    """Steered requests the row gate would hold back now (their new configs do not fit)."""
    if not gate.waiting:
        return 0
    return sum(len(gate.select_held(list(queue))) for queue in waiting_queues(scheduler))


def worker_values(workers: list[dict]) -> tuple[dict[str, int], dict[str, int]]:
    """(gauges, cumulative totals) of the workers' ``vllm_steer_status``. Rows are the same on every
    rank (max); bytes and captures are per device (summed over workers)."""
    steered = [w for w in workers if w.get("steering")]
    if not steered:
        return {}, {}
    caps = [w.get("capture") or {} for w in steered]
    gauges = {"rows_in_use": max(w["live_configs"] for w in steered),
              "rows_in_use_peak": max(w["peak_live_configs"] for w in steered)}
    totals = {"row_uploads": max(w.get("row_uploads", 0) for w in steered),
              "row_upload_bytes": sum(w.get("row_upload_bytes", 0) for w in steered),
              "row_evictions": max(w.get("row_evictions", 0) for w in steered),
              "preemptions": max(w.get("preemptions_seen", 0) for w in steered)}
    for k in ("rows", "dropped_rows", "dropped_packets", "lost_rows", "dropped_finishes", "consumer_errors", "ring_full",
              "consumer_host_deaths", "write_errors", "dropped_writes", "failed_requests", "result_push_failed",
              "reduced_requests", "reduce_fallbacks", "plans_in_forward"):
        totals[f"capture_{k}"] = sum(c.get(k, 0) for c in caps)
    return gauges, totals


def engine_metrics(core: Any, gate: Any, worker_status: Callable[[], list[dict]]) -> dict[str, dict]:
    """``{"gauges": {...}, "increments": {...}}`` for the API server (empty with steering off)."""
    if gate is None:
        return {"gauges": {}, "increments": {}}
    gauges, totals = worker_values(worker_status())
    gauges["requests_waiting_for_row"] = requests_waiting_for_row(core.scheduler, gate)
    totals["row_wait_timeouts"] = gate.wait_timeouts
    totals["stop_when_stops"] = getattr(core.scheduler, "steer_stop_when_stops", 0)
    budget = getattr(core.scheduler, "steer_capture", None)
    totals["capture_throttled_steps"] = budget.throttled_steps if budget is not None else 0
    reported = getattr(core, _STATE, {})
    # A total below what was handed out means the workers restarted: all of it is new.
    increments = {k: v - reported.get(k, 0) if v >= reported.get(k, 0) else v for k, v in totals.items()}
    setattr(core, _STATE, totals)
    return {"gauges": gauges, "increments": increments}
