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
