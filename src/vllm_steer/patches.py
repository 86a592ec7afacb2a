"""Every vLLM internal the plugin patches, in one table: target, owner module, why, when it can go.

``plugin.register()`` runs the general appliers (every process); the endpoint plugin runs the
server ones (API server only). Each applier is idempotent and inert while the ``steer`` block is
absent. ``tests/test_patch_targets.py`` checks that every target still has the parameters the
patch relies on, so a vLLM upgrade fails there, naming the target, instead of silently unsteering.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    target: str  # "module:Qualified.name" in vLLM
    params: tuple[str, ...]  # leading parameter names the patch relies on
    owner: str  # the vllm_steer module that applies it
    why: str
    until: str  # when it can go


PATCHES: tuple[Patch, ...] = (
    Patch("vllm.engine.arg_utils:EngineArgs.create_engine_config", ("self",), "vllm_steer.core.engine_config",
          "reject a malformed steer block before any process starts", "vLLM validates additional_config through plugins"),
    Patch("vllm.config:VllmConfig.compute_hash", ("self",), "vllm_steer.core.engine_config",
          "the compile-cache key must change with the plugin's data plane", "vLLM hashes plugin sources"),
    Patch("vllm.v1.engine.input_processor:InputProcessor.process_inputs", ("self", "request_id", "prompt", "params"),
          "vllm_steer.frontend.prepare",
          "every request becomes an EngineCoreRequest here, before its blocks are hashed from cache_salt",
          "vLLM offers a request-preprocessing hook"),
    Patch("vllm.v1.engine.async_llm:AsyncLLM.add_request", ("self", "request_id", "prompt", "params"),
          "vllm_steer.frontend.prepare_async",
          "the only async point before process_inputs: heavy preparation runs off the event loop",
          "vLLM moves input processing off the event loop"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.__init__", ("self",), "vllm_steer.engine.scheduler",
          "the row gate lives on the scheduler", "vLLM has an admission hook for plugins"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.schedule", ("self",), "vllm_steer.engine.scheduler",
          "steered requests whose configs do not fit the tables wait in the queue", "as above"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._free_request", ("self", "request"), "vllm_steer.engine.scheduler",
          "a finished request gives its rows back", "as above"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", ("self",), "vllm_steer.engine.scheduler",
          "requests refused after admission (row wait past steer.max_row_wait_s, a module version gone) send "
          "their final output with the step's", "vLLM lets plugins finish a request with a reason"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.finish_requests", ("self", "request_ids", "finished_status"),
          "vllm_steer.engine.scheduler", "called, not replaced (engine.refusals): finishes refused requests with FINISHED_ERROR",
          "as above"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.add_request", ("self", "request"), "vllm_steer.engine.scheduler",
          "steered requests are noted by the gate; blocks generated under a decode vector are re-keyed "
          "(wraps Request._block_hasher)", "a request can carry extra keys for generated blocks"),
    Patch("vllm.v1.core.kv_cache_utils:get_request_block_hasher", ("hash_block_size", "caching_hash_fn"),
          "vllm_steer.engine.scheduler", "the hasher the decode salt wraps (not replaced; relied on)",
          "as above"),
    Patch("vllm.v1.engine.core:EngineCore.collective_rpc", ("self", "method", "timeout", "args", "kwargs"),
          "vllm_steer.engine.module_rpc",
          "module registration pins rows in the gate; in_flight counts and /metrics values come from the scheduler",
          "vLLM has engine-side plugin RPCs"),
    Patch("vllm.v1.worker.worker_base:WorkerBase", (), "vllm_steer.runtime.worker_rpc",
          "adds vllm_steer_* methods for collective_rpc (nothing replaced)",
          "the plugin can register a worker extension itself"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", ("self",), "vllm_steer.runtime.runner_v1",
          "install the steered norms before the first forward (profile run, torch.compile)",
          "vLLM has a post-load model hook"),
    Patch("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", ("self", "load_dummy_weights"),
          "vllm_steer.runtime.runner_v1", "as above (the CPU runner overrides load_model)", "as above"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states", ("self", "scheduler_output"),
          "vllm_steer.runtime.runner_v1", "rows of new / finished requests (V1 runner)",
          "vLLM has a worker-side per-request hook"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
          ("self", "scheduler_output", "num_scheduled_tokens"), "vllm_steer.runtime.runner_v1",
          "the token -> row index and capture plan of the step (V1 runner)", "as above"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model", ("self", "scheduler_output"),
          "vllm_steer.runtime.runner_v1", "hand captured rows on once the forward is enqueued", "as above"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model", ("self", "load_dummy_weights"),
          "vllm_steer.runtime.runner_v2", "install the steered norms and swap the ModelState (V2 runner)",
          "vLLM has a post-load model hook"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.finish_requests", ("self", "scheduler_output"),
          "vllm_steer.runtime.runner_v2", "finished (not preempted) requests publish their captures",
          "vLLM has a worker-side per-request hook"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model", ("self", "scheduler_output"),
          "vllm_steer.runtime.runner_v2", "hand captured rows on once the forward is enqueued", "as above"),
    Patch("vllm.v1.worker.gpu.model_states.interface:ModelState.add_request", ("self", "req_index", "new_req_data"),
          "vllm_steer.runtime.runner_v2", "subclassed: acquire a request's rows at its slot", "as above"),
    Patch("vllm.v1.worker.gpu.model_states.interface:ModelState.remove_request", ("self", "req_id"),
          "vllm_steer.runtime.runner_v2", "subclassed: release a request's rows", "as above"),
    Patch("vllm.v1.worker.gpu.model_states.interface:ModelState.prepare_inputs", ("self", "input_batch", "req_states"),
          "vllm_steer.runtime.runner_v2",
          "subclassed: the step's token -> row index (the step_index kernel reads the batch's idx_mapping, query_start_loc "
          "and positions) and capture plan", "as above"),
    Patch("vllm.model_executor.layers.layernorm:RMSNorm.forward_native", ("self", "x", "residual"),
          "vllm_steer.runtime.install",
          "subclassed per hooked norm instance: the steered norm replaces forward with the same contract",
          "vLLM has a residual-stream hook"),
    Patch("vllm.model_executor.layers.layernorm:GemmaRMSNorm.forward_native", ("self", "x", "residual"),
          "vllm_steer.runtime.install", "as above, for Gemma's (1 + w) norms", "as above"),
    Patch("vllm.entrypoints.openai.completion.protocol:CompletionRequest.to_sampling_params", ("self",),
          "vllm_steer.server.openai_fields",
          "steering fields of the request body reach SamplingParams.extra_args (vllm_xargs is flat only)",
          "vllm_xargs accepts nested values"),
    Patch("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.to_sampling_params", ("self",),
          "vllm_steer.server.openai_fields", "as above, for chat", "as above"),
)

# Appliers, in order: "module:function". General ones run in every vLLM process (plugin.register).
GENERAL_APPLIERS = (
    "vllm_steer.core.engine_config:patch_engine_config",
    "vllm_steer.frontend.prepare:patch_input_processor",
    "vllm_steer.frontend.prepare_async:patch_async_add_request",
    "vllm_steer.engine.scheduler:patch_scheduler",
    "vllm_steer.engine.module_rpc:patch_engine_core_rpc",
    "vllm_steer.runtime.worker_rpc:patch_worker",
    "vllm_steer.runtime.runner_v1:patch_v1_runner",
    "vllm_steer.runtime.runner_v2:patch_v2_runner",
    "vllm_steer.server.openai_fields:patch_openai_requests_in_api_server",
)
# The endpoint plugin's (API server process only).
SERVER_APPLIERS = ("vllm_steer.server.openai_fields:patch_openai_requests",)


def target_params(target: str) -> list[str] | str:
    """The parameter names of a target as installed now, or ``"missing: ..."``."""
    import inspect

    mod, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return list(inspect.signature(obj).parameters) if callable(obj) and not isinstance(obj, type) else []
    except Exception as e:  # noqa: BLE001 - any import or lookup failure is the answer
        return f"missing: {type(e).__name__}: {e}"


def signature_problems() -> list[str]:
    """Targets that are gone or lost the leading parameters their patch relies on (call before
    the patches are applied: it reads the installed vLLM's originals)."""
    out = []
    for p in PATCHES:
        found = target_params(p.target)
        if isinstance(found, str) or found[: len(p.params)] != list(p.params):
            out.append(f"{p.target}: expected leading parameters {list(p.params)}, found {found}")
    return out


def _run(appliers: tuple[str, ...]) -> None:
    for ref in appliers:
        module, func = ref.split(":")
        getattr(importlib.import_module(module), func)()


def apply_general() -> None:
    _run(GENERAL_APPLIERS)


def apply_server() -> None:
    _run(SERVER_APPLIERS)
