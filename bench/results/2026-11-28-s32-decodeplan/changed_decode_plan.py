"""``plan_step``'s thread CPU under capture_gen_n16's staggered decode load (``bench/prefill_host_cost.py``'s schedule
and server config), steps whose batch changed vs steady ones; three runtimes interleaved, each first in turn: an older
runtime (``base``, a ``src/vllm_steer/runtime`` folder), this tree with ``CapturePlanner.pieces`` off (``ranged``) and
on (``pieces``). No GPU wait, no host-work loop: only the planning call is timed (the ring copy left out).

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python bench/results/2026-11-28-s32-decodeplan/changed_decode_plan.py BASE STEPS
"""
import importlib.util, sys, time, statistics
import torch
spec = importlib.util.spec_from_file_location("phc", "bench/prefill_host_cost.py")
phc = importlib.util.module_from_spec(spec); spec.loader.exec_module(phc)
from vllm_steer.core.config import SteerConfig
from vllm_steer.runtime import capture as capture_mod, capture_lanes
class A: pass
args = A(); args.arrivals = "staggered"; args.gen = 128; args.prompt = 256
base = phc._load_baseline(sys.argv[1])
for lanes in (capture_lanes, base._lanes):
    lanes._copy_into = lambda dst, rows, stream, keep=False: None
cfg = SteerConfig.model_validate({"capture": ["activations"]})
L = phc.LAYERS
cap = {"activations": {"layers": [L // 4, L // 2, 3 * L // 4], "hooks": ["post_mlp"], "positions": "all_generated", "reduce": "last"}}
sites = [(h, l) for h in phc.HOOKS for l in range(L)]
mods = {"base": base, "ranged": capture_mod, "pieces": capture_mod}
rts = {k: m.CaptureRuntime(cfg, sites, L, phc.WIDTH, 256, torch.bfloat16, torch.device("cpu")) for k, m in mods.items()}
rts["ranged"]._planner.pieces = False
res = {k: {"changed": [], "steady": []} for k in rts}
steps = phc._decode_schedule(args)
nsteps = int(sys.argv[2])
prev_ids = None
for k in range(nsteps + 131):
    ended, new, live, scheduled, computed = next(steps)
    decoding = [r for r, c in zip(live, computed.tolist()) if c > 0]  # the capturing part of the batch
    kind = "steady" if decoding == prev_ids else "changed"
    prev_ids = decoding
    order = list(rts.items())
    order = order[k % 3:] + order[: k % 3]  # each version first as often
    for v, rt in order:
        name = f"{v}r{{}}".format
        rt.finish_requests(list(map(name, ended)))
        for r, p, mt in new:
            rt.add_request(name(r), cap, p, {"external_id": name(r), "capture_reply": None}, mt)
        t0 = time.thread_time()
        if rt.active:
            rt.plan_step(list(map(name, live)), scheduled, computed)
        t1 = time.thread_time()
        rt.after_forward()
        if k >= 131:
            res[v][kind].append((t1 - t0) * 1e3)
for v, rt in rts.items():
    print(v, {kk: (len(x), round(statistics.mean(x), 4), round(statistics.median(x), 4)) for kk, x in res[v].items()},
          "decoded", getattr(rt._planner, "decoded", None), "ranged", rt._planner.ranged)
for rt in rts.values():
    rt.close()
