"""Wires the engine-core pieces into vLLM's ``Scheduler`` (targets listed in vllm_steer.patches).

- ``__init__``: a RowGate when steering is on (none otherwise: every other wrapper is then one check);
- ``add_request``: a steered request is noted by the gate, and its block hasher wrapped when its
  generated KV must not be shared (decode_block_salt); unsteered requests pass untouched;
- ``schedule``: only while steered requests wait, set aside those whose configs do not fit, and
  admit the steered ones that were scheduled;
- ``_free_request``: a finished request gives its rows back.
"""

from __future__ import annotations

from vllm_steer.core.compat import waiting_queues
from vllm_steer.core.config import steer_config_of
from vllm_steer.core.payload import payload_keys, payload_of
from vllm_steer.engine.decode_block_salt import DecodeSaltedHasher, decode_salt_key
from vllm_steer.engine.row_gate import RowGate


def patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_vllm_steer", False):
        return
    orig_init, orig_add = Scheduler.__init__, Scheduler.add_request
    orig_schedule, orig_free = Scheduler.schedule, Scheduler._free_request

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        cfg = steer_config_of(self.vllm_config)
        self.steer_gate = RowGate(cfg.usable_rows) if cfg is not None else None

    def add_request(self, request):
        gate: RowGate | None = self.steer_gate
        if gate is not None:
            payload = payload_of(request.sampling_params)
            if payload:
                gate.arrive(request.request_id, payload_keys(payload))
                hasher = getattr(request, "_block_hasher", None)
                key = decode_salt_key(payload)
                if key is not None and hasher is not None and not isinstance(hasher, DecodeSaltedHasher):
                    request._block_hasher = DecodeSaltedHasher(hasher, key, self.hash_block_size)
        return orig_add(self, request)

    def schedule(self, *args, **kwargs):
        gate: RowGate | None = self.steer_gate
        if gate is None or not gate.waiting:
            return orig_schedule(self, *args, **kwargs)
        set_aside = []
        for queue in waiting_queues(self):
            held = gate.select_held(list(queue))
            if held:
                queue.remove_requests(held)
                set_aside.append((queue, held))
        try:
            out = orig_schedule(self, *args, **kwargs)
        finally:
            for queue, held in set_aside:
                for req in reversed(held):
                    queue.prepend_request(req)
        gate.admit_scheduled(r.req_id for r in out.scheduled_new_reqs)
        return out

    def _free_request(self, request, *args, **kwargs):
        if self.steer_gate is not None:
            self.steer_gate.release(request.request_id)
        return orig_free(self, request, *args, **kwargs)

    schedule._vllm_steer = True  # type: ignore[attr-defined]
    Scheduler.__init__ = __init__
    Scheduler.add_request = add_request
    Scheduler.schedule = schedule
    Scheduler._free_request = _free_request
