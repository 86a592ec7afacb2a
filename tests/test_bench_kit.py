"""The A/B kit's pieces that need no GPU (bench/abkit): the trace parser of the graph phase and of the
decode-graph check (tests/gpu_e2e/trace_kernels.py) on synthetic traces (graph launches; an eager timeline with
gaps and copies), the graph phase's prefill rows, the single-site arms' request fields
and packed vectors, the paired statistics, and (with the peer wheel in .whl/peer/) the hotwire server's set-up
and its vector files read back by hotwire's own loader, and bench/gpu_lanes.sh's lanes (with a stand-in session
script). The GPU run of the suite is bench/gpu_session.sh."""

from __future__ import annotations

import base64
import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.engine_job import ROOT
from tests.gpu_e2e.trace_kernels import analyze_events, parse_trace

if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

from abkit.arms import (ARMS, arm_fields, arm_modules, build_bodies, ctx_site, expects_steering_field,  # noqa: E402
                        hotwire_field, module_name, steer_vectors)
from abkit.report import METRICS, ab_tables, paired_pct  # noqa: E402
from abkit.servers import N_SITE, PEER_SERVER, SHAPES, server_unavailable, site_layer  # noqa: E402

PEER_WHEELS = sorted((ROOT / ".whl" / "peer").glob("hotwire_vllm-*.whl"))


@pytest.fixture
def ctx() -> dict:
    shape = SHAPES["tiny"]
    return {"shape": shape, "std": 0.05, "pack_dtype": "bfloat16", "site_layer": site_layer(8, shape)}


def test_the_trace_parser_counts_kernels_per_graph_launch(tmp_path):
    """3 graph launches (5, 5 and 7 kernels), 2 eager kernels, steering kernels by name, the forward's all-reduce
    kernels by name (FlashInfer's fused one and NCCL's; the smaller launch's custom all-reduce is no forward's)."""
    ev: list[dict] = []
    ts = [0.0]

    def x(name, cat, corr, dur=2.0):
        ts[0] += 3.0
        ev.append({"ph": "X", "name": name, "cat": cat, "ts": ts[0], "dur": dur, "args": {"correlation": corr}})

    fused = "allreduce_fusion_kernel_oneshot_lamport<__nv_bfloat16, 2>"
    nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    for corr, n, steer_names, comm in ((10, 5, ["triton_red_fused_add_rms_norm_Steer_0"], ["cross_device_reduce"]),
                                       (20, 5, ["vs_capture_rows"], []),
                                       (30, 7, ["_steered_norm_kernel"], [fused, nccl])):
        x("cudaGraphLaunch", "cuda_runtime", corr, 1.0)
        for i in range(n - len(steer_names) - len(comm)):
            x(f"gemm_{i}", "kernel", corr)
        for c in comm:
            x(c, "kernel", corr)
        for s in steer_names:
            x(s, "kernel", corr, 4.0)
    x("cudaLaunchKernel", "cuda_runtime", 40, 1.0)
    x("apply_steering_kernel", "kernel", 40, 10.0)
    x("cudaLaunchKernel", "cuda_runtime", 41, 1.0)
    x("elementwise_kernel", "kernel", 41)
    ev.append({"ph": "X", "name": "gpu_memcpy", "cat": "gpu_memcpy", "ts": 1.0, "dur": 1.0,
               "args": {"correlation": 10}})  # not a kernel: not counted
    ev.append({"ph": "i", "name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 1.0})  # not an X event
    p = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    r = parse_trace(p)
    want = {"kernels": 19, "graph_launches": 3, "kernels_per_launch_hist": {"5": 2, "7": 1},
            "kernels_per_step": 5, "graph_kernels": 17, "eager_kernels": 2, "eager_kernel_us": 12.0,
            "steer_kernels": 4, "steer_kernel_us": 22.0, "steer_kernels_in_graphs": 3, "steer_kernels_eager": 1,
            "steer_kernels_per_step": 1, "kernel_us": 52.0, "graph_kernel_us": 40.0,
            # the forward (the 7-kernel launch): 6 kernels of 2 µs and our norm's 4
            "forward_kernels": 7, "step_kernel_us_median": 16.0, "step_steer_us_median": 4.0,
            "step_comm_kernels": {fused: 1.0, nccl: 1.0}}
    assert {k: r[k] for k in want} == want
    # no graph launches at all (eager server): every kernel is eager, no per-step count
    r2 = analyze_events([e for e in ev if not e["name"].startswith("cudaGraph")])
    assert (r2["graph_launches"], r2["kernels_per_step"], r2["eager_kernels"]) == (0, None, 19), r2
    assert r2["step_steer_us_median"] is None and r2["step_comm_kernels"] == {}


def test_the_graph_phase_profiles_the_ab_arms_at_their_concurrency(ctx):
    """The n16 rows send what the A/B's per_request_n16 / project_n16 send: 16 requests, each its own config (issue
    38's gap at the A/B's batch); the n4 rows keep 4."""
    from abkit import runner

    rows = {label: (kind, n) for label, _s, kind, n in runner.GRAPH_PLAN}
    assert rows["steer / per_request_n16"] == ("per_request", 16)
    assert rows["steer_proj / project_n16"] == ("project", 16)
    assert rows["steer_proj / project_n4"] == ("project", 4)
    assert runner.GRAPH_NS == (4, 16)
    for label, kind, n, field in (("steer_proj / project_n16", "project", 16, "steering_projections"),
                                  ("steer / per_request_n16", "per_request", 16, "steering_vectors"),
                                  ("steer_proj / project_n4", "project", 4, "steering_projections")):
        bodies = [json.loads(b) for b in runner.graph_bodies(label, kind, n, ctx | {"prompt_len": 8}, 16, 2)]
        assert len(bodies) == n and all(b["max_tokens"] == 16 for b in bodies)
        assert len({json.dumps(b[field], sort_keys=True) for b in bodies}) == n
    plain = [json.loads(b) for b in runner.graph_bodies("stock / unsteered n16", "plain", 16, ctx | {"prompt_len": 8},
                                                        16, 1)]
    assert len(plain) == 16 and not any("steering_vectors" in b or "steering_projections" in b for b in plain)


def _eager_trace() -> list[dict]:
    """Four compute kernels on stream 7 (gaps 20, 100, 100 µs), our capture kernel on stream 20 covering 50 µs of
    the last gap, a DtoH copy half under kernels, an HtoD before them, a memset in the 20 µs gap, vLLM's step
    annotations (2 prefill steps, 1 decode step) on the host and the GPU, and the host's runtime calls."""
    def x(name, cat, ts, dur, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": args.pop("tid", 5),
                "args": args}

    pre, dec = "execute_context_16(8192)_generation_0(0)", "execute_context_0(0)_generation_4(4)"
    return [x("sm90_gemm_bf16", "kernel", 100, 200, stream=7, correlation=1),
            x("flash_fwd_kernel", "kernel", 320, 80, stream=7, correlation=2),
            x("sm90_gemm_bf16", "kernel", 500, 200, stream=7, correlation=3),
            x("_capture_rows_kernel", "kernel", 650, 100, stream=20, correlation=4),
            x("triton_red_fused_rms_norm", "kernel", 800, 200, stream=7, correlation=5),
            x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 700, 150, stream=20, bytes=1 << 20, correlation=6),
            x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 50, 40, stream=7, bytes=4096, correlation=7),
            x("Memset (Device)", "gpu_memset", 305, 10, stream=7, bytes=64, correlation=8),
            x(pre, "gpu_user_annotation", 90, 320, **{"External id": 11}),
            x(pre, "gpu_user_annotation", 490, 270, **{"External id": 12}),
            x(pre, "gpu_user_annotation", 650, 50, stream=20, **{"External id": 12}),  # the same step, stream 20
            x(dec, "gpu_user_annotation", 790, 210, **{"External id": 13}),
            x(pre, "user_annotation", 0, 200), x(pre, "user_annotation", 300, 400), x(dec, "user_annotation", 720, 100),
            x("cudaStreamWaitEvent", "cuda_runtime", 10, 3), x("cudaStreamWaitEvent", "cuda_runtime", 20, 5, tid=9),
            x("cudaEventSynchronize", "cuda_runtime", 30, 40, tid=9),
            x("cudaMemcpyAsync_v3020", "cuda_runtime", 80, 7, tid=9),
            *(x("cudaLaunchKernel", "cuda_runtime", 90 + i, 1) for i in range(5)),
            {"ph": "f", "name": "ac2g", "cat": "ac2g", "ts": 90, "id": 1}]  # flow events are ignored


def test_the_timeline_says_how_long_the_gpu_waited_and_what_the_copies_overlapped(tmp_path):
    """Busy is the union of kernel intervals on every stream, idle the window's rest; only gaps > 50 µs count; a
    copy's time under kernels is its overlap with that union; steps come from vLLM's execute_context annotation."""
    tl = analyze_events(_eager_trace())["timeline"]
    # union: [100,300] [320,400] [500,750] [800,1000] -> 730 µs busy in a 900 µs window; gaps 20, 100, 50
    assert (tl["window_us"], tl["busy_us"], tl["idle_us"], tl["idle_pct"]) == (900.0, 730.0, 170.0, 18.89)
    assert (tl["gaps_over_50us"], tl["gaps_over_50us_us"], tl["gap_max_us"]) == (1, 100.0, 100.0)
    # the long gap [400, 500] ends where the second GEMM starts, between the two prefill steps' GPU spans
    assert (tl["gaps_before"], tl["gaps_inside_steps"]) == ([[100.0, 1, "sm90_gemm_bf16"]], [0, 0.0])
    step = {"ph": "X", "name": "execute_context_1(512)_generation_0(0)", "cat": "gpu_user_annotation", "ts": 0,
            "dur": 300, "pid": 1, "tid": 5, "args": {"External id": 1}}
    assert tl["gaps_launched_late"] == [0, 0.0]  # no launch call names the GEMM after the gap
    two = [{**step, "name": n, "cat": "kernel", "ts": ts, "dur": 10, "args": {"correlation": c}}
           for n, ts, c in (("a", 0, 1), ("b", 200, 2))]
    # b's launch ended 13 µs before it ran (late: the GPU waited for it); its thread made no call for 189 µs before
    calls = [{**step, "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": ts, "dur": d, "tid": 7,
              "args": {"correlation": c}} for ts, d, c in ((-5, 1, 1), (185, 2, 2))]
    late = analyze_events([step, *two, *calls])["timeline"]
    assert late["gaps_inside_steps"] == [1, 190.0]  # the host fell behind mid-step
    assert (late["gaps_launched_late"], late["host_silence_before_late_us_median"]) == ([1, 190.0], 189.0)
    # bench/trace_gaps.py lists the same gap from the trace file, with the launching thread's call before it
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [step, *two, *calls]}, f)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_gaps.py"), str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["10.0", "µs", "gap", "190.0", "µs", "in", "step", "a", "->", "b", "lag", "13.0", "µs",
                           "LATE,", "thread", "7", "before:", "cudaLaunchKernel", "(189.0", "µs", "ago,", "1.0",
                           "µs)"], out
    assert tl["kernel_streams"] == {"7": [4, 680.0], "20": [1, 100.0]}
    # the DtoH [700, 850]: [700, 750] under our kernel, [800, 850] under the norm
    assert tl["copies"]["DtoH"] == {"n": 1, "us": 150.0, "bytes": 1 << 20, "under_kernels_us": 100.0,
                                    "streams": ["20"]}
    assert (tl["copies"]["HtoD"]["under_kernels_us"], tl["copies"]["memset"]["under_kernels_us"]) == (0.0, 0.0)
    assert (tl["steps"], tl["prefill_steps"], tl["prefill_tokens"]) == (3, 2, 16384)
    # prefill steps' GPU spans 320 and 270; between steps 490 - 410 = 80 and 790 - 760 = 30
    assert (tl["prefill_step_gpu_us_median"], tl["between_steps_us_median"], tl["between_steps_us_total"]) == \
        (295.0, 55.0, 110.0)
    assert (tl["host_step_us_median"], tl["host_prefill_step_us_median"], tl["busy_us_per_prefill_step"],
            tl["idle_us_per_prefill_step"]) == (200.0, 300.0, 365.0, 85.0)
    assert tl["runtime_calls"] == {"cudaStreamWaitEvent": [2, 8.0], "cudaEventSynchronize": [1, 40.0],
                                   "cudaMemcpyAsync": [1, 7.0]}
    assert tl["runtime_by_tid"][0] == [52.0, 3, "9"]  # the thread that waited
    # a CPU server's trace (no kernels): the host steps alone
    cpu = analyze_events([e for e in _eager_trace() if e["cat"] == "user_annotation"])["timeline"]
    assert "window_us" not in cpu and (cpu["host_prefill_steps"], cpu["host_step_us_median"]) == (2, 200.0)
    # the report's prefill table shows the row
    from abkit.report import report

    rec = {**analyze_events(_eager_trace()), "load": "prefill", "requests": 128, "request_errors": 0,
           "prompt_throughput": 40000.0, "trace_bytes": 3_000_000}
    res = tmp_path / "ab_prefill_prof.json"
    res.write_text(json.dumps({"phases": {"graph": {"stock / prefill": rec}}}))
    row = next(line for line in report([str(res)], None).splitlines() if line.startswith("| stock / prefill | 128"))
    assert "| 2 (3) | 900.0 | 730.0 | 170.0 (18.89%) | 1 / 100.0 | 0 / 0 | sm90_gemm_bf16 100 (1) | 0 / 0 (—) |" in row, row
    assert "| 1 / 150 µs / 1 MB / 67% under kernels |" in row and "| 2 / 8 | 1 / 40 | — | 1 / 7 |" in row, row


def test_the_prefill_graph_rows_send_what_the_prefill_arms_send(ctx, monkeypatch, tmp_path):
    """GRAPH_LOADS=prefill profiles stock, capture to files (nowait) and to memory, and extract_hs, each with its
    arm's prompt length, max_tokens 1 and capture fields, enough requests for >= 4 prefill steps of 8192 tokens;
    extract_hs is a graph server (on CUDA) started with the profiler like the others."""
    from types import SimpleNamespace

    import ab_suite
    from abkit import runner
    from abkit.arms import PREFILL_LOAD
    from abkit.servers import EXTRACT_SERVER, Server

    assert runner.GRAPH_LOADS == ("decode",)  # a plain graph run profiles what it did before
    monkeypatch.setattr(runner, "GRAPH_LOADS", ("prefill",))
    c = ctx | {"prompt_len": 8, "graph_servers": ["stock", "steer_capture_fs", "extract_hs"],
               "args": SimpleNamespace(dry_run_cpu=False)}
    rows = {r["label"]: r for r in runner.graph_rows(c)}
    assert {label: (r["server"], r["arm"], r["concurrency"]) for label, r in rows.items()} == {
        "stock / prefill": ("stock", "prefill_stock", 32),
        "steer_capture_fs / prefill capture files (nowait)": ("steer_capture_fs", "prefill_capture_fs_nowait", 32),
        "steer_capture_fs / prefill capture mem": ("steer_capture_fs", "prefill_capture_mem", 32),
        "extract_hs / prefill extract": ("extract_hs", "prefill_extract_hs", 32)}
    assert runner.GRAPH_PREFILL_REQUESTS * PREFILL_LOAD["prompt_len"] >= 4 * 8192
    layers = [0, 1]  # capture_layers(4 layers) on the tiny shape
    want = {"prefill_stock": None, "prefill_extract_hs": None,
            "prefill_capture_fs_nowait": {"filesystem": {"layers": layers, "hooks": ["post_mlp"],
                                                         "positions": "all_prompt", "wait": False}},
            "prefill_capture_mem": {"activations": {"layers": layers, "hooks": ["post_mlp"], "positions": "all_prompt",
                                                    "reduce": "mean"}}}
    for label, r in rows.items():
        warm, profiled = ([json.loads(b) for b in bs] for bs in r["bodies"]())
        assert (len(warm), len(profiled)) == (32, runner.GRAPH_PREFILL_REQUESTS)
        for b in warm + profiled:
            assert (len(b["prompt"]), b["max_tokens"], b.get("capture")) == (512, 1, want[r["arm"]]), label
            assert not {"steering_vectors", "steering_projections"} & set(b)
        assert [b["prompt"] for b in warm] != [b["prompt"] for b in profiled[:32]]  # the warm-up is other prompts
    # only the servers named: no extract_hs row without it
    only_stock = runner.graph_rows(c | {"graph_servers": ["stock"]})
    assert [r["label"] for r in only_stock] == ["stock / prefill"]
    args = ab_suite.parse_args(["--workdir", str(tmp_path), "--graph-servers", "stock,steer_capture_fs,extract_hs"])
    assert server_unavailable(EXTRACT_SERVER, args) is None
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 32}))
    cmd = Server(EXTRACT_SERVER, 8117, args, tmp_path, tmp_path).command()
    assert "--speculative-config" in cmd and json.loads(cmd[cmd.index("--profiler-config") + 1])["profiler"] == "torch"


def test_single_site_arms_send_what_each_plugin_reads(ctx):
    assert ctx["site_layer"] == 1
    assert not expects_steering_field(ARMS["hotwire_ids16"]) and not expects_steering_field(ARMS["hotwire_idle"])
    assert expects_steering_field(ARMS["site_named16"]) and expects_steering_field(ARMS["site_inline16"])
    _check_fields(ctx)
    _check_packed(ctx)


def test_every_server_gets_the_quantization_asked_for(tmp_path):
    """``--quantization fp8`` (issue 43's FP8 cost) reaches stock's and steer's command lines alike; unset, neither;
    ``fp8_block``: ``fp8`` there, and the model's config declares block-FP8 weights as vLLM reads them (its
    Fp8Config: 128 x 128 blocks, dynamic activations), the bf16 model's config left as it was."""
    import ab_suite
    from abkit.servers import SHAPES, Server, write_model_dir
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    for flag, want in (([], None), (["--quantization", "fp8"], "fp8"), (["--quantization", "fp8_block"], "fp8")):
        args = ab_suite.parse_args(["--workdir", str(tmp_path), *flag])
        for name in ("stock", "steer"):
            cmd = Server(name, 8100, args, tmp_path / "model", tmp_path).command()
            got = cmd[cmd.index("--quantization") + 1] if "--quantization" in cmd else None
            assert got == want, (name, flag, cmd)
    for block in (False, True):
        cfg = json.loads((write_model_dir(tmp_path / f"m{block}", SHAPES["tiny"], "bfloat16", block_fp8=block)
                          / "config.json").read_text())
        assert ("quantization_config" in cfg) == block
        if block:
            fp8 = Fp8Config.from_config(cfg["quantization_config"])
            assert fp8.weight_block_size == [128, 128] and fp8.is_checkpoint_fp8_serialized
            assert fp8.activation_scheme == "dynamic"


def test_paired_deltas_pair_trials_by_number():
    arm = {"trials": [{"trial": 0, "throughput": 110.0}, {"trial": 2, "throughput": 90.0}]}
    ref = {"trials": [{"trial": 0, "throughput": 100.0}, {"trial": 1, "throughput": 50.0},
                      {"trial": 2, "throughput": 100.0}]}
    p = paired_pct(arm, ref, "throughput")
    assert p["trials"] == [0, 2] and [round(x, 6) for x in p["pct"]] == [10.0, -10.0] and not p["significant"]


def test_prefill_capture_arms_are_compared_with_extract_hidden_states_trial_by_trial():
    """The prefill report puts each capture arm against vLLM's extract_hidden_states pair by pair (both against the
    same stock trial): mean and median, so one stalled trial shows as what it is."""
    def arm(name, tputs):
        rest = {m: 1.0 for m, _ in METRICS if m != "throughput"}
        return {"arm": name, "trials": [{"trial": k, "throughput": v, **rest} for k, v in enumerate(tputs)]}
    phases = {"ab": {"prefill_stock": arm("prefill_stock", [100.0, 100.0, 100.0]),
                     "prefill_capture_fs_nowait": arm("prefill_capture_fs_nowait", [99.0, 80.0, 101.0]),
                     "prefill_extract_hs": arm("prefill_extract_hs", [100.0, 100.0, 100.0])}}
    lines: list[str] = []
    ab_tables(phases, lines)
    row = next(line for line in lines if line.startswith("| prefill_capture_fs_nowait | prefill_extract_hs |"))
    assert row.split(" | ")[2:] == ["3", "-1.0, -20.0, +1.0", "-6.67% ± 6.69", "-1.00% |"]


@pytest.mark.skipif(not PEER_WHEELS, reason="needs the peer wheel in .whl/peer/ (not in the repository)")
def test_the_hotwire_server_reads_our_vector_files(ctx, tmp_path):
    import ab_suite

    args = ab_suite.parse_args(["--peer-wheel", str(PEER_WHEELS[-1]), "--workdir", str(tmp_path)])
    args.shape, args.launcher = "tiny", "gpu"  # gpu: the hotwire server is available
    site = _check_server(args, ctx, tmp_path)
    _check_hotwire_reads(site, ctx, tmp_path / "hotwire_vectors")


def _check_fields(ctx: dict) -> None:
    layer, vecs = ctx_site(ctx)
    n = 2 * N_SITE + 3
    hw = arm_fields(ARMS["hotwire_ids16"], n, 0, ctx)
    for i, f in enumerate(hw):
        raw = f["vllm_xargs"]["hotwire"]
        assert isinstance(raw, str) and json.loads(raw) == {"id": f"v{i % 16}", "layer": layer, "scale": 1.0}, raw
    named = arm_fields(ARMS["site_named16"], n, 0, ctx)
    assert [f["steering_module"]["name"] for f in named] == [module_name(i % 16) for i in range(n)]
    inline = arm_fields(ARMS["site_inline16"], n, 0, ctx)
    for i, f in enumerate(inline):
        assert f["steering_vectors"] == steer_vectors(vecs[i % 16], layer, ctx["pack_dtype"])
    mods = arm_modules(ARMS["site_named16"], ctx)
    assert list(mods) == [module_name(i) for i in range(16)]
    assert all(mods[module_name(i)] == steer_vectors(vecs[i], layer, ctx["pack_dtype"]) for i in range(16))
    body = json.loads(build_bodies([[1, 2, 3]], hw[:1], 4)[0])
    assert body["vllm_xargs"] == hw[0]["vllm_xargs"] and body["prompt"] == [1, 2, 3]


def _check_packed(ctx: dict) -> None:
    """The packed site vector decodes to the vector (float32: exactly) at [layer]."""
    layer, vecs = ctx_site(ctx)
    packed = steer_vectors(vecs[5], layer, "float32")["post_mlp"]
    assert packed["layer_indices"] == [layer] and packed["shape"] == [1, ctx["shape"]["hidden"]]
    got = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.float32)
    assert np.array_equal(got, vecs[5]) and "scales" not in packed
    assert steer_vectors(vecs[5], layer, "float32", 0.5)["post_mlp"]["scales"] == [0.5]
    assert json.loads(hotwire_field(5, layer, 0.5)["vllm_xargs"]["hotwire"])["scale"] == 0.5


def _check_server(args, ctx: dict, workdir) -> object:
    """The hotwire server's env and command as Pool would start it; returns its site folder (or None)."""
    from abkit.servers import Pool, Server

    assert server_unavailable(PEER_SERVER, args) is None
    pool = Pool(args, workdir / "model", workdir)
    s = Server(PEER_SERVER, pool.ports[PEER_SERVER], args, workdir / "model", workdir)
    pool.prepare(s)
    env, cmd = s.env(), s.command()
    assert env["VLLM_PLUGINS"] == "hotwire" and env["VLLM_CACHE_ROOT"].endswith("-hotwire")
    assert env["PYTHONPATH"].split(":")[0] == str(workdir / "hotwire_site")
    assert env["HOTWIRE_VECTORS"] == str(workdir / "hotwire_vectors") and env["HOTWIRE_SLOTS"] == "32"
    assert "--additional-config" not in cmd and str(pool.ports[PEER_SERVER]) in cmd
    files = sorted(p.name for p in (workdir / "hotwire_vectors").glob("*.pt"))
    assert files == sorted(f"v{i}.pt" for i in range(N_SITE)), files
    return workdir / "hotwire_site"


def _check_hotwire_reads(site, ctx: dict, folder) -> None:
    """hotwire's own loader and parser on our files and fields: each id's slot holds its vector."""
    import torch

    sys.path.insert(0, str(site))
    try:
        from hotwire import _state
    finally:
        sys.path.remove(str(site))
    layer, vecs = ctx_site(ctx)
    shape = ctx["shape"]
    st = _state.SteerState(shape["layers"], shape["hidden"], 64, torch.device("cpu"), torch.float32, N_SITE)
    st.load_store(str(folder))
    assert sorted(st.store) == sorted(f"v{i}" for i in range(N_SITE))
    for i, f in enumerate(arm_fields(ARMS["hotwire_ids16"], N_SITE, 0, ctx)):
        (spec,) = _state.parse_spec(f["vllm_xargs"]["hotwire"])
        slot = st.slot_for(spec["id"], int(spec["layer"]), float(spec.get("scale", 1.0)))
        assert slot is not None and int(spec["layer"]) == layer
        assert torch.equal(st.bank.bank[slot], torch.from_numpy(vecs[i])), spec


def test_capture_arms_read_the_sites_they_name_and_the_extraction_peer_reads_the_same_ones():
    """capture_gen_n16 reads L/4, L/2, 3L/4; the prefill arms 4 layers ending at the last (post_mlp), which are
    vLLM's extract_hidden_states layer ids shifted by one (its id i is the residual entering layer i)."""
    from abkit.arms import capture_layers
    from abkit.servers import extract_hs_args

    assert capture_layers(ARMS["capture_gen_n16"], 32) == [8, 16, 24]
    assert capture_layers(ARMS["prefill_capture_fs"], 32) == [7, 15, 23, 31]
    assert capture_layers(ARMS["prefill_capture_mem"], 2) == [0, 1]  # the tiny shape: no layer -1
    args = extract_hs_args(ROOT, 32)
    ids = json.loads(args[1])["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert [i - 1 for i in ids] == capture_layers(ARMS["prefill_capture_fs"], 32)


def test_the_file_writing_arms_ask_the_filesystem_consumer_and_are_checked_for_complete_files(ctx, tmp_path):
    from abkit.runner import check_steering, files_written

    fields = arm_fields(ARMS["capture_fs_all"], 2, 0, ctx)
    assert fields[0] == {"capture": {"filesystem": {"layers": "all", "hooks": ["post_mlp"], "positions": "all"}}}
    nowait = arm_fields(ARMS["capture_fs_all_nowait"], 1, 0, ctx)[0]["capture"]
    assert nowait == {"fs_nosync": {"layers": "all", "hooks": ["post_mlp"], "positions": "all", "wait": False}}
    assert not expects_steering_field(ARMS["capture_fs_all"])
    (tmp_path / "default" / "r1").mkdir(parents=True)
    (tmp_path / "default" / "r1" / "request.json").write_text('{"status": "partial", "dropped_rows": 7}')
    (tmp_path / "default" / "r1" / "3_post_mlp.bin").write_bytes(b"\0" * 1000)
    t = {"n_errors": 0, "n": 2, "unexpected_steering": 0, "captured": 0,
         **files_written(tmp_path, "capture_fs", 2, wall=0.5, wait_s=0.2)}
    assert (t["files_complete"], t["bytes_written"], t["write_gbps"]) == (1, 1040, 1040 / 0.5 / 1e9)
    assert (t["statuses"], t["dropped_rows"]) == ({"partial": 1}, 7)  # drops are reported, not hidden
    assert check_steering(t, "capture_fs_all") == "captured files complete for 1 of 2 requests"


def test_a_trial_reports_the_capture_counters_that_moved(monkeypatch):
    import io

    from abkit import runner

    pages = iter(["vllm_steer_capture_rows_total 10\nvllm_steer_capture_dropped_writes_total{a=\"1\"} 2\n"
                  "vllm_steer_capture_dropped_writes_total{a=\"2\"} 1\nvllm_steer_capture_rows_created 5\n",
                  "vllm_steer_capture_rows_total 30\nvllm_steer_capture_dropped_writes_total{a=\"1\"} 2\n"
                  "vllm_steer_capture_dropped_writes_total{a=\"2\"} 4\nvllm_steer_capture_ring_full_total 0\n"])
    monkeypatch.setattr(runner.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(next(pages).encode()))
    server = type("S", (), {"base": "http://x"})()
    before, after = runner.capture_counters(server), runner.capture_counters(server)
    assert runner.counter_delta(before, after) == {"rows_total": 20.0, "dropped_writes_total": 3.0}


def test_the_host_profile_splits_py_spy_samples_per_step_by_thread_and_owner():
    """py-spy's raw lines (``--threads``: a thread frame first): active CPU per step, per thread, and the samples
    whose innermost vLLM-or-ours frame is ours (our wrapper around vLLM's step does not make the step ours)."""
    from abkit.host_profile import summarize

    raw = "\n".join([
        "thread (1): MainThread;busy (/s/vllm/v1/engine/core.py:9);plan (/s/vllm_steer/runtime/capture.py:5);"
        "f (numpy/x.py:1) 4",
        "thread (1): MainThread;busy (/s/vllm/v1/engine/core.py:9);wrap (/s/vllm_steer/runtime/manager.py:1);"
        "execute_model (/s/vllm/v1/worker/gpu/model_runner.py:3) 6",
        "thread (2): vllm-steer-capture-a;run (threading.py:1);on_rows (/s/vllm_steer/capture/activations.py:7) 10",
    ])
    s = summarize(raw, rate=100, steps=2)
    assert (s["samples"], s["active_ms_per_step"], s["vllm_steer_ms_per_step"]) == (20, 100.0, 70.0)
    assert s["threads_ms_per_step"] == {"MainThread": 50.0, "vllm-steer-capture-a": 50.0}
    assert s["top_vllm_steer"] == [("on_rows (vllm_steer/capture/activations.py)", 10),
                                   ("plan (vllm_steer/runtime/capture.py)", 4)]


def test_the_host_profile_registers_the_modules_a_named_arm_asks_for_before_its_load(ctx, monkeypatch, tmp_path):
    """The host phase profiles ``site_named16``'s load with its 16 modules registered first (as the ab phase does;
    s37's CPU dry run found its requests all refused without them: 0 steps)."""
    from abkit import host_profile, runner

    calls = []
    monkeypatch.setattr(runner, "http_json", lambda method, url, body, timeout: calls.append(("module", body["name"]))
                        or (201, {}))
    monkeypatch.setattr(host_profile, "run_load", lambda server, bodies, conc: calls.append(("load", len(bodies)))
                        or ([], 1.0))
    monkeypatch.setattr(host_profile, "processes", lambda pid: {})
    monkeypatch.setattr(host_profile, "steps_of", lambda base: 0.0)
    monkeypatch.setattr(host_profile, "summarize_trial", lambda res, wall, long: {})
    server = type("S", (), {"name": "steer", "base": "http://x", "pid": 1})()
    pool = type("P", (), {"get": lambda self, name: server})()
    args = type("A", (), {"requests": 4, "concurrency": 2, "max_tokens": 3, "host_duration": 1, "host_rate": 10,
                          "host_gil": False})()
    ctx = {**ctx, "prompt_len": 8, "modules_done": set()}
    host_profile._profile(pool, "site_named16", "py-spy", args, ctx, tmp_path)
    assert [c for c in calls if c[0] == "module"] == [("module", f"ab_site_{i}") for i in range(16)]
    assert calls[16:] == [("load", 2), ("load", 4)]  # both loads after the registrations


def test_the_projection_arm_ablates_one_unit_direction_per_request_at_every_post_mlp(ctx):
    """``project_n16``: 16 distinct configs, each one random unit direction (packed float32) ablated at post_mlp of
    every layer, which the front end accepts on a server with ``max_projections`` 1 (its server's block)."""
    import torch

    from abkit.servers import STEER_SERVERS
    from tests.test_spec_and_hash import _frontend

    arm = ARMS["project_n16"]
    assert expects_steering_field(arm) and arm["server"] == "steer_proj"
    fields = arm_fields(arm, 20, 5, ctx)
    layers = ctx["shape"]["layers"]
    dirs = [np.frombuffer(base64.b64decode(f["steering_projections"]["post_mlp"]["0"][0]["direction"]["data"]),
                          np.float32) for f in fields]
    assert len({d.tobytes() for d in dirs}) == 16 and dirs[16].tobytes() == dirs[0].tobytes()
    np.testing.assert_allclose([np.linalg.norm(d) for d in dirs], 1.0, rtol=1e-6)
    assert all(sorted(f["steering_projections"]["post_mlp"], key=int) == [str(l) for l in range(layers)] for f in fields)
    fe = _frontend(dtype=torch.bfloat16, layers=layers, hidden=ctx["shape"]["hidden"],
                   **STEER_SERVERS["steer_proj"]["steer"])
    payload, pk, dk = fe.resolve(fields[3])
    assert pk == dk and len(payload.projections[pk]) == layers


def test_offline_pairs_modules_load_as_start_up_modules_and_trials_pair_by_number(tmp_path):
    """bench/offline_pairs.py: the steer LLM's start-up module files hold the single-site vectors the inline arm
    sends (read back by the preload's own loader), and its summary pairs each arm with stock trial by trial."""
    import types

    from bench.offline_pairs import _fields_and_modules, _summary
    from vllm_steer.frontend.module_registration import load_path
    from vllm_steer.core.hooks import HOOK_NAMES as HOOKS
    from vllm_steer.frontend.spec import ModelShape

    shape = SHAPES["tiny"]
    args = types.SimpleNamespace(arms=["stock", "site_named16", "site_inline16"], batch=20, std=0.05,
                                 dtype="float32", site_layer=8)
    fields, modules = _fields_and_modules(args, shape, tmp_path)
    assert fields["stock"] == [None] * 20 and set(modules) == {f"ab_site_{i}" for i in range(N_SITE)}
    assert [f["steering_module"]["name"] for f in fields["site_named16"]] == [f"ab_site_{i % N_SITE}" for i in range(20)]
    module = load_path("ab_site_3", modules["ab_site_3"], ModelShape(shape["layers"], shape["hidden"], HOOKS, None, 1 << 20))
    inline = fields["site_inline16"][3]["steering_vectors"]["post_mlp"]
    want = np.frombuffer(base64.b64decode(inline["data"]), np.float32)
    (tier,) = [t for t in module.tiers.values() if t]  # the one tier the file fills
    np.testing.assert_array_equal(np.asarray(tier["post_mlp"][1], np.float32).ravel(), want)
    trials = [{"stock": {"prefill": 0.1, "gen": 0.1 + 3 * 0.010}, "site_named16": {"prefill": 0.1, "gen": 0.1 + 3 * s}}
              for s in (0.011, 0.0105)]
    out = _summary(trials, ["stock", "site_named16"], 4)
    assert [round(x, 6) for x in out["site_named16"]["decode_step_ms_vs_stock"]["pct"]] == [10.0, 5.0]


def _lane_ended(log) -> bool:
    """A lane log whose last line says its steps all ran."""
    return log.read_text().splitlines()[-1].endswith("lane done")


def test_gpu_lanes_pin_each_lane_and_pack_every_result(tmp_path):
    """bench/gpu_lanes.sh with a stand-in gpu_session.sh: each step sees its lane's GPU, TMPDIR, port base, OUT and
    only its own variables; a lane still running is not started twice; a lane started again goes on in its folder;
    poll waits for every lane and packs logs and results (not the lanes' TMPDIRs) into one archive; a lane outlives
    the process group that started it; a lane whose process died is reported lost at once and can start again."""
    import subprocess
    import tarfile

    repo, lanes, out = tmp_path / "repo", tmp_path / "lanes", tmp_path / "out"
    (repo / "bench").mkdir(parents=True)
    (repo / "bench" / "gpu_lanes.sh").write_text((ROOT / "bench" / "gpu_lanes.sh").read_text())
    (repo / "bench" / "gpu_session.sh").write_text(
        'echo "$1 gpu=$CUDA_VISIBLE_DEVICES port=$PORT_BASE tmp=$TMPDIR x=${X:-}" >> "$OUT/steps.txt"\n'
        'touch "$TMPDIR/model.bin"; [ "$1" = slow ] && sleep 2; [ "$1" = bad ] && exit 3; exit 0\n')
    env = {"PATH": "/usr/bin:/bin", "LANES_DIR": str(lanes), "OUT": str(out)}

    def lanes_sh(*args):
        return subprocess.run(["bash", "bench/gpu_lanes.sh", *args], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=60)

    assert lanes_sh("start", "2", "a", "X=1 slow; plain").returncode == 0
    assert lanes_sh("start", "0", "b", "bad").returncode == 0
    again = lanes_sh("start", "2", "a", "plain")
    assert again.returncode == 2 and "still running" in again.stderr
    polled = lanes_sh("poll", "30")
    assert polled.returncode == 0 and "##### a" in polled.stdout and "rc=3 bad" in polled.stdout
    assert (lanes / "a" / "out" / "steps.txt").read_text().splitlines() == [
        f"slow gpu=2 port=8300 tmp={lanes}/a/tmp x=1", f"plain gpu=2 port=8300 tmp={lanes}/a/tmp x="]
    assert (lanes / "b" / "out" / "steps.txt").read_text() == f"bad gpu=0 port=8100 tmp={lanes}/b/tmp x=\n"
    assert lanes_sh("start", "2,3", "tp", "plain").returncode == 0  # a TP lane: the port base is its first GPU's
    assert lanes_sh("start", "2", "a", "X=2 plain").returncode == 0
    assert lanes_sh("poll", "30").returncode == 0
    assert (lanes / "tp" / "out" / "steps.txt").read_text() == f"plain gpu=2,3 port=8300 tmp={lanes}/tp/tmp x=\n"
    last = (lanes / "a" / "out" / "steps.txt").read_text().splitlines()[-1]
    assert last == f"plain gpu=2 port=8300 tmp={lanes}/a/tmp x=2"
    assert (lanes / "a.log").read_text().count("lane done") == 2
    with tarfile.open(out / "lanes.tgz") as tar:
        names = {n.lstrip("./") for n in tar.getnames()}
    assert {"a.log", "b.log", "a/out/steps.txt", "b/out/steps.txt"} <= names
    assert not any(n.endswith("model.bin") for n in names)
    # the device tool ends the starting command's process group when its call returns: the lane lives on
    import os
    import signal
    starter = subprocess.Popen(["bash", "bench/gpu_lanes.sh", "start", "1", "c", "slow; plain"], cwd=repo, env=env,
                               stdout=subprocess.DEVNULL, start_new_session=True)
    assert starter.wait(timeout=60) == 0
    try:
        os.killpg(starter.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert lanes_sh("poll", "30").returncode == 0
    assert [ln.split()[0] for ln in (lanes / "c" / "out" / "steps.txt").read_text().splitlines()] == ["slow", "plain"]
    # a lane whose process died before its log ended is reported lost at once (not waited for) and may start again
    assert lanes_sh("start", "3", "d", "slow; plain").returncode == 0
    os.kill(int((lanes / "d.pid").read_text()), signal.SIGKILL)
    import time
    t0 = time.monotonic()
    lost = lanes_sh("poll", "30")
    assert time.monotonic() - t0 < 15 and "##### d (LOST" in lost.stdout and "##### a (ended)" in lost.stdout
    assert lanes_sh("start", "3", "d", "plain").returncode == 0
    assert lanes_sh("poll", "30").returncode == 0
    assert "lane lost: started again" in (lanes / "d.log").read_text() and _lane_ended(lanes / "d.log")


def _server_envs(tmp_path, names: tuple[str, ...], var: str) -> dict[str, tuple]:
    """Each GPU server's (value of ``var`` in its environment, its --additional-config), as the pool starts it."""
    from types import SimpleNamespace

    from abkit.servers import Pool, Server

    args = SimpleNamespace(launcher="gpu", dtype="bfloat16", max_model_len=64, max_num_seqs=4, tp=1, gpu_mem=0.2,
                           enforce_eager=False, profile_servers=False, cache_root=str(tmp_path), api_servers=1,
                           peer_wheel=None, reuse_servers=False, port_base=9000)
    pool = Pool(args, tmp_path, tmp_path)
    envs = {}
    for name in names:
        s = Server(name, pool.ports[name], args, tmp_path, tmp_path)
        pool.prepare(s)
        envs[name] = (s.env().get(var), s.command()[s.command().index("--additional-config") + 1])
    return envs


def test_the_late_path_servers_are_their_twins_with_the_kernel_flag_off(tmp_path):
    """Issue 38's A/B of the steered norm's late path against its default, EARLY: steer_late / steer_proj_late start
    as steer / steer_proj (same steer block, own ports) with VLLM_STEER_NORM_EARLY=0 in their environment (the twins
    without it: EARLY), each *_late arm sends its twin's traffic, compared with it (project_n16_late with
    per_request_n16_late), and the graph phase profiles both servers at n16."""
    from abkit.runner import GRAPH_PLAN
    from abkit.servers import PORT_OFFSETS, STEER_SERVERS

    envs = _server_envs(tmp_path, ("steer", "steer_proj", "steer_late", "steer_proj_late"), "VLLM_STEER_NORM_EARLY")
    assert envs["steer_late"] == ("0", envs["steer"][1]) and envs["steer"][0] is None
    assert envs["steer_proj_late"] == ("0", envs["steer_proj"][1]) and envs["steer_proj"][0] is None
    assert len(set(PORT_OFFSETS.values())) == len(PORT_OFFSETS)
    assert STEER_SERVERS["steer_late"] == STEER_SERVERS["steer"]
    for arm, twin, ref in (("per_request_n16_late", "per_request_n16", "per_request_n16"),
                           ("project_n16_late", "project_n16", "per_request_n16_late"),
                           ("enabled_idle_late", "enabled_idle", "enabled_idle"),
                           ("project_idle_late", "project_idle", "project_idle")):
        a, b = ARMS[arm], ARMS[twin]
        assert (a["kind"], a.get("n_configs"), a["server"], a["ref"]) == \
            (b["kind"], b.get("n_configs"), b["server"] + "_late", ref)
    graphed = {(server, kind) for _, server, kind, n in GRAPH_PLAN if n == 16}
    assert {("steer_late", "plain"), ("steer_late", "per_request"), ("steer_proj_late", "plain"),
            ("steer_proj_late", "project")} <= graphed


def test_the_fp8_unfused_server_is_steer_with_the_pass_off(tmp_path):
    """Issue 43: steer_fp8u starts as steer (same steer block, own port) with VLLM_STEER_FP8_NORM_QUANT=0 (steer
    without it: the pass on for an FP8 model), its arms send steer's traffic compared with steer's, and the graph
    phase profiles it at n16."""
    from types import SimpleNamespace

    from abkit.runner import GRAPH_PLAN
    from abkit.servers import PORT_OFFSETS, Pool, Server

    args = SimpleNamespace(launcher="gpu", dtype="bfloat16", max_model_len=64, max_num_seqs=4, tp=1, gpu_mem=0.2,
                           enforce_eager=False, profile_servers=False, cache_root=str(tmp_path), api_servers=1,
                           peer_wheel=None, reuse_servers=False, port_base=9000)
    pool = Pool(args, tmp_path, tmp_path)
    envs = {}
    for name in ("steer", "steer_fp8u"):
        s = Server(name, pool.ports[name], args, tmp_path, tmp_path)
        pool.prepare(s)
        envs[name] = (s.env().get("VLLM_STEER_FP8_NORM_QUANT"),
                      s.command()[s.command().index("--additional-config") + 1])
    assert envs["steer_fp8u"] == ("0", envs["steer"][1]) and envs["steer"][0] is None
    assert len(set(PORT_OFFSETS.values())) == len(PORT_OFFSETS)
    for arm, twin in (("enabled_idle_fp8u", "enabled_idle"), ("per_request_n16_fp8u", "per_request_n16")):
        a, b = ARMS[arm], ARMS[twin]
        assert (a["kind"], a.get("n_configs"), a["server"], a["ref"]) == \
            (b["kind"], b.get("n_configs"), "steer_fp8u", twin)
    graphed = {(server, kind) for _, server, kind, n in GRAPH_PLAN if n == 16}
    assert {("steer_fp8u", "plain"), ("steer_fp8u", "per_request")} <= graphed


def test_the_unfused_stock_turns_off_only_the_allreduce_fusion_and_no_server_may_use_multicast(tmp_path, monkeypatch):
    """Issue 40 (arfuse): stock_nofuse is stock (no plugin, same flags) with ``pass_config.fuse_allreduce_rms`` off,
    its arm is compared with stock and the graph phase profiles it; every server runs FlashInfer's all-reduce on its
    IPC backend with multicast off, even where the caller's environment asks for vLLM's multicast default."""
    from types import SimpleNamespace

    from abkit.runner import GRAPH_PLAN
    from abkit.servers import PORT_OFFSETS, Pool, Server

    monkeypatch.setenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "mnnvl")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    args = SimpleNamespace(launcher="gpu", dtype="bfloat16", max_model_len=64, max_num_seqs=4, tp=2, gpu_mem=0.2,
                           enforce_eager=False, profile_servers=False, cache_root=str(tmp_path), api_servers=1,
                           peer_wheel=None, reuse_servers=False, port_base=9000)
    pool = Pool(args, tmp_path, tmp_path)
    got = {}
    for name in ("stock", "stock_nofuse", "steer"):
        s = Server(name, pool.ports[name], args, tmp_path, tmp_path)
        pool.prepare(s)
        got[name] = (s.command(), s.env())
    (stock, stock_env), (nofuse, nofuse_env) = got["stock"], got["stock_nofuse"]
    at = nofuse.index("--compilation-config")
    assert json.loads(nofuse[at + 1]) == {"pass_config": {"fuse_allreduce_rms": False}}
    assert nofuse[:at] + nofuse[at + 2:] == [a if a != str(pool.ports["stock"]) else str(pool.ports["stock_nofuse"])
                                             for a in stock]
    assert "--compilation-config" not in stock and "--compilation-config" not in got["steer"][0]
    assert nofuse_env["VLLM_PLUGINS"] == stock_env["VLLM_PLUGINS"] == "none"
    for cmd, env in got.values():
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
        assert {k: env[k] for k in ("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "NCCL_NVLS_ENABLE",
                                    "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")} == \
            {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm", "NCCL_NVLS_ENABLE": "0",
             "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert len(set(PORT_OFFSETS.values())) == len(PORT_OFFSETS)
    assert (ARMS["stock_nofuse"]["server"], ARMS["stock_nofuse"]["kind"], ARMS["stock_nofuse"]["ref"]) == \
        ("stock_nofuse", "plain", "stock")
    assert {(server, n) for _, server, kind, n in GRAPH_PLAN if kind == "plain"} >= {("stock_nofuse", 4),
                                                                                        ("stock_nofuse", 16)}


def test_arfuse_logs_reports_each_servers_fusion_lines_and_compiled_ops(tmp_path):
    """bench/gpu_session.sh arfuse-logs on server logs holding vLLM 0.26's own fusion lines (read from its source, so
    a reworded line fails here, not on the GPU): per server the config's setting, the backend / workspace lines and
    the fused / steered ops in the compile cache its log names; each log comes back gzipped."""
    import importlib.util

    fi_src = importlib.util.find_spec("vllm.distributed.device_communicators.flashinfer_all_reduce").origin
    pass_src = importlib.util.find_spec("vllm.compilation.passes.fusion.allreduce_rms_fusion").origin
    backend = "Using flashinfer allreduce backend: "
    workspace = "Initialized FlashInfer Allreduce norm fusion workspace "
    disabled = "AllReduce fusion pass is disabled."
    assert backend in open(fi_src).read() and workspace in open(fi_src).read() and disabled in open(pass_src).read()
    assert 'logger.debug("Replaced %s patterns", self.matched_count)' in open(pass_src).read()
    logs, out = tmp_path / "vllm_steer_ab" / "logs", tmp_path / "out"
    logs.mkdir(parents=True)
    for name, fused, ops in (("stock", True, "torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm.default(x)\n" * 3),
                             ("steer", True, "torch.ops.vllm_steer.steered_norm_plain.default(x)\n" * 2),
                             ("stock_nofuse", False, "")):
        cache = tmp_path / "cache" / name / "rank_0_0" / "backbone"
        cache.mkdir(parents=True)
        (cache / "artifact").write_text(ops)
        lines = [f"(EngineCore pid=1) INFO 11-28 [core.py:117] Initializing a V1 LLM engine (v0.26.0) with config: "
                 f"compilation_config={{'mode': 3, 'pass_config': {{'fuse_allreduce_rms': {fused}}}}}",
                 f"(Worker_TP0 pid=2) INFO 11-28 [backends.py:1095] Using cache directory: {cache} for vLLM's "
                 f"torch.compile"]
        if fused:
            lines += [f"(Worker_TP{r} pid=3) INFO 11-28 [flashinfer_all_reduce.py:104] {backend}trtllm" for r in (0, 1)]
            lines += [f"(Worker_TP{r} pid=3) DEBUG 11-28 [allreduce_rms_fusion.py:1137] Replaced {n} patterns"
                      for r in (0, 1) for n in ((64, 1) if name == "stock" else (0,))]
            lines.append(f"(Worker_TP0 pid=2) INFO 11-28 [flashinfer_all_reduce.py:170] {workspace}with backend=trtllm")
        else:
            lines.append(f"(Worker_TP0 pid=2) WARNING 11-28 [allreduce_rms_fusion.py:1126] {disabled}")
        (logs / f"{name}.log").write_text("\n".join(lines) + "\n")
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "OUT": str(out),
           "SERVERS": "stock,steer,stock_nofuse,gone"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), "arfuse-logs"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    text = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    per = dict(part.split("\n", 1) for part in text.split("== ")[1:])
    assert "1 fuse_allreduce_rms': True" in per["stock"] and "backend: trtllm" in per["stock"]
    assert "2 INFO" in per["stock"]  # one line a rank
    assert "fused all-reduce ops 3, steered norm ops 0" in per["stock"]
    assert "Worker_TP0: 65 all-reduce + norm patterns replaced in 2 compiled graphs" in per["stock"]
    assert "Worker_TP1: 0 all-reduce + norm patterns replaced in 1 compiled graphs" in per["steer"]
    assert "fused all-reduce ops 0, steered norm ops 2" in per["steer"]
    assert "fuse_allreduce_rms': False" in per["stock_nofuse"] and disabled in per["stock_nofuse"]
    assert per["gone: no log at " + str(logs / "gone.log")] == ""
    assert sorted(p.name for p in out.iterdir()) == ["server_steer.log.gz", "server_stock.log.gz",
                                                      "server_stock_nofuse.log.gz"]


def test_debug_loggers_log_their_debug_lines_and_leave_the_rest_of_vllm_at_info(tmp_path):
    """``--debug-loggers``: vLLM, configured from the file every server gets (VLLM_LOGGING_CONFIG_PATH), logs the named
    logger's DEBUG lines (the fusion pass's "Replaced N patterns") and keeps every other vLLM logger at INFO."""
    from types import SimpleNamespace

    from abkit.servers import Pool, Server

    name = "vllm.compilation.passes.fusion.allreduce_rms_fusion"
    args = SimpleNamespace(launcher="gpu", dtype="bfloat16", max_model_len=64, max_num_seqs=4, tp=2, gpu_mem=0.2,
                           enforce_eager=False, profile_servers=False, cache_root=str(tmp_path), api_servers=1,
                           peer_wheel=None, reuse_servers=False, port_base=9000, debug_loggers=name)
    pool = Pool(args, tmp_path, tmp_path)
    s = Server("stock", pool.ports["stock"], args, tmp_path, tmp_path)
    pool.prepare(s)
    code = ("from vllm.logger import init_logger\n"
            f"init_logger({name!r}).debug('Replaced %s patterns', 64)\n"
            "other = init_logger('vllm.config.vllm')\n"
            "other.debug('a debug line of another logger')\nother.info('an info line')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**s.env(), "VLLM_LOGGING_STREAM": "ext://sys.stdout"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DEBUG" in proc.stdout and "Replaced 64 patterns" in proc.stdout and "an info line" in proc.stdout
    assert "a debug line of another logger" not in proc.stdout
    plain = Server("stock", pool.ports["stock"], SimpleNamespace(**{**vars(args), "debug_loggers": ""}), tmp_path,
                   tmp_path)
    Pool(plain.args, tmp_path, tmp_path).prepare(plain)
    assert "VLLM_LOGGING_CONFIG_PATH" not in plain.env()


def test_the_arfuse_check_refuses_to_run_unless_multicast_is_ruled_out():
    """bench/arfuse_check.py creates FlashInfer all-reduce workspaces on the lent GPUs: with vLLM's own default
    backend (mnnvl: NVSwitch multicast) or any multicast switch not off it exits 8 naming each, before importing
    anything that could touch a GPU."""
    base = {"PATH": "/usr/bin:/bin", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    for key, bad in (("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "mnnvl"), ("VLLM_FLASHINFER_ALLREDUCE_BACKEND", None),
                     ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0"), ("NCCL_NVLS_ENABLE", None)):
        env = {k: v for k, v in {**base, key: bad}.items() if v is not None}
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "arfuse_check.py")], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 8, (key, bad, proc.stdout, proc.stderr[-1000:])
        assert proc.stdout.startswith("refusing: multicast not ruled out") and f"{key}={bad!r}" in proc.stdout


def test_trace_gaps_steps_says_how_long_the_output_wait_outlasted_the_gpu_and_the_host_between_steps():
    """``bench/trace_gaps.py --steps``: per step boundary, the runner's output wait past the step's last kernel (its
    copy queued behind a large D2H), the host's time from that wait to the next step, the large D2H copies then."""
    import trace_gaps  # bench/ is on sys.path here

    def x(name, cat, ts, dur, tid=5):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    step = "execute_context_16(8192)_generation_0(0)"
    events = [x(step, "user_annotation", 0, 50), x("gemm", "kernel", 100, 1000, tid=7),
              x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 1100, 4000, tid=25),  # a capture copy, 4 ms
              x("cudaEventSynchronize", "cuda_runtime", 60, 5040),  # ends at 5100: 4000 µs past the gemm's end
              x("cudaEventSynchronize", "cuda_runtime", 70, 100, tid=9),  # another thread's, and short: not a step's
              x(step, "user_annotation", 7100, 50), x("gemm", "kernel", 7200, 100, tid=7)]
    assert trace_gaps.step_bounds(events) == [{"waited_past_gpu_us": 4000.0, "host_between_us": 2000.0,
                                               "d2h_copies_us": 4000.0, "next": step}]


def test_trace_gaps_d2h_says_whether_the_next_step_was_queued_behind_each_large_copy():
    """``bench/trace_gaps.py --d2h``: per D2H copy over 1 MB, the GPU's idle from its start to the next kernel (the
    next step already queued: ~0; a drain: the host's whole time between steps), the kernels around it."""
    import trace_gaps  # bench/ is on sys.path here

    def x(name, cat, ts, dur, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 7, "args": args}

    d2h = "Memcpy DtoH (Device -> Pinned)"
    events = [x("gemm", "kernel", 0, 100), x(d2h, "gpu_memcpy", 100, 4000, bytes=268_000_000),
              x("_apply_write_kernel", "kernel", 115, 5),  # queued behind it: the host was ahead
              x("gemm", "kernel", 200, 900), x(d2h, "gpu_memcpy", 1100, 50, bytes=64),  # sampled tokens: not listed
              x(d2h, "gpu_memcpy", 1150, 4000, bytes=268_000_000), x("_apply_write_kernel", "kernel", 8150, 5)]
    assert trace_gaps.d2h_copies(events) == [
        {"mb": 268.0, "copy_us": 4000, "idle_after_us": 15, "before": "gemm", "after": "_apply_write_kernel"},
        {"mb": 268.0, "copy_us": 4000, "idle_after_us": 7000, "before": "gemm", "after": "_apply_write_kernel"}]


def test_with_a_fixed_kv_cache_the_servers_start_together_and_a_config_twin_after_its_first(tmp_path, monkeypatch):
    """``--kv-cache-gb``: every server gets vLLM's ``--kv-cache-memory-bytes`` (no memory profiling for a server
    starting beside another to disturb) and ``Pool.ensure`` starts its servers together: a config's first at once,
    its twins (same compile cache: steer_capture_fs_nogate, only its env differs) once that one is ready; a server that
    fails does not stop the others, and its error is raised after them."""
    from types import SimpleNamespace

    from abkit import servers as servers_mod
    from abkit.servers import Pool, Server, start_waves

    args = SimpleNamespace(launcher="gpu", dtype="bfloat16", max_model_len=64, max_num_seqs=4, tp=1, gpu_mem=0.2,
                           enforce_eager=False, profile_servers=True, cache_root=str(tmp_path), api_servers=1,
                           peer_wheel=None, reuse_servers=False, port_base=9000, kv_cache_gb=6.0, start_timeout=5)
    monkeypatch.setattr(servers_mod, "STATE_FILE", tmp_path / "state.json")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))  # extract_hs reads its layers
    pool = Pool(args, tmp_path, tmp_path)
    cmd = Server("stock", 9000, args, tmp_path, tmp_path).command()
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(6 * 2**30)
    names = ["stock", "steer_capture_fs", "steer_capture_fs_nogate", "extract_hs"]
    assert start_waves(names, pool.config_key) == [["stock", "steer_capture_fs", "extract_hs"],
                                                   ["steer_capture_fs_nogate"]]
    log = []
    monkeypatch.setattr(Server, "start", lambda s: log.append(("start", s.name)))
    monkeypatch.setattr(Server, "stop", lambda s: log.append(("stop", s.name)))

    def ready(s, timeout):
        log.append(("ready", s.name))
        if s.name == "steer_capture_fs":
            raise RuntimeError("steer_capture_fs exited with 1")

    monkeypatch.setattr(Server, "wait_ready", ready)
    with pytest.raises(RuntimeError, match="steer_capture_fs exited"):
        pool.ensure(names)
    assert log == [("start", "stock"), ("start", "steer_capture_fs"), ("start", "extract_hs"),
                   ("ready", "stock"), ("ready", "steer_capture_fs"), ("stop", "steer_capture_fs"),
                   ("ready", "extract_hs"), ("start", "steer_capture_fs_nogate"), ("ready", "steer_capture_fs_nogate")]
    assert sorted(pool.servers) == ["extract_hs", "steer_capture_fs_nogate", "stock"]
    assert "steer_capture_fs" in pool.failed
    args.kv_cache_gb = None  # the default: one after another
    log.clear()
    pool2 = Pool(args, tmp_path, tmp_path)
    pool2.ensure(["stock", "extract_hs"])
    assert log == [("start", "stock"), ("ready", "stock"), ("start", "extract_hs"), ("ready", "extract_hs")]


def test_a_server_reports_the_kernels_vllm_saw_compiled_while_serving(tmp_path):
    """vLLM's JIT monitor warns once a kernel compiled after the warm-up (s38's servers compiled _write_runs_kernel
    and _segment_add_kernel at their first steps; s40 warms them at start-up): each A/B run's meta lists them."""
    from abkit.servers import Server

    server = Server("steer_capture_fs", 8100, None, tmp_path / "model", tmp_path)
    assert server.jit_compiles() == []  # no log yet
    server.log_path.parent.mkdir(parents=True)
    server.log_path.write_text(
        "(EngineCore pid=1) INFO 11-29 [jit_monitor.py:79] Kernel JIT monitor activated; monitored JIT compilations"
        " during inference will use mode=warn.\n"
        "(EngineCore pid=1) WARNING 11-29 [jit_monitor.py:135] Triton kernel JIT compilation during inference:"
        " _write_runs_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.\n"
        "(EngineCore pid=1) WARNING 11-29 [jit_monitor.py:135] Triton kernel JIT compilation during inference:"
        " kernel_unified_attention. This causes a latency spike; ...\n")
    assert server.jit_compiles() == ["_write_runs_kernel", "kernel_unified_attention"]


def test_the_pdl_servers_are_their_twins_with_programmatic_dependent_launches(tmp_path):
    """steer_pdl / steer_capture_pdl start as steer / steer_capture (same steer block, own ports) with
    VLLM_STEER_NORM_PDL=1; their arms send their twins' traffic against stock, and the graph phase profiles
    steer_pdl at n16 beside steer."""
    from abkit.runner import GRAPH_PLAN
    from abkit.servers import PORT_OFFSETS

    seen = _server_envs(tmp_path, ("steer", "steer_pdl", "steer_capture", "steer_capture_pdl"), "VLLM_STEER_NORM_PDL")
    assert seen["steer_pdl"] == ("1", seen["steer"][1]) and seen["steer"][0] is None
    assert seen["steer_capture_pdl"] == ("1", seen["steer_capture"][1]) and seen["steer_capture"][0] is None
    assert len(set(PORT_OFFSETS.values())) == len(PORT_OFFSETS)
    for arm, twin in (("enabled_idle_pdl", "enabled_idle"), ("per_request_n16_pdl", "per_request_n16"),
                      ("capture_idle_pdl", "capture_idle")):
        a, b = ARMS[arm], ARMS[twin]
        assert (a["kind"], a.get("n_configs"), a["server"], a.get("ref", "stock")) == \
            (b["kind"], b.get("n_configs"), b["server"] + "_pdl", "stock")
    graphed = {(server, kind) for _, server, kind, n in GRAPH_PLAN if n == 16}
    assert {("steer_pdl", "plain"), ("steer_pdl", "per_request"), ("steer", "plain")} <= graphed
