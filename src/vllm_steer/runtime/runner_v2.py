"""Adapter for vLLM's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``).

After the model is loaded and before its first forward (the profile run, which triggers
torch.compile), build the SteeringRuntime, install the steered norms, and swap the runner's
ModelState for a subclass that feeds the runtime from ``add_request`` / ``remove_request`` /
``prepare_inputs``. A request's rows go into the per-slot device table (``SlotRows``, by vLLM's
request slot) when it arrives; each steered step builds the token -> row index on the device from
vLLM's ``idx_mapping``, ``query_start_loc`` and ``positions`` (``step_index``): no host work per
step that grows with the batch. A capturing step's plan is left to its forward when no CUDA graph replays it
(``graph_max_tokens``: the batch is above the largest captured size; ``runtime.capture.CaptureRuntime.defer_step``).
The patched targets and why are listed in ``vllm_steer.patches``.
"""

from __future__ import annotations

from typing import Any

from vllm_steer.runtime import fp8_fusion
from vllm_steer.runtime.manager import SteeringRuntime, build_runtime, with_after_forward, with_after_sample
from vllm_steer.runtime.slot_rows import SlotRows

_STEERED_STATE_CLASSES: dict[type, type] = {}


def graph_max_tokens(compilation: Any) -> int:
    """The most tokens a CUDA graph of this runner replays (-1: none): a batch above it runs eagerly, the ops' Python
    called (vLLM's ``ModelCudaGraphManager.dispatch`` has graphs only for the captured sizes, all at most
    ``max_cudagraph_capture_size``)."""
    mode = compilation.cudagraph_mode
    if mode is None or mode.name == "NONE":
        return -1
    return compilation.max_cudagraph_capture_size or 0


def _steered_model_state_class(base: type) -> type:
    cls = _STEERED_STATE_CLASSES.get(base)
    if cls is not None:
        return cls

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        base.add_request(self, req_index, new_req_data)
        sp = new_req_data.sampling_params
        rt = self._steer_runtime
        prompt_len = len(new_req_data.prompt_token_ids or ())
        rows = rt.add_request(new_req_data.req_id, sp.extra_args if sp is not None else None, prompt_len,
                              getattr(sp, "max_tokens", None))
        self._steer_slots.set(req_index, rows, prompt_len)
        self._steer_slot_of[new_req_data.req_id] = req_index

    def remove_request(self, req_id: str) -> None:
        slot = self._steer_slot_of.pop(req_id, None)
        if slot is not None:
            self._steer_slots.clear(slot)
        self._steer_runtime.remove_request(req_id)
        base.remove_request(self, req_id)

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        rt = self._steer_runtime
        if rt.step_work:  # nothing (one attribute check) while no request is steered
            # vLLM's prepare_inputs has written this step's idx_mapping, query_start_loc and positions
            rt.index_on_device(self._steer_slots, input_batch.idx_mapping, input_batch.query_start_loc,
                               input_batch.positions, input_batch.num_reqs, input_batch.num_tokens_after_padding)
        if rt.capture is not None:
            rt.plan_capture(input_batch.req_ids, input_batch.num_scheduled_tokens,
                            input_batch.num_computed_tokens_np,
                            input_batch.num_tokens_after_padding > graph_max_tokens(self._steer_compilation))
        if rt.stops is not None and rt.stops.watched:  # steering_condition.stop_when (runtime.stop_watch)
            rt.stops.plan(input_batch.req_ids, input_batch.num_scheduled_tokens, input_batch.num_computed_tokens_np)
        return base.prepare_inputs(self, input_batch, req_states)

    cls = type(
        f"Steered{base.__name__}",
        (base,),
        {"add_request": add_request, "remove_request": remove_request, "prepare_inputs": prepare_inputs},
    )
    _STEERED_STATE_CLASSES[base] = cls
    return cls


def attach_runtime(runner: Any) -> SteeringRuntime | None:
    """Build the runtime for a V2 runner whose model was just loaded (None: steering off)."""
    runtime = build_runtime(runner)
    if runtime is None:
        return None
    state = runner.model_state
    if getattr(state, "_steer_runtime", None) is runtime:
        return runtime  # the same runtime again (load_model(model=...)): the state already feeds it
    state.__class__ = _steered_model_state_class(type(state))
    state._steer_runtime = runtime
    state._steer_slots = SlotRows(runner.max_num_reqs, runner.device)
    state._steer_slot_of = {}
    state._steer_compilation = runner.compilation_config  # its graph sizes are resolved later (initialize_kv_cache)
    runtime.index_on_device_warmup(state._steer_slots, getattr(runner, "input_buffers", None))
    return runtime


def patch_v2_runner() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    if getattr(GPUModelRunner.load_model, "_vllm_steer", False):
        return
    original = GPUModelRunner.load_model

    def load_model(self, *args, **kwargs):
        fp8_fusion.register_in(self.vllm_config)  # before the model (and its compile backend) is built
        original(self, *args, **kwargs)
        attach_runtime(self)

    load_model._vllm_steer = True  # type: ignore[attr-defined]
    GPUModelRunner.load_model = load_model
    orig_finish, orig_execute = GPUModelRunner.finish_requests, GPUModelRunner.execute_model

    def finish_requests(self, scheduler_output):
        rt = getattr(self, "steer_runtime", None)
        if rt is not None:  # finished, not merely preempted
            rt.finish_requests(scheduler_output.finished_req_ids)
        return orig_finish(self, scheduler_output)

    GPUModelRunner.finish_requests = finish_requests
    GPUModelRunner.execute_model = with_after_forward(orig_execute)
    GPUModelRunner.sample_tokens = with_after_sample(GPUModelRunner.sample_tokens)
