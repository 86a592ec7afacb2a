"""Foundation: the plugin loads in every vLLM process, the router is mounted, config reaches all."""

from __future__ import annotations

import httpx

from tests.engine_job import run_job


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
    """One engine without a steer block: its worker installs nothing, and a steered request is refused."""
    prompt = {"prompt": "hello"}
    job = {"model": tiny_model("llama"),
           "llm_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                          "distributed_executor_backend": "uni"},
           "rpc": ["vllm_steer_status"],
           "calls": [{"llm_call": "tests.engine_job:generate_error",
                      "kwargs": {"extra": {"steering_vectors": {"post_mlp": {"0": [0.0]}}}, "prompt": prompt}}]}
    res = run_job(job, tmp_path)
    (worker,) = res["rpc"]["vllm_steer_status"]
    assert worker["steering"] is False
    refused = res["calls"][0]
    assert "steering is disabled on this server" in refused.get("message", ""), refused


def test_openai_server_mounts_router_and_worker_runs_plugin(api_server):
    """The shared server (SmolLM2: 30 layers, every hook): the router answers with the config, and the one
    worker, in its own process, has a steered norm per hook and layer."""
    import psutil

    base = api_server[0]
    r = httpx.get(f"{base}/v1/steering", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["enabled"] is True and body["config"]["max_configs"] == 16
    (worker,) = body["workers"]
    assert worker["steering"] is True and worker["ops"] == 90  # 30 layers x 3 hooks
    port = httpx.URL(base).port
    (server_pid,) = {c.pid for c in psutil.net_connections(kind="tcp")
                     if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    assert worker["pid"] != server_pid
