"""Adapter for vLLM's V1 model runner (``gpu_model_runner.GPUModelRunner`` and the CPU runner).

The V1 runner is vLLM 0.26's runner on CPU (V2 needs Triton on a GPU) and on GPU with
``VLLM_USE_V2_MODEL_RUNNER=0``. Patches (listed in ``vllm_steer.patches``):
- ``load_model`` (GPUModelRunner and CPUModelRunner, which overrides it): build the runtime and
  install the steered norms before the first forward (the profile run that triggers torch.compile).
- ``_update_states``: release rows of finished requests, acquire rows of new ones. Preempted
  requests keep their rows (V1 keeps their state and resumes them as cached requests).
- ``_prepare_inputs``: write the token -> row index (and the capture plan) in the batch's order.
- ``execute_model``: after the forward is enqueued, copy the gates ``stop_when`` reads (``runtime.stop_watch``);
- ``sample_tokens``: hand captured rows to the consumers' process (their copy after the runner's output copy), and
  those gates go with the step's output.
"""

from __future__ import annotations

from vllm_steer.runtime import fp8_fusion
from vllm_steer.runtime.manager import build_runtime, with_after_forward, with_after_sample


def _patch_load_model(cls: type) -> None:
    original = cls.__dict__["load_model"]
    if getattr(original, "_vllm_steer", False):
        return

    def load_model(self, *args, **kwargs):
        fp8_fusion.register_in(self.vllm_config)  # before the model (and its compile backend) is built
        original(self, *args, **kwargs)
        build_runtime(self)

    load_model._vllm_steer = True  # type: ignore[attr-defined]
    cls.load_model = load_model


def patch_v1_runner() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _patch_load_model(GPUModelRunner)
    _patch_load_model(CPUModelRunner)
    if getattr(GPUModelRunner._update_states, "_vllm_steer", False):
        return
    orig_update, orig_prepare = GPUModelRunner._update_states, GPUModelRunner._prepare_inputs

    def _update_states(self, scheduler_output):
        rt = getattr(self, "steer_runtime", None)
        if rt is None:
            return orig_update(self, scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            rt.remove_request(req_id)
        rt.finish_requests(scheduler_output.finished_req_ids)
        rt.preemptions_seen += len(getattr(scheduler_output, "preempted_req_ids", None) or ())
        result = orig_update(self, scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            sp = new_req.sampling_params
            rt.add_request(new_req.req_id, sp.extra_args if sp is not None else None, len(new_req.prompt_token_ids or ()),
                           getattr(sp, "max_tokens", None))
        return result

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        rt = getattr(self, "steer_runtime", None)
        if rt is not None and (rt.step_work or rt.capture is not None):
            batch = self.input_batch
            n = batch.num_reqs
            if rt.step_work:
                rt.prepare_step(
                    rt.rows_of(batch.req_ids[:n]) if rt.any_steered else None,
                    num_scheduled_tokens,
                    batch.num_computed_tokens_cpu[:n],
                    batch.num_prompt_tokens[:n],
                )
            if rt.capture is not None:
                # on a CPU every step is eager: its plan is made by the forward's first capturing op
                rt.plan_capture(batch.req_ids[:n], num_scheduled_tokens, batch.num_computed_tokens_cpu[:n],
                                self.device.type == "cpu")
            if rt.stops is not None and rt.stops.watched:
                rt.stops.plan(batch.req_ids[:n], num_scheduled_tokens, batch.num_computed_tokens_cpu[:n])
        return orig_prepare(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)

    _update_states._vllm_steer = True  # type: ignore[attr-defined]
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = with_after_forward(GPUModelRunner.execute_model)
    GPUModelRunner.sample_tokens = with_after_sample(GPUModelRunner.sample_tokens)
