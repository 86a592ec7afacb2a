"""Shared test fixtures: model paths (built offline by tests.fixtures.models) and CPU-lane env."""

from __future__ import annotations

import os

import pytest

for _k, _v in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def smollm2_path():
    from tests.fixtures.models import smollm2

    return str(smollm2())


@pytest.fixture(scope="session")
def tiny_model():
    from tests.fixtures.models import tiny_model as build

    return lambda family: str(build(family))


API_SERVER_CAP = 50_000  # steer.max_request_bytes of the shared API server
API_KEY = "sekret"  # steer.api_key of the shared API server
PRELOAD_LAYER = 5


@pytest.fixture(scope="session")
def api_server(smollm2_path, tmp_path_factory):
    """One OpenAI server (SmolLM2, float32, multi-process) for the request-API and module tests,
    with a byte cap, a module API key and a module preloaded from a safetensors file."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from tests.server import openai_server

    d = tmp_path_factory.mktemp("api")
    vec = np.linspace(-1, 1, 576, dtype=np.float32) * 30
    save_file({f"post_mlp.{PRELOAD_LAYER}": vec}, str(d / "preloaded.safetensors"), metadata={"description": "from disk"})
    cfg = json.dumps({"steer": {"max_configs": 16, "max_request_bytes": API_SERVER_CAP, "api_key": API_KEY,
                                "modules": {"preloaded": str(d / "preloaded.safetensors")}}})
    log = d / "server.log"
    with openai_server(smollm2_path, "--dtype", "float32", "--enforce-eager", "--additional-config", cfg, log=log) as (base, _):
        yield base, smollm2_path, log
