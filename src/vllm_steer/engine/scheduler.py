"""Wires the engine-core pieces into vLLM's ``Scheduler`` (targets listed in vllm_steer.patches).

- ``__init__``: a RowGate when steering is on (none otherwise: every other wrapper is then one check);
- ``add_request``: a steered request is noted by the gate, and its block hasher wrapped when its
  generated KV must not be shared (decode_block_salt); a request whose rows must be built from a
  named module version the workers no longer hold, or clamping with a runtime SAE registration
  that was deleted or replaced since it was prepared, is refused (``engine.refusals``); unsteered
  requests pass untouched;
- ``schedule``: only while steered requests wait, set aside those whose configs do not fit, refuse
  those set aside past ``steer.max_row_wait_s``, and admit the steered ones that were scheduled; only
  while capturing requests are unfinished, cap the step's tokens so their cells fit the workers'
  capture pool (``engine.capture_budget``);
- ``update_from_output``: refused requests' final outputs go out with the step's; the requests the
  workers' ``stop_when`` watch stopped (``runtime.stop_watch``) are noted for
- ``_update_request_with_output``: which finishes them as a stop token would (``core.stops``);
- ``_free_request``: a finished request gives its rows (and its capture cost) back.
"""

from __future__ import annotations

import time

from vllm_steer.core.compat import waiting_queues
from vllm_steer.core.config import steer_config_of
from vllm_steer.core.payload import PayloadError, SteerPayload, request_payload
from vllm_steer.core.refusals import Refusal
from vllm_steer.core.stops import encode as encode_stop
from vllm_steer.core.vectors import MODULE_FIELD, SAE_FIELD
from vllm_steer.engine.capture_budget import CaptureBudget
from vllm_steer.engine.decode_block_salt import DecodeSaltedHasher, decode_salt_key
from vllm_steer.engine.module_registry import registry_of
from vllm_steer.engine.refusals import flush, refuse
from vllm_steer.engine.row_gate import RowGate


def _row_wait_refusal(gate: RowGate, waited: float) -> Refusal:
    return Refusal(503, None, (
        f"waited {waited:.2f} s for a steering-table row: none became free within {gate.max_wait_s:g} s "
        f"(steer.max_row_wait_s): all "
        f"{gate.capacity} rows (steer.max_configs - 1) hold the configs of running requests; retry later"))


def _gone_module(payload: SteerPayload, registries: object) -> Refusal | None:
    """A refusal if the request's rows must be built from a module version no worker holds any more
    (replaced through another API process while this request was on its way)."""
    module = payload.module
    if module is None or all(k in payload.configs for k in payload.keys):
        return None  # no module, or every row travels with the request
    if registry_of(registries).holds(module.name, module.version):
        return None
    return Refusal(400, f"{MODULE_FIELD}.name", f"steering module {module.name!r} changed while this request "
                                                f"was prepared (version {module.version} is gone); send it again")


def _gone_sae(payload: SteerPayload, registries: object) -> Refusal | None:
    """A refusal if a runtime SAE the request clamps with is no longer the registration it was prepared
    against: deleted, or replaced at its site through another API process while this request was on its
    way (the workers hold only the current weights, so it would clamp with another SAE's)."""
    versions = payload.sae_versions
    if not versions:
        return None
    registry = registry_of(registries, "sae")
    for name, version in versions.items():
        if registry.current(name) != version:
            return Refusal(400, f"{SAE_FIELD}.name", f"SAE {name!r} was deleted or replaced while this request was "
                                                     f"on its way (registration {version} is gone); send it again")
    return None


def patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_vllm_steer", False):
        return
    orig_init, orig_add = Scheduler.__init__, Scheduler.add_request
    orig_schedule, orig_free = Scheduler.schedule, Scheduler._free_request
    orig_update, orig_update_request = Scheduler.update_from_output, Scheduler._update_request_with_output

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        cfg = steer_config_of(self.vllm_config)
        self.steer_gate = RowGate(cfg.usable_rows, cfg.max_row_wait_s) if cfg is not None else None
        self.steer_capture = CaptureBudget(cfg.capture_max_rows) if cfg is not None and cfg.capture else None
        self.steer_outbox = []  # (request, Refusal) finished by us, their outputs not sent yet
        self.steer_stops = None  # request id -> gate: this step's stop_when stops (runtime.stop_watch)
        self.steer_stop_when_stops = 0  # requests stop_when finished (on /metrics)

    def add_request(self, request):
        gate: RowGate | None = self.steer_gate
        refusal = None
        if gate is not None:
            try:
                payload = request_payload(request)
            except PayloadError as e:  # not ours (another vllm-steer version in the API process?): never run it
                payload, refusal = None, Refusal(500, None, str(e))
            if payload is not None:
                gate.arrive(request.request_id, payload.keys)
                if self.steer_capture is not None:
                    self.steer_capture.arrive(request.request_id, payload.capture_rows)
                hasher = getattr(request, "_block_hasher", None)
                key = decode_salt_key(payload)
                if key is not None and hasher is not None and not isinstance(hasher, DecodeSaltedHasher):
                    request._block_hasher = DecodeSaltedHasher(hasher, key, self.hash_block_size)
                refusal = _gone_module(payload, self) or _gone_sae(payload, self)
        out = orig_add(self, request)
        if refusal is not None:
            refuse(self, [request.request_id], refusal)
        return out

    def schedule(self, *args, **kwargs):
        budget: CaptureBudget | None = self.steer_capture
        cap = (budget.token_cap(self.requests, self.running, getattr(self, "num_spec_tokens", 0))
               if budget is not None and budget.costs else None)  # no capturing request: nothing per step
        if cap is None or cap >= self.max_num_scheduled_tokens:
            return _schedule(self, *args, **kwargs)
        full = self.max_num_scheduled_tokens
        self.max_num_scheduled_tokens = cap
        try:
            return _schedule(self, *args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = full

    def _schedule(self, *args, **kwargs):
        gate: RowGate | None = self.steer_gate
        if gate is None or not gate.waiting:
            return orig_schedule(self, *args, **kwargs)
        now = time.monotonic()
        set_aside, expired = [], []
        for queue in waiting_queues(self):
            held = gate.select_held(list(queue))
            if held:
                held, late = gate.split_expired(held, now)
                expired += late
                if held:
                    queue.remove_requests(held)
                    set_aside.append((queue, held))
        for req in expired:
            refuse(self, [req.request_id], _row_wait_refusal(gate, gate.waited(req.request_id, now)))
        try:
            out = orig_schedule(self, *args, **kwargs)
        finally:
            for queue, held in set_aside:
                for req in reversed(held):
                    queue.prepend_request(req)
        gate.admit_scheduled(r.req_id for r in out.scheduled_new_reqs)
        return out

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        self.steer_stops = getattr(model_runner_output, "vllm_steer_stops", None) or None
        try:
            outputs = orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        finally:
            self.steer_stops = None
        if self.steer_outbox:
            flush(self, outputs)
        return outputs

    def _update_request_with_output(self, request, new_token_ids, *args, **kwargs):
        stops = self.steer_stops
        if not stops:  # every request of every step: no stop_when stop this step, vLLM's call as is
            return orig_update_request(self, request, new_token_ids, *args, **kwargs)
        new_token_ids, stopped = orig_update_request(self, request, new_token_ids, *args, **kwargs)
        if not stopped and new_token_ids and request.request_id in stops:
            from vllm.v1.request import RequestStatus

            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = encode_stop(stops[request.request_id])
            self.steer_stop_when_stops += 1
            stopped = True
        return new_token_ids, stopped

    def _free_request(self, request, *args, **kwargs):
        if self.steer_gate is not None:
            self.steer_gate.release(request.request_id)
        if self.steer_capture is not None:
            self.steer_capture.release(request.request_id)
        return orig_free(self, request, *args, **kwargs)

    schedule._vllm_steer = True  # type: ignore[attr-defined]
    Scheduler.__init__ = __init__
    Scheduler.add_request = add_request
    Scheduler.schedule = schedule
    Scheduler.update_from_output = update_from_output
    Scheduler._update_request_with_output = _update_request_with_output
    Scheduler._free_request = _free_request
