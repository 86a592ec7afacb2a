"""Prometheus metrics of steering, served on vLLM's own ``/metrics`` (the API process; with
``--api-server-count`` each process writes its share through prometheus_client's multiprocess
files, as vLLM's own metrics do: counters are summed over processes, gauges show the most recently
written value). Labels stay few: kinds of steering, status, top-level field. The API process counts
what it prepares and refuses; engine and worker values are fetched when ``/metrics`` is scraped
(``server.engine_metrics``) and written here by ``apply_engine``.

Every metric (counters carry the ``_total`` suffix; engine values are engine 0's under data parallel):
- ``vllm_steer_requests_total{kind}`` counter: requests whose steering fields were prepared, once per
  kind they carry (vectors, module, sae, capture).
- ``vllm_steer_rejected_total{status,field}`` counter: requests refused before vLLM saw them.
- ``vllm_steer_prepare_seconds`` histogram: time to decode, check and hash a request's steering fields.
- ``vllm_steer_rows_in_use`` gauge: steering-table rows holding a live config. Rows are shared by all
  hooks (one config = one row in every hook's table), so this and the capacity are not per hook.
- ``vllm_steer_rows_capacity`` gauge: rows for distinct configs (``max_configs - 1``).
- ``vllm_steer_rows_in_use_peak`` gauge: most rows in use at once since the engine started.
- ``vllm_steer_requests_waiting_for_row`` gauge: steered requests the scheduler holds back until a row frees.
- ``vllm_steer_row_evictions_total`` counter: cached configs (released, or a module's pre-materialized
  rows) whose row was taken for another config.
- ``vllm_steer_row_wait_timeouts_total`` counter: steered requests refused (503) after waiting
  ``steer.max_row_wait_s`` for a row.
- ``vllm_steer_stop_when_stops_total`` counter: requests finished by their condition's ``stop_when``.
- ``vllm_steer_capture_throttled_steps_total`` counter: steps whose token budget was lowered so capturing
  prefills fit the workers' capture pool (``engine.capture_budget``).
- ``vllm_steer_row_uploads_total`` counter: configs written into the tables (a config whose row is
  still resident is not written again).
- ``vllm_steer_row_upload_bytes_total`` counter: bytes those uploads copied into the tables (per
  touched hook its whole ``[layers, hidden]`` row; per touched SAE site its code, value and mode
  words), summed over workers.
- ``vllm_steer_capture_rows_total``, ``..._capture_dropped_rows_total``, ``..._capture_dropped_packets_total``,
  ``..._capture_lost_rows_total`` (those packets' rows, once per consumer that wanted them),
  ``..._capture_dropped_finishes_total``, ``..._capture_consumer_errors_total``,
  ``..._capture_ring_full_total``, ``..._capture_consumer_host_deaths_total``,
  ``..._capture_result_push_failed_total`` counters: residual rows captured, rows dropped (step pool full),
  packets dropped (consumer queue or shared ring full), finished requests not handed to a stuck consumer,
  consumer calls that raised, steps the shared ring to the consumers' process had no room for, consumers'
  processes that died, driver results not sent to the submitting process; summed over workers.
- ``vllm_steer_capture_reduced_requests_total``, ``..._capture_reduce_fallbacks_total`` counters: requests whose
  capture was reduced on the device (``runtime.capture_reduce``), and those that found its rows all held and
  went step by step instead.
- ``vllm_steer_capture_plans_in_forward_total`` counter: eager steps (prefills above the CUDA graph sizes) whose
  capture plan was made by their forward's first capturing op (``runtime.capture.CaptureRuntime.defer_step``); it
  stops growing when a worker went back to planning before the forward (its log says why).
- ``vllm_steer_capture_write_errors_total``, ``..._capture_dropped_writes_total``, ``..._capture_failed_requests_total``
  counters: consumers' own counts (their ``stats()``; the filesystem consumer's): writes that failed (disk
  full), row packets dropped because the writer queue was full, requests marked failed; summed over workers.
- ``vllm_steer_preemptions_total`` counter: requests the scheduler preempted (steered ones keep their rows).
- ``vllm_steer_engine_metrics_updated_seconds`` gauge: Unix time of the engine's last answer (older
  than the scrape: the engine did not answer in time and the engine values are the last ones).
- ``vllm_steer_api_loop_stalls_total`` counter: times an API process's event loop ran nothing for
  ``steer.loop_stall_warn_s`` (``server.loop_watch``, which logs where it was blocked).
- ``vllm_steer_modules`` gauge: named modules in this API process's store; ``vllm_steer_saes`` gauge:
  SAEs requests may clamp (``steer.sae`` and registered ones).
- ``vllm_steer_sae_slots{state}`` gauge: sites ``steer.sae_slots`` reserves for runtime SAEs, ``held`` by one or
  ``free``; ``vllm_steer_sae_registrations_refused_total{status,field}`` counter: runtime SAE registrations
  refused (409 ``site``: every reserved site it names is taken, or still in use).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("vllm_steer_requests", "Requests whose steering fields were prepared, by what they carry "
                   "(a request counts once per kind)", ["kind"])
REJECTED = Counter("vllm_steer_rejected", "Requests refused before vLLM saw them, by status and top-level field",
                   ["status", "field"])
PREPARE_SECONDS = Histogram("vllm_steer_prepare_seconds", "Time to decode, check and hash a request's steering "
                            "fields (off the event loop; refused ones too)",
                            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
_KINDS = {"steering_vectors": "vectors", "prefill_steering_vectors": "vectors", "decode_steering_vectors": "vectors",
          "steering_module": "module", "sae": "sae", "capture": "capture", "steering_condition": "condition",
          "steering_projections": "projections", "prefill_steering_projections": "projections",
          "decode_steering_projections": "projections"}


def _gauge(name: str, doc: str) -> Gauge:
    return Gauge(name, doc, multiprocess_mode="mostrecent")


ROWS_CAPACITY = _gauge("vllm_steer_rows_capacity", "Steering-table rows for distinct configs (max_configs - 1); "
                       "rows are shared by all hooks: one config is one row in every hook's table")
MODULES = _gauge("vllm_steer_modules", "Named steering modules registered (this API process's store)")
SAES = _gauge("vllm_steer_saes", "SAEs requests may clamp (steer.sae and registered ones, this API process)")
SAE_SLOTS = Gauge("vllm_steer_sae_slots", "Sites steer.sae_slots reserves for runtime SAEs, held by one or free "
                  "(this API process's view)", ["state"], multiprocess_mode="mostrecent")
SAE_REFUSED = Counter("vllm_steer_sae_registrations_refused", "Runtime SAE registrations refused, by status and "
                      "field (409 site: the reserved site is taken or still in use)", ["status", "field"])
ENGINE_UPDATED = _gauge("vllm_steer_engine_metrics_updated_seconds",
                        "Unix time of the engine's last answer to a /metrics scrape (older: values are the last ones)")
ENGINE_GAUGES = {
    "rows_in_use": _gauge("vllm_steer_rows_in_use", "Steering-table rows holding a live config; rows are shared by "
                          "all hooks (one config is one row in every hook's table), so this is not per hook"),
    "rows_in_use_peak": _gauge("vllm_steer_rows_in_use_peak", "Most steering-table rows in use at once since start"),
    "requests_waiting_for_row": _gauge("vllm_steer_requests_waiting_for_row",
                                       "Steered requests the scheduler holds back until a steering-table row frees"),
}
ENGINE_COUNTERS = {
    "row_uploads": Counter("vllm_steer_row_uploads", "Steering configs written into the device tables (a config "
                           "whose row is still resident is not written again)"),
    "row_upload_bytes": Counter("vllm_steer_row_upload_bytes", "Bytes copied into the steering tables by row uploads "
                                "(a touched hook's whole [layers, hidden] row; a touched SAE site's code, value "
                                "and mode words), summed over workers"),
    "row_evictions": Counter("vllm_steer_row_evictions", "Cached steering configs (released ones, modules' "
                             "pre-materialized rows) whose row was taken for another config"),
    "row_wait_timeouts": Counter("vllm_steer_row_wait_timeouts", "Steered requests refused (503) after waiting "
                                 "steer.max_row_wait_s for a steering-table row"),
    "stop_when_stops": Counter("vllm_steer_stop_when_stops", "Requests finished by their steering_condition's "
                               "stop_when (finish_reason stop_when)"),
    "capture_rows": Counter("vllm_steer_capture_rows", "Residual rows captured, summed over workers"),
    "capture_throttled_steps": Counter("vllm_steer_capture_throttled_steps",
                                       "Steps whose token budget the scheduler lowered so capturing prefills' rows "
                                       "fit steer.capture_max_rows (engine.capture_budget)"),
    "capture_dropped_rows": Counter("vllm_steer_capture_dropped_rows",
                                    "Residual rows not captured because the step's pool was full"),
    "capture_dropped_packets": Counter("vllm_steer_capture_dropped_packets",
                                       "Captured packets dropped because the consumers' queue was full"),
    "capture_lost_rows": Counter("vllm_steer_capture_lost_rows",
                                 "Captured rows a consumer did not get because their packet was dropped (its queue or "
                                 "the shared ring full), counted once per consumer that wanted them"),
    "capture_dropped_finishes": Counter("vllm_steer_capture_dropped_finishes",
                                        "Finished requests not handed to a stuck capture consumer (its queue full)"),
    "capture_consumer_errors": Counter("vllm_steer_capture_consumer_errors", "Capture consumer calls that raised"),
    "capture_write_errors": Counter("vllm_steer_capture_write_errors",
                                    "Capture consumer writes that failed (disk full, ...): the request's capture failed"),
    "capture_dropped_writes": Counter("vllm_steer_capture_dropped_writes",
                                      "Row packets a capture consumer dropped because its writer queue was full"),
    "capture_failed_requests": Counter("vllm_steer_capture_failed_requests",
                                       "Requests whose capture a consumer marked failed (nothing of it published)"),
    "capture_ring_full": Counter("vllm_steer_capture_ring_full", "Steps whose captured rows found no room in the "
                                 "shared ring to the consumers' process (dropped for their consumers)"),
    "capture_consumer_host_deaths": Counter("vllm_steer_capture_consumer_host_deaths",
                                            "Capture consumers' processes that died (capture disabled for them)"),
    "capture_reduced_requests": Counter("vllm_steer_capture_reduced_requests",
                                        "Requests whose capture was reduced on the device (steer.capture_reduce_rows)"),
    "capture_reduce_fallbacks": Counter("vllm_steer_capture_reduce_fallbacks",
                                        "Requests sent rows step by step because the device-reduce rows were all held"),
    "capture_plans_in_forward": Counter("vllm_steer_capture_plans_in_forward",
                                        "Eager steps whose capture plan was made inside their forward"),
    "capture_result_push_failed": Counter("vllm_steer_capture_result_push_failed",
                                          "Driver capture results a worker could not send to the submitting process"),
    "preemptions": Counter("vllm_steer_preemptions", "Requests the scheduler preempted (steered ones keep their rows)"),
}


def count_request(fields: dict) -> None:
    """One prepared request: a count per kind of steering field it carries."""
    for kind in {_KINDS[k] for k, v in fields.items() if k in _KINDS and v is not None}:
        REQUESTS.labels(kind).inc()


def count_rejected(status: int, param: str | None) -> None:
    field = (param or "body").split(".")[0].split("[")[0]
    REJECTED.labels(str(status), field if field in _KINDS or field in ("body", "vllm_xargs") else "other").inc()


def apply_engine(report: dict) -> None:
    """Write one answer of ``collective_rpc("vllm_steer_metrics")`` (``engine.metrics_rpc``)."""
    for name, value in report.get("gauges", {}).items():
        if name in ENGINE_GAUGES:
            ENGINE_GAUGES[name].set(value)
    for name, value in report.get("increments", {}).items():
        if name in ENGINE_COUNTERS and value > 0:
            ENGINE_COUNTERS[name].inc(value)
    ENGINE_UPDATED.set_to_current_time()
