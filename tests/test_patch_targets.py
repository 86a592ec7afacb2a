"""Every vLLM internal the plugin patches still has the signature the patch was written for, so a
vLLM upgrade fails here, loudly, instead of silently unsteering. Read in a fresh process where no
plugin has been loaded, so the originals are inspected."""

from __future__ import annotations

import json
import subprocess
import sys

TARGETS = {
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs": ["self", "request_id", "prompt", "params"],
    "vllm.v1.engine.async_llm:AsyncLLM.add_request": ["self", "request_id", "prompt", "params"],
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": ["self"],
    "vllm.v1.core.sched.scheduler:Scheduler.add_request": ["self", "request"],
    "vllm.v1.core.kv_cache_utils:get_request_block_hasher": ["hash_block_size", "caching_hash_fn"],
    "vllm.v1.core.sched.scheduler:Scheduler._free_request": ["self", "request"],
    "vllm.v1.engine.core:EngineCore.collective_rpc": ["self", "method", "timeout", "args", "kwargs"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states": ["self", "scheduler_output"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs": ["self", "scheduler_output", "num_scheduled_tokens"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model": ["self", "scheduler_output"],
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model": ["self", "load_dummy_weights"],
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.finish_requests": ["self", "scheduler_output"],
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model": ["self", "scheduler_output"],
    "vllm.v1.worker.gpu.model_states.interface:ModelState.add_request": ["self", "req_index", "new_req_data"],
    "vllm.v1.worker.gpu.model_states.interface:ModelState.remove_request": ["self", "req_id"],
    "vllm.v1.worker.gpu.model_states.interface:ModelState.prepare_inputs": ["self", "input_batch", "req_states"],
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model": ["self", "load_dummy_weights"],
    "vllm.engine.arg_utils:EngineArgs.create_engine_config": ["self"],
    "vllm.entrypoints.openai.completion.protocol:CompletionRequest.to_sampling_params": ["self"],
    "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.to_sampling_params": ["self"],
}

PROBE = """
import importlib, inspect, json, sys
out = {}
for target in json.loads(sys.argv[1]):
    mod, attr = target.split(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    out[target] = list(inspect.signature(obj).parameters)
print(json.dumps(out))
"""


def test_patched_vllm_internals_keep_their_signatures():
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(TARGETS))],
                          capture_output=True, text=True, timeout=300, env={"VLLM_PLUGINS": "", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for target, prefix in TARGETS.items():
        assert found[target][: len(prefix)] == prefix, f"{target}: {found[target]}"
