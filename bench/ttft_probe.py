"""Where a request's time to first token goes, per server: client TTFT against vLLM's own histograms.

Adopts the A/B suite's kept servers (``ab_suite.py --phases start --keep-servers``) and sends, in
rounds that rotate the server order, batches of unsteered streaming requests (fresh random prompts,
so no prefix-cache hit) at each concurrency. Around every batch it scrapes the server's /metrics, so
each batch also yields the means of vLLM's ``time_to_first_token`` (from ``process_inputs`` to the
first token in the output processor), ``request_queue_time`` and ``request_prefill_time``
(engine core). Client TTFT minus vLLM's TTFT is the API process's share (HTTP, middleware, handler,
streaming the first chunk); queue + prefill is the engine's.

With ``--profile`` each server is then profiled (vLLM's /start_profile, the servers' torch profiler)
over prefill-only batches (max_tokens 1, one at concurrency 1 and one at 16): GPU time per kernel
name, eager kernels and the host events, parsed by abkit.profile_graph.

    python3 bench/ttft_probe.py --servers stock,disabled,steer --concurrency 1,16 --rounds 8 --out $OUT/ttft.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from abkit.arms import build_bodies, make_prompts, seed_of  # noqa: E402
from abkit.client import http_json, http_text, run_load  # noqa: E402
from abkit.common import log, set_log  # noqa: E402
from abkit.profile_graph import _new_trace, parse_trace  # noqa: E402
from abkit.servers import STATE_FILE  # noqa: E402
from abkit.stats import delta, mean_sem, pct  # noqa: E402

HISTOGRAMS = {"vllm_ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
              "prefill": "vllm:request_prefill_time_seconds"}


def scrape(base: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram, summed over label sets."""
    text = http_text(base + "/metrics")
    out = {}
    for key, name in HISTOGRAMS.items():
        s = c = 0.0
        for m in re.finditer(rf"^{re.escape(name)}_(sum|count)(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
            if m.group(1) == "sum":
                s += float(m.group(2))
            else:
                c += float(m.group(2))
        out[key] = (s, c)
    return out


def batch(base: str, bodies: list[bytes], concurrency: int) -> dict:
    before = scrape(base)
    res, _ = run_load(base, bodies, concurrency)
    after = scrape(base)
    errors = [r["error"] for r in res if "error" in r]
    if errors:
        raise RuntimeError(f"{base}: {len(errors)} failed requests, e.g. {errors[0]}")
    ttfts = sorted(r["ttft"] * 1e3 for r in res)
    out = {"client_ttft_med": pct(ttfts, 0.5), "client_ttft_mean": sum(ttfts) / len(ttfts)}
    for key in HISTOGRAMS:
        ds, dc = after[key][0] - before[key][0], after[key][1] - before[key][1]
        out[key] = ds / dc * 1e3 if dc else float("nan")
    out["api_share"] = out["client_ttft_mean"] - out["vllm_ttft"]
    return out


def profile_prefill(name: str, base: str, args) -> dict:
    """Kernel and host totals of the server's trace over two prefill-only batches (c1, c16)."""
    server = type("S", (), {"prof_dir": Path(args.workdir) / "prof" / name})
    before = set(server.prof_dir.rglob("*.json*"))
    bodies = [build_bodies(make_prompts(n, args.prompt_len, args.vocab, seed_of("prof", name, n)), [None] * n, 1)
              for n in (8, 16)]
    st, _ = http_json("POST", base + "/start_profile", timeout=120)
    if st != 200:
        raise RuntimeError(f"{name}: /start_profile -> {st}")
    run_load(base, bodies[0], 1)
    run_load(base, bodies[1], 16)
    http_json("POST", base + "/stop_profile", timeout=300)
    rec = parse_trace(_new_trace(server, before))
    return {k: rec[k] for k in ("kernels", "kernel_us", "gpu_span_us", "graph_launches", "kernels_per_launch_hist",
                                "eager_kernels", "eager_kernel_us", "eager_top_kernels", "top_kernels_us",
                                "top_host_us")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="stock,disabled,steer")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="requests per batch")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default="ttft_probe.json")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--workdir", default="/tmp/vllm_steer_ab", help="the A/B suite's (its servers' prof/ dirs)")
    args = ap.parse_args()
    set_log("ttft_probe")
    state = json.loads(STATE_FILE.read_text())
    names = [n for n in args.servers.split(",") if n in state]
    bases = {n: f"http://127.0.0.1:{state[n]['port']}" for n in names}
    log(f"servers: {bases}")
    runs: dict = {}
    for conc in [int(c) for c in args.concurrency.split(",") if c]:
        for base in bases.values():  # warm-up batch, not recorded
            run_load(base, build_bodies(make_prompts(conc, args.prompt_len, args.vocab, seed_of("warm", conc)),
                                        [None] * conc, args.max_tokens), conc)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                prompts = make_prompts(args.requests, args.prompt_len, args.vocab, seed_of(n, conc, r))
                rec = batch(bases[n], build_bodies(prompts, [None] * args.requests, args.max_tokens), conc)
                runs.setdefault(str(conc), {}).setdefault(n, []).append(rec)
                log(f"c{conc} round {r} {n}: " + " ".join(f"{k} {v:.2f}" for k, v in rec.items()))
    summary: dict = {}
    for conc, per in runs.items():
        for n, recs in per.items():
            summary.setdefault(conc, {})[n] = {k: mean_sem([x[k] for x in recs]) for k in recs[0]}
        if "stock" in per:
            for n in per:
                if n != "stock":
                    summary[conc][f"{n}-stock"] = {k: delta(summary[conc][n][k], summary[conc]["stock"][k])
                                                   for k in summary[conc]["stock"]}
    profiles = {}
    if args.profile:
        for n in names:
            profiles[n] = profile_prefill(n, bases[n], args)
            p = profiles[n]
            log(f"profile {n}: kernels {p['kernels']} ({p['kernel_us']} us), span {p['gpu_span_us']} us, "
                f"eager {p['eager_kernels']} ({p['eager_kernel_us']} us); top {p['top_kernels_us'][:8]}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary,
                                          "profiles": profiles}, indent=1))
    for conc, per in summary.items():
        log(f"concurrency {conc} (ms, mean ± SEM over {args.rounds} batches of {args.requests})")
        for n, s in per.items():
            log(f"  {n:>16}: " + "  ".join(f"{k} {_fmt(v)}" for k, v in s.items()))


def _fmt(v) -> str:
    if isinstance(v, dict):
        return f"{v['delta']:+.2f}±{v['se']:.2f}{'*' if v['significant'] else ''}"
    return f"{v[0]:.2f}±{v[1]:.2f}"


if __name__ == "__main__":
    main()
