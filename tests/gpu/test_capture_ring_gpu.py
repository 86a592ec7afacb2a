"""GPU: captured rows reach the consumers' process through the pinned shared ring exactly (bf16), with
the copy on the capture stream ordered after the forward that wrote the pool and before the next."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_rows_through_the_pinned_ring_equal_the_pool(monkeypatch):
    from tests import lane_consumers
    from tests.test_capture_lanes import Sent
    from vllm_steer.core.config import SteerConfig
    from vllm_steer.runtime import capture as capture_mod

    monkeypatch.setattr(capture_mod, "consumer_class", {"summing": lane_consumers.Summing}.__getitem__)
    hidden, steps, toks = 4096, 50, 48
    cfg = SteerConfig.model_validate({"capture": ["summing"], "capture_max_rows": 64})
    rt = capture_mod.CaptureRuntime(cfg, [("post_mlp", 0)], 1, 64, hidden, torch.bfloat16, torch.device("cuda"))
    try:
        assert rt._host.rows.is_pinned()
        spec = {"layers": [0], "hooks": ["post_mlp"], "positions": "all"}
        rt._pusher = sent = Sent()  # what the worker would push to the submitter
        rt.add_request("a", {"summing": spec}, prompt_len=toks, meta={"capture_reply": "ipc://inbox"})
        want = 0.0
        big = torch.randn(8192, 8192, device="cuda")
        for s in range(steps):
            rt.plan_step(["a"], np.array([toks]), np.array([s * toks]))
            big = big @ big / 8192  # a slow "forward" ahead of the pool write on the same stream
            rows = torch.full((toks, hidden), float(s % 7) + 0.5, device="cuda", dtype=torch.bfloat16) + big[:toks, :hidden].abs().clamp(max=0).bfloat16()
            rt.buffers.pool[:toks].copy_(rows)
            want += float(rows.double().sum())
            rt.after_forward()
        rt.finish_request("a")
        deadline = time.monotonic() + 60
        while not sent.of("a") and time.monotonic() < deadline:
            time.sleep(0.05)
        site = sent.of("a")[-1][1]["summing"]["sites"]["post_mlp.0"]
        assert site[0] == list(range(steps * toks)) and site[1] == want and site[2] == "float32"
        assert rt.stats["ring_full"] == 0 and rt.stats["dropped_packets"] == 0
    finally:
        rt.close()
