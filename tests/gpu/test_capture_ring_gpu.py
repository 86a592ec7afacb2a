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


def test_device_reduced_last_and_mean_through_the_ring_equal_the_streams(monkeypatch):
    """bf16 pool on the GPU: ``activations`` reduced on the device (mean: float32 sums, index_add_ after the
    forward; last: planned straight to its slot, or copied from a row another consumer holds), gathered
    at the finish and copied through the pinned ring on the capture stream, equals the streams' mean / last."""
    from tests.test_capture_lanes import Sent
    from vllm_steer.capture.activations import ActivationStats, decode_result
    from vllm_steer.core.config import SteerConfig
    from vllm_steer.runtime import capture as capture_mod

    monkeypatch.setattr(capture_mod, "consumer_class", lambda name: ActivationStats)
    hidden, sites = 256, [("post_mlp", 0), ("post_mlp", 1)]
    cfg = SteerConfig.model_validate({"capture": ["activations", {"name": "activations", "instance": "act2"}],
                                      "capture_max_rows": 64, "capture_reduce_rows": 16})
    rt = capture_mod.CaptureRuntime(cfg, sites, 2, 64, hidden, torch.bfloat16, torch.device("cuda"))
    try:
        rt._pusher = sent = Sent()
        spec = {"layers": [0, 1], "hooks": ["post_mlp"], "positions": "all"}
        meta = {"capture_reply": "ipc://inbox"}
        rt.add_request("a", {"activations": {**spec, "reduce": "mean"}, "act2": {**spec, "reduce": "last"}}, 10, meta)
        rt.add_request("b", {"act2": {**spec, "reduce": "last"}}, 10, meta)
        assert rt.stats["reduced_requests"] == 2
        gen = torch.Generator(device="cuda").manual_seed(0)
        streams = {rid: torch.randn(2, 15, hidden, device="cuda", generator=gen).bfloat16() for rid in "ab"}
        for step in range(6):
            n, first = (10, 0) if step == 0 else (1, 9 + step)
            rt.plan_step(["a", "b"], np.array([n, n]), np.array([first, first]))
            plan = rt.buffers.plan[:, : 2 * n].long()
            values = torch.cat([streams[rid][:, first : first + n] for rid in "ab"], dim=1)  # [sites, tokens, D]
            hit = plan >= 0
            rt.buffers.pool.index_put_((plan[hit],), values[hit])  # what the norms store
            rt.after_forward()
        rt.finish_request("a"), rt.finish_request("b")
        deadline = time.monotonic() + 60
        def merged(rid):
            return {k: v for _, r in sent.of(rid) for k, v in r.items()}

        while (len(merged("a")) < 2 or not merged("b")) and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid, inst, reduce in (("a", "activations", "mean"), ("a", "act2", "last"), ("b", "act2", "last")):
            res = merged(rid)[inst]
            got = decode_result(res)
            for s, (hook, layer) in enumerate(sites):
                rows = streams[rid][s].double().cpu().numpy()
                want = rows.mean(axis=0) if reduce == "mean" else rows[-1]
                np.testing.assert_allclose(got[f"{hook}.{layer}"], want, rtol=1e-5, atol=1e-5, err_msg=f"{rid} {inst}")
            assert res["count"] == [15, 15]
        assert rt._reduce.free == 16 and rt.stats["rows"] == 0  # nothing went to the host step by step
    finally:
        rt.close()
