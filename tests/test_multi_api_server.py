"""``--api-server-count 2`` (README: heavy per-request traffic): every API server process prepares
steered requests, and a module preloaded from ``steer.modules`` resolves in each of them; an SAE
registration is refused (each process would keep its own list)."""

from __future__ import annotations

import json

import httpx
import numpy as np


def test_steering_through_two_api_server_processes(tiny_model, tmp_path):
    from safetensors.numpy import save_file

    from tests.server import openai_server
    from vllm_steer.client import steering_body
    from vllm_steer.core.layout import config_hash

    model = tiny_model("llama")
    hidden = json.loads(open(f"{model}/config.json").read())["hidden_size"]
    save_file({"post_mlp.1": np.full(hidden, 3.0, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    cfg = json.dumps({"steer": {"modules": {"m": str(tmp_path / "m.safetensors")}, "sae_slots": {"post_mlp.1": 8}}})
    with openai_server(model, "--dtype", "float32", "--enforce-eager", "--api-server-count", "2",
                       "--additional-config", cfg, log=tmp_path / "server.log") as (base, _):
        vec = np.full((1, hidden), 3.0, dtype=np.float32)
        want = config_hash({"post_mlp": {1: vec[0]}}, "float32")
        plain = {"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0}
        texts = set()
        for _ in range(8):  # a new connection each: the kernel spreads them over both processes
            for body in ({**plain, **steering_body({"post_mlp": (vec, [1])})},
                         {**plain, "steering_module": {"name": "m"}}):
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["steering"] == {"prefill": want, "decode": want}
                texts.add(r.json()["choices"][0]["text"])
        base_text = httpx.post(f"{base}/v1/completions", json=plain, timeout=120).json()["choices"][0]["text"]
        assert len(texts) == 1 and texts != {base_text}  # the same steering everywhere, and it steers
        sae = httpx.post(f"{base}/v1/steering/sae", json={"name": "s", "path": str(tmp_path)}, timeout=60)
        assert sae.status_code == 409 and "--api-server-count 1" in sae.json()["error"]["message"]
        log = (tmp_path / "server.log").read_text()
        assert "ApiServer_0" in log and "ApiServer_1" in log
