"""GPU time per launch (from a CUDA graph) of the steered norm with SAE clamps against the plain one: the clamp-only
path by clamps per token and split (``split_of(N)`` the default) beside the bandwidth bound, past 64 tokens the
clamps over token tiles (``tiled_of(N)``: the default) beside the walk in the norm (rows: decode-like at N <= 256,
every token its own row of 3; prefill-like from N 512, 16 prompts of N / 16 tokens); the dense whole-SAE path
(the torch reference) by d_sae; full packs on the tensor-core path (``op.triton_path``: TopK k 64 delta with 16 clamp
sets, JumpReLU reconstruct, idle) per site at 16 and 2048 tokens, with the bytes they must read, the tensor-core
flops, the larger of the two bounds, and each launch's GPU time (torch.profiler).
``--topk-sweep`` (alone): the full encoder's launch variants (``full_triton.Tuning``: tiles, warps, K split,
stages, the stream's hi / lo planes, ``_select``'s warps) on one TopK k 64
delta site (16 clamp sets, d_sae 16384, D 4096) at N 1, 16,
64: each variant's edit checked against the default's, then the site's µs (CUDA graph), each launch's GPU µs
(torch.profiler) and the bounds beside them (W_enc's read; the site's bytes).
Usage: python3 bench/sae_kernel_bench.py [--out FILE.json] [--full-only | --topk-sweep [--sweep-n 16,1,64]]"""

from __future__ import annotations

import argparse
import json

import torch

from vllm_steer.kernels.sae_clamp.packed import apply_site_naive
from vllm_steer.kernels.steered_rms_norm.op import triton_path
from vllm_steer.kernels.steered_rms_norm.triton import split_of, steered_norm_triton, tiled_of

D, STAGED, ROWS = 4096, 256, 4
HBM_BYTES_PER_US = 3.35e6  # H100 SXM HBM3 (an H200: 4.8e6)
BF16_FLOP_PER_US = 989e6  # H100 SXM dense bf16 tensor-core peak (the H200's is the same)


def _bound_us(n: int, clamps: int, tiled: bool = False) -> float:
    """Bytes a launch must move (bf16 x, residual in and out; fp32 enc / dec rows of the clamp sets) / bandwidth;
    ``tiled``: + the float32 edit written and read by the norm."""
    sets = min(n, ROWS - 1) if clamps else 0
    edit = 2 * n * D * 4 if tiled and clamps else 0
    return (4 * n * D * 2 + sets * clamps * 2 * D * 4 + edit) / HBM_BYTES_PER_US


def _rows(n: int, dev) -> torch.Tensor:
    """Every token's row (1..ROWS-1): at N <= 256 a decode batch (token t of its own request, rows cycling); from
    N 512 a prefill step (16 prompts of N / 16 tokens, rows cycling by prompt)."""
    t = torch.arange(n, device=dev, dtype=torch.int32)
    return (t if n <= 256 else t * 16 // n) % (ROWS - 1) + 1


def _time(fn, iters: int = 200) -> float:
    """µs per call, replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters // 10):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def _pack(clamps: int, dev) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(clamps)
    mode = torch.ones(ROWS, dtype=torch.int32)
    mode[0] = 0
    code = torch.zeros(ROWS, STAGED, dtype=torch.int32)
    for r in range(1, ROWS):
        code[r, torch.randperm(STAGED, generator=g)[:clamps]] = 1
    value = torch.randn(ROWS, STAGED, generator=g)
    enc, dec = torch.randn(STAGED, D, generator=g) * 0.02, torch.randn(STAGED, D, generator=g) * 0.02
    return [t.to(dev) for t in (mode, code, value, enc, dec, torch.zeros(STAGED), torch.zeros(STAGED),
                               torch.arange(STAGED))]


FULL_F, FULL_K, FULL_CLAMPS, FULL_SETS = 16384, 64, 64, 16


def _full_pack(topk: int, mode: int, dev) -> list[torch.Tensor]:
    """A full pack (d_sae FULL_F, bf16 weights as the engine stages them) whose rows 1..FULL_SETS each SET
    FULL_CLAMPS of its 256 clampable features, in ``mode`` (0: every row OFF)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    rows = FULL_SETS + 1
    mode_t = torch.full((rows,), mode, dtype=torch.int32)
    mode_t[0] = 0
    code = torch.zeros(rows, STAGED, dtype=torch.int32)
    for r in range(1, rows):
        code[r, torch.randperm(STAGED, generator=g)[:FULL_CLAMPS]] = 1
    value = torch.randn(rows, STAGED, generator=g)
    feats = torch.randperm(FULL_F, generator=g)[:STAGED].sort().values
    w_enc = (torch.randn(D, FULL_F, generator=g) * 0.02).bfloat16()
    w_dec = (torch.randn(FULL_F, D, generator=g) * 0.02).bfloat16()
    b_enc, thr = torch.zeros(FULL_F), torch.full((FULL_F,), 0.0 if topk else 0.05)
    pack = [mode_t, code, value, w_enc[:, feats].T.float().contiguous(), w_dec[feats].float(), b_enc[feats],
            thr[feats], feats, w_enc, b_enc, thr, w_dec, torch.zeros(D)]
    return [t.to(dev) for t in pack]


def _full_bytes(n: int, pack: list[torch.Tensor], active: int, recon: bool) -> int:
    """Bytes a full site must read / write beyond the norm: the index and modes; for ``active`` tokens their
    stream, W_enc once, pre written and read (float32), W_dec once for reconstruct (else the clampable features'
    float32 rows, ``dec``) and the edit written and read."""
    idle = n * 8
    if not active:
        return idle
    dec = D * FULL_F * 2 if recon else pack[4].numel() * 4
    return idle + D * FULL_F * 2 + dec + active * (3 * D * 4 + 2 * FULL_F * 4)


def _full_flop(n: int, pack: list[torch.Tensor], active: int, recon: bool) -> int:
    """Tensor-core flops of the on tokens: the encoder and (reconstruct) the decoder, each twice (the float32
    operand's bf16 hi and lo parts); a delta step's decode (float32, clampable rows) is small beside them."""
    if not active:
        return 0
    return 2 * 2 * active * D * FULL_F * (2 if recon else 1)


def _per_launch(fn, iters: int = 5) -> dict:
    """GPU µs per call of each kernel ``fn`` launches (torch.profiler; outside a graph), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name[:40]] = out.get(e.name[:40], 0.0) + e.time_range.elapsed_us() / iters
    return {k: round(v, 2) for k, v in out.items()}


def _full_rows(dev, w) -> list[dict]:
    rows = []
    for n in (16, 2048):
        x = torch.randn(n, D, dtype=torch.bfloat16, device=dev)
        res = torch.randn(n, D, dtype=torch.bfloat16, device=dev)
        steered = (torch.arange(n, device=dev, dtype=torch.int32) % FULL_SETS + 1)
        idle = torch.zeros(n, dtype=torch.int32, device=dev)
        base = _time(lambda: steered_norm_triton(x, res, w, 1e-5, 0.0, idle))
        rows.append({"n": n, "path": "plain norm", "clamps": 0, "us": round(base, 2)})
        for name, topk, mode in (("full TopK k64 idle", FULL_K, 0), ("full TopK k64 delta", FULL_K, 1),
                                 ("full JumpReLU reconstruct", 0, 2)):
            pack = _full_pack(topk, mode, dev)
            index = idle if mode == 0 else steered

            def call():
                return triton_path(x, res, w, 1e-5, 0.0, index, [], [], pack, [], topk, 0, [], None, None, None,
                                   None, [], [], [])

            us = _time(call, iters=50 if mode else 200)
            active = 0 if mode == 0 else n
            byt = _full_bytes(n, pack, active, mode == 2)
            flop = _full_flop(n, pack, active, mode == 2)
            rows.append({"n": n, "path": f"{name} (1 site, d_sae {FULL_F})", "clamps": FULL_CLAMPS if mode else 0,
                         "us": round(us, 2), "extra_us": round(us - base, 2), "bytes": byt,
                         "bound_us": round(max(byt / HBM_BYTES_PER_US, flop / BF16_FLOP_PER_US), 2),
                         "launches": _per_launch(call)})
    return rows


# (name, Tuning keywords): the encoder's and _select's candidates for the N 16 bound (issue 39); "default" is the
# engine's launch.
# N <= 64 share one tile (16 tokens x 64 features, 64-deep K tiles, 2 warps since s29; two K tiles a step under 528
# programs: N 1 and 16, one at N 64). s29's sweep (H100) dropped what lost everywhere: block_f 32, split_k 4, unroll 4
ENCODE_VARIANTS = [
    ("default", {}),
    ("warps 4", dict(warps=4)),
    ("warps 1", dict(warps=1)),
    ("hilo", dict(hilo=True)),
    ("hilo unroll 1", dict(hilo=True, unroll=1)),
    ("hilo stages 4", dict(hilo=True, stages=4)),
    ("hilo split_k 2", dict(hilo=True, split_k=2)),
    ("split_k 2", dict(split_k=2)),
    ("unroll 1", dict(unroll=1)),
    ("block_k 128 unroll 1", dict(block_k=128, unroll=1)),
    ("stages 5 unroll 1", dict(stages=5, unroll=1)),
    ("hilo stages 5 unroll 1", dict(hilo=True, stages=5, unroll=1)),
    # _select's warps: 8 the default since s31's H200 sweep (16 until then from d_sae 8192: timed once more)
    ("select warps 16", dict(select_warps=16)),
]


def _hbm_bytes_per_us() -> float:
    return 4.8e6 if "H200" in torch.cuda.get_device_name() else HBM_BYTES_PER_US


def _sweep_rows(dev, ns: list[int]) -> list[dict]:
    """Each variant per N: its edit against the default's (tokens off by more than rtol / atol 1e-3 of the edit's
    scale: a TopK boundary flip of a clamped feature can move one), the site's µs from a CUDA graph, each launch's GPU
    µs, and the bounds: W_enc's read (the encoder's), and the site's (W_enc + the clampable features' W_dec rows +
    the stream, pre and edit: ``_full_bytes``). Rows print as they come (a timeout keeps what ran)."""
    from vllm_steer.kernels.sae_clamp.full_triton import Tuning, site_edit

    bw = _hbm_bytes_per_us()
    pack = _full_pack(FULL_K, 1, dev)
    enc_bound = D * FULL_F * 2 / bw
    print(f"device {torch.cuda.get_device_name()}, HBM {bw / 1e6:.2f} TB/s; W_enc's read {enc_bound:.1f} µs\n"
          "| N | variant | check | site µs | _encode µs | _select µs | rest µs (launches) | encode bound µs "
          "| site bound µs |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for n in ns:
        g = torch.Generator(device="cpu").manual_seed(n)
        x = torch.randn(n, D, generator=g).to(dev, torch.bfloat16)
        res = torch.randn(n, D, generator=g).to(dev, torch.bfloat16)
        index = torch.arange(n + 1, device=dev, dtype=torch.int32) % FULL_SETS + 1
        want = site_edit(x, res, index, pack, FULL_K)
        scale = float(want.abs().max())
        for name, kw in ENCODE_VARIANTS:
            t = Tuning(**kw)

            def call(t=t):
                return site_edit(x, res, index, pack, FULL_K, tuning=t)

            try:
                got = call()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a variant that does not compile or launch is a result
                print(f"| {n} | {name} | {type(e).__name__}: {str(e)[:120]} | | | | | | |", flush=True)
                rows.append({"n": n, "variant": name, "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            off = int((~torch.isclose(got, want, rtol=1e-3, atol=1e-3 * scale).all(-1)).sum())
            us = _time(call, iters=100)
            launches = _per_launch(call)
            enc = sum(v for k, v in launches.items() if k.startswith("_encode"))
            sel = sum(v for k, v in launches.items() if k.startswith("_select"))
            rest = {k: v for k, v in launches.items() if not k.startswith(("_encode", "_select"))}
            site_bound = _full_bytes(n, pack, n, False) / bw
            row = {"n": n, "variant": name, "tokens_off": off, "us": round(us, 2), "encode_us": round(enc, 2),
                   "select_us": round(sel, 2), "rest": rest, "encode_bound_us": round(enc_bound, 2),
                   "site_bound_us": round(site_bound, 2)}
            rows.append(row)
            rest_s = " ".join(f"{k} {v}" for k, v in rest.items())
            print(f"| {n} | {name} | {'ok' if off == 0 else f'{off} of {n} tokens off'} | {row['us']} "
                  f"| {row['encode_us']} | {row['select_us']} | {round(sum(rest.values()), 2)} ({rest_s}) "
                  f"| {row['encode_bound_us']} | {row['site_bound_us']} |", flush=True)
    for n in ns:  # the pick: among variants whose edit matched the default's
        ok = [r for r in rows if r["n"] == n and r.get("tokens_off") == 0]
        base = next((r for r in ok if r["variant"] == "default"), None)
        if ok and base:
            site, enc = min(ok, key=lambda r: r["us"]), min(ok, key=lambda r: r["encode_us"])
            # _encode alone: hilo's _hilo and a split's sum (in _select) are in the site's time only
            sel = min(ok, key=lambda r: r["select_us"])
            print(f"N {n}: fastest site {site['variant']} {site['us']} µs (default {base['us']}); fastest _encode "
                  f"alone {enc['variant']} {enc['encode_us']} µs (default {base['encode_us']}, "
                  f"bound {base['encode_bound_us']}); fastest _select {sel['variant']} {sel['select_us']} µs "
                  f"(default {base['select_us']})")
    return rows


def _tile_sizes(n: int, x, res, w, index, pack) -> list[dict]:
    """The tiled clamps with tiles of 16, 32 and 64 tokens (``tiled_triton.tile_tokens`` overridden), and with the
    default tiles in IEEE float32 dots (FMA units) instead of ``PRECISION``'s."""
    from vllm_steer.kernels.sae_clamp import tiled_triton

    default, precision, rows = tiled_triton.tile_tokens, tiled_triton.PRECISION, []
    try:
        for t, prec in ((16, precision), (32, precision), (64, precision), (default(n), "ieee")):
            tiled_triton.tile_tokens, tiled_triton.PRECISION = (lambda _n, t=t: t), prec
            us = _time(lambda: steered_norm_triton(x, res, w, 1e-5, 0.0, index, sae_a=pack), iters=50)
            rows.append({"n": n, "path": f"clamp-only (Triton) tiled T {t} {prec}"
                         + (" (default)" if t == default(n) and prec == precision else ""),
                         "clamps": 64, "us": round(us, 2), "bound_us": round(_bound_us(n, 64, True), 2)})
    finally:
        tiled_triton.tile_tokens, tiled_triton.PRECISION = default, precision
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--full-only", action="store_true")
    ap.add_argument("--topk-sweep", action="store_true")
    ap.add_argument("--sweep-n", default="16,1,64")
    args = ap.parse_args()
    if args.topk_sweep:
        rows = _sweep_rows(torch.device("cuda"), [int(v) for v in args.sweep_n.split(",")])
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "D": D, "d_sae": FULL_F, "k": FULL_K,
                           "rows": rows}, f, indent=1)
        return
    from vllm_steer.kernels.steered_rms_norm import triton as kernel

    kernel.TILED = True  # the tiled prefill clamps (VLLM_STEER_SAE_TILED: off by default until their GPU tests pass)
    dev = torch.device("cuda")
    w = torch.ones(D, dtype=torch.bfloat16, device=dev)
    rows: list[dict] = _full_rows(dev, w)
    for n in () if args.full_only else (16, 64, 256, 512, 2048):
        x = torch.randn(n, D, dtype=torch.bfloat16, device=dev)
        res = torch.randn(n, D, dtype=torch.bfloat16, device=dev)
        steered = _rows(n, dev)  # every token clamps
        idle = torch.zeros(n, dtype=torch.int32, device=dev)
        base = _time(lambda: steered_norm_triton(x, res, w, 1e-5, 0.0, idle))
        rows.append({"n": n, "path": "plain norm", "clamps": 0, "us": round(base, 2)})
        # (name, launcher keywords, tiled): the splits of the walk in the norm, then past 64 tokens the tiles
        ways = [(f" split {s}" + (" (default)" if s == split_of(n) and not tiled_of(n) else ""),
                 {"split": s, "tiled": False}, False)
                for s in sorted({1, split_of(n)} | ({4, 8, 16} if n <= 16 else set()))]
        if tiled_of(n):
            ways.append((" tiled (default)", {}, True))
        for clamps in (0, 8, 32, 64, 128, 256):
            pack = _pack(clamps, dev)
            index = idle if clamps == 0 else steered
            for name, kw, tiled in ways:
                if tiled is False and tiled_of(n) and clamps > 64:  # the walk at prefill sizes: 64 clamps tell
                    continue
                us = _time(lambda: steered_norm_triton(x, res, w, 1e-5, 0.0, index, sae_a=pack, **kw),
                           iters=50 if n >= 512 and clamps else 200)
                path = "clamp-only (Triton)" + (" idle" if clamps == 0 else "") + name
                rows.append({"n": n, "path": path, "clamps": clamps, "us": round(us, 2),
                             "bound_us": round(_bound_us(n, clamps, tiled), 2)})
            if tiled_of(n) and n >= 512 and clamps == 64:  # the tile size the default picks, against the others
                rows += _tile_sizes(n, x, res, w, index, pack)
        for d_sae in (16384, 65536):
            if n > 256 and d_sae > 16384:
                continue
            full = _pack(64, dev) + [torch.randn(D, d_sae, device=dev) * 0.02, torch.zeros(d_sae, device=dev),
                                     torch.zeros(d_sae, device=dev), torch.randn(d_sae, D, device=dev) * 0.02,
                                     torch.zeros(D, device=dev)]
            s = x.float() + res.float()
            rows_l = steered.long()
            us = _time(lambda: apply_site_naive(s, rows_l, full, 0), iters=50)
            rows.append({"n": n, "path": f"whole SAE (torch, fp32) d_sae {d_sae}", "clamps": 64, "us": round(us, 1)})
    print("| tokens | path | clamps per token | µs | over the plain norm µs | bytes | bandwidth bound µs |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['n']} | {r['path']} | {r['clamps']} | {r['us']} | {r.get('extra_us', '')} | {r.get('bytes', '')} "
              f"| {r.get('bound_us', '')} |")
    for r in rows:  # the full path's launches, each's GPU time (profiled outside the graph)
        if r.get("launches"):
            print(f"{r['n']} tokens, {r['path']}: " + ", ".join(f"{k} {v} µs" for k, v in r["launches"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "D": D, "staged": STAGED, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
