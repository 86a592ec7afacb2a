"""Foundation: the plugin loads in every vLLM process, the router is mounted, config reaches all."""

from __future__ import annotations

import httpx
import pytest

from tests.engine_job import run_job
from tests.server import openai_server


def test_llm_multiprocess_worker_runs_the_general_plugin(tiny_model, tmp_path):
    """With EngineCore and worker in their own process, the worker has the ops installed."""
    job = {
        "model": tiny_model("llama"),
        "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                       "additional_config": {"steer": {"max_configs": 4, "hooks": ["post_mlp"]}}},
        "rpc": ["vllm_steer_status"],
    }
    res = run_job(job, tmp_path, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    (worker,) = res["rpc"]["vllm_steer_status"]
    assert worker["pid"] != res["parent_pid"]
    assert worker["steering"] is True
    assert worker["hooks"] == ["post_mlp"] and worker["ops"] == 2  # 2 layers x 1 hook
    assert worker["rows"] == 4


def test_plugin_loaded_with_steering_off_installs_nothing(tiny_model, tmp_path):
    job = {"model": tiny_model("llama"),
           "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                          "distributed_executor_backend": "uni"},
           "rpc": ["vllm_steer_status"],
           "calls": [{"prompts": ["hello"], "params": [{"max_tokens": 2, "temperature": 0.0,
                      "extra_args": {"steering_vectors": {"post_mlp": {"0": [0.0]}}}}]}]}
    with pytest.raises(RuntimeError, match="steering is disabled on this server"):
        run_job(job, tmp_path)
    job.pop("calls")
    (worker,) = run_job(job, tmp_path)["rpc"]["vllm_steer_status"]
    assert worker["steering"] is False


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with openai_server(tiny_model("llama"), "--enforce-eager", "--additional-config", '{"steer": {"max_configs": 8}}', log=log) as (base, proc):
        yield base, proc


def test_openai_server_mounts_router_and_worker_runs_plugin(tiny_server):
    base, proc = tiny_server
    r = httpx.get(f"{base}/v1/steering", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["enabled"] is True and body["config"]["max_configs"] == 8
    (worker,) = body["workers"]
    assert worker["steering"] is True and worker["ops"] == 6
    assert worker["pid"] != proc.pid
