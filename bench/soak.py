"""Soak: N minutes of mixed traffic (plain, inline vectors, module churn, SAE clamps, aborted capture streams, bad
inputs that must be 400s) against one vllm-steer server, then the checks: memory flat within a band, rows back to
zero, nothing unfinished, no unexpected status. CI runs half a minute of it (tests/test_soak.py). Each client
thread sends every kind once first (so a short run drives them all), then draws kinds at random.
    python bench/soak.py --base http://127.0.0.1:8000 --model MODEL --hidden 576 --minutes 20 --out soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import psutil


@dataclass
class SoakConfig:
    base: str
    model: str
    hidden: int
    pid: int
    minutes: float = 20.0
    threads: int = 4
    sample_s: float = 15.0
    sae: str | None = None  # an SAE the server loaded at start-up, to clamp
    sae_features: int = 8
    capture: str | None = None  # a capture consumer instance of the server
    api_key: str | None = None  # the steer api_key, for module registrations
    warmup_fraction: float = 1 / 3  # memory is compared against the first sample after this
    rss_band: float = 0.10  # allowed growth of each process's RSS after warm-up, relative ...
    rss_band_bytes: int = 96 << 20  # ... plus this much

    def auth(self) -> dict:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class SoakReport:
    samples: list[dict] = field(default_factory=list)
    answers: Counter = field(default_factory=Counter)  # "kind status" -> count
    unexpected: list[str] = field(default_factory=list)
    unfinished: int = 0
    final: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"samples": self.samples, "answers": dict(self.answers), "unexpected": self.unexpected[:50],
                "unfinished": self.unfinished, "final": self.final}


def _rss_by_process(pid: int) -> dict[str, int]:
    """RSS of the server process and every descendant, keyed by pid and name."""
    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            out[f"{p.pid}:{p.name()}"] = p.memory_info().rss
    return out


def _metrics(client: httpx.Client, base: str) -> dict[str, float]:
    lines = (line.rpartition(" ") for line in client.get(f"{base}/metrics", timeout=30).text.splitlines())
    return {name: float(value) for name, _, value in lines if name.startswith("vllm_steer_")}


KINDS = 7  # plain, inline, module churn, SAE clamps, capture-abort, bad NaN, bad hook


class _Traffic:
    """One client thread's loop: pick a kind, send it, count the answer."""

    def __init__(self, cfg: SoakConfig, report: SoakReport, deadline: float, seed: int, lock: threading.Lock) -> None:
        self.cfg, self.report, self.deadline, self.lock, self.seed = cfg, report, deadline, lock, seed
        self.rng = np.random.default_rng(seed)
        self.client = httpx.Client(timeout=120)
        self.sent = 0  # requests picked so far: the first KINDS go through every kind in turn

    def vec(self, seed: int) -> list[float]:
        return (np.random.default_rng(seed).standard_normal(self.cfg.hidden) * 2).astype(np.float32).tolist()

    def body(self, **extra: Any) -> dict:
        return {"model": self.cfg.model, "prompt": "The weather today is", "max_tokens": 8, "temperature": 0, **extra}

    def count(self, kind: str, status: int, ok: tuple[int, ...], text: str = "") -> None:
        with self.lock:
            self.report.answers[f"{kind} {status}"] += 1
            if status not in ok:
                self.report.unexpected.append(f"{kind}: {status} {text[:200]}")

    @contextlib.contextmanager
    def guard(self, kind: str, unfinished: bool = True):
        """A transport error is unexpected; ``unfinished``: the request never finished."""
        try:
            yield
        except httpx.HTTPError as e:
            with self.lock:
                self.report.unfinished += unfinished
                self.report.unexpected.append(f"{kind}: {type(e).__name__} {e}")

    def post(self, kind: str, ok: tuple[int, ...], path: str = "/v1/completions", unfinished: bool = True,
             **body: Any) -> None:
        with self.guard(kind, unfinished):  # json.dumps: NaN passes (the bad-nan requests)
            r = self.client.post(f"{self.cfg.base}{path}", content=json.dumps(body),
                                 headers={"content-type": "application/json", **self.cfg.auth()})
            self.count(kind, r.status_code, ok, r.text)

    def one(self) -> None:
        kind = (self.seed + self.sent) % KINDS if self.sent < KINDS else self.rng.integers(0, KINDS)
        self.sent += 1
        layer = int(self.rng.choice((1, 3, 5)))
        if kind == 0:
            self.post("plain", (200,), **self.body())
        elif kind == 1:  # a small pool of configs (rows reused) and one-off ones (rows evicted)
            seed = int(self.rng.integers(0, 6)) if self.rng.random() < 0.7 else int(self.rng.integers(10**6, 10**9))
            self.post("inline", (200, 503), **self.body(steering_vectors={"post_mlp": {str(layer): self.vec(seed)}}))
        elif kind == 2:  # module churn: register (replace), use at two scales, sometimes delete
            name = f"soak-{self.seed}-{int(self.rng.integers(0, 3))}"
            self.post("module-register", (201,), path="/v1/steering/modules", name=name, replace=True,
                      steering_vectors={"post_mlp": {str(layer): self.vec(int(self.rng.integers(0, 10**6)))}})
            for scale in (1.0, 0.5):
                self.post("module-use", (200, 503), **self.body(steering_module={"name": name, "scale": scale}))
            if self.rng.random() < 0.5:
                with self.guard("module-delete", unfinished=False):
                    r = self.client.delete(f"{self.cfg.base}/v1/steering/modules/{name}", headers=self.cfg.auth())
                    self.count("module-delete", r.status_code, (200, 204), r.text)
        elif kind == 3 and self.cfg.sae:
            clamps = [{"feature": int(f), "kind": "set", "value": float(self.rng.uniform(0, 8))}
                      for f in self.rng.choice(self.cfg.sae_features, size=2, replace=False)]
            self.post("sae", (200, 503), **self.body(sae={"name": self.cfg.sae, "clamps": clamps}))
        elif kind == 4 and self.cfg.capture:  # capture, the client gone after the first event
            body = self.body(stream=True, max_tokens=32,
                             capture={self.cfg.capture: {"layers": [layer], "hooks": ["post_mlp"], "positions": "all"}})
            with self.guard("capture-abort"), self.client.stream("POST", f"{self.cfg.base}/v1/completions",
                                                                 json=body) as r:
                self.count("capture-abort", r.status_code, (200,))
                next((line for line in r.iter_lines() if line.startswith("data: {")), None)
        elif kind == 5:
            bad = self.vec(1)
            bad[3] = float("nan")
            self.post("bad-nan", (400,), unfinished=False,
                      **self.body(stream=True, steering_vectors={"post_mlp": {"1": bad}}))
        else:
            self.post("bad-hook", (400,), **self.body(steering_vectors={"mid": {"1": self.vec(2)}}))

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            self.one()
        self.client.close()


def run_soak(cfg: SoakConfig) -> SoakReport:
    report, lock, start = SoakReport(), threading.Lock(), time.monotonic()
    deadline = start + cfg.minutes * 60
    threads = [threading.Thread(target=_Traffic(cfg, report, deadline, 1000 + i, lock).run, daemon=True)
               for i in range(cfg.threads)]
    for t in threads:
        t.start()
    with httpx.Client(timeout=30) as client:
        next_sample = start
        while any(t.is_alive() for t in threads):
            if time.monotonic() >= next_sample:
                next_sample += cfg.sample_s
                with lock:
                    answers, errors = sum(report.answers.values()), len(report.unexpected)
                m = _metrics(client, cfg.base)
                report.samples.append({"t": round(time.monotonic() - start, 1), "rss": _rss_by_process(cfg.pid),
                                       "rows_in_use": m.get("vllm_steer_rows_in_use", 0.0),
                                       "waiting_for_row": m.get("vllm_steer_requests_waiting_for_row", 0.0),
                                       "answers": answers, "unexpected": errors})
            if time.monotonic() > deadline + 300:  # a client stuck 5 minutes past the end: unfinished
                break
            time.sleep(0.5)
        report.unfinished += sum(t.is_alive() for t in threads)
        report.final = _settle(client, cfg)
    return report


def _settle(client: httpx.Client, cfg: SoakConfig, wait_s: float = 60.0) -> dict:
    """The server at rest after the traffic: rows, waiting requests, what the workers hold."""
    deadline = time.monotonic() + wait_s
    while True:
        m = _metrics(client, cfg.base)
        rows, waiting = m.get("vllm_steer_rows_in_use", -1.0), m.get("vllm_steer_requests_waiting_for_row", -1.0)
        if (rows == 0 and waiting == 0) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for module in client.get(f"{cfg.base}/v1/steering/modules").json().get("data", []):
        if module["name"].startswith("soak-"):  # leave the server as it was
            client.delete(f"{cfg.base}/v1/steering/modules/{module['name']}", headers=cfg.auth())
    modules = client.get(f"{cfg.base}/v1/steering/modules").json()
    status = client.get(f"{cfg.base}/v1/steering").json()  # what the workers hold once the churn is gone
    return {"rows_in_use": rows, "waiting_for_row": waiting, "rss": _rss_by_process(cfg.pid),
            "worker_module_versions": [w.get("module_versions") for w in status["workers"]],
            "modules": len(modules.get("data", [])),
            "row_evictions": m.get("vllm_steer_row_evictions_total"),
            "row_wait_timeouts": m.get("vllm_steer_row_wait_timeouts_total")}


def problems(report: SoakReport, cfg: SoakConfig) -> list[str]:
    """What an operator would call a failure; empty when the soak passed."""
    out = [f"unexpected answer: {u}" for u in report.unexpected[:10]]
    if report.unfinished:
        out.append(f"{report.unfinished} requests never finished")
    final = report.final
    if final.get("rows_in_use") != 0 or final.get("waiting_for_row") != 0:
        out.append(f"not back to rest: rows_in_use {final.get('rows_in_use')}, waiting {final.get('waiting_for_row')}")
    versions, modules = final.get("worker_module_versions", []), final.get("modules", 0)
    if any(v is None or v > modules for v in versions):
        out.append(f"workers hold {versions} module versions for {final.get('modules')} modules")
    warm = [s for s in report.samples if s["t"] >= cfg.minutes * 60 * cfg.warmup_fraction]
    if not warm:
        return out + ["no sample after warm-up: run longer"]
    base = warm[0]["rss"]
    for proc, rss in final.get("rss", {}).items():
        if proc in base and rss > base[proc] * (1 + cfg.rss_band) + cfg.rss_band_bytes:
            out.append(f"{proc}: RSS {base[proc] >> 20} MiB after warm-up -> {rss >> 20} MiB at the end")
    return out


def server_pid(port: int) -> int:
    """The pid of the process listening on ``port`` on this machine (the API server)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise LookupError(f"nothing listens on port {port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--pid", type=int, help="the API server's pid (its children are measured too); default: "
                    "the process listening on --base's port")
    for flag, kind, default in (("--minutes", float, 20.0), ("--threads", int, 4), ("--sample-s", float, 60.0),
                                ("--sae-features", int, 8)):
        ap.add_argument(flag, type=kind, default=default)
    for flag in ("--sae", "--capture", "--api-key", "--out"):
        ap.add_argument(flag)
    a = ap.parse_args()
    cfg = SoakConfig(**{k: v for k, v in vars(a).items() if k != "out"})
    cfg.pid = a.pid or server_pid(httpx.URL(a.base).port)
    report = run_soak(cfg)
    found = problems(report, cfg)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**report.to_json(), "problems": found, "config": vars(a)}, f, indent=1)
    for s in report.samples:
        print(f"t={s['t']:7.1f}s rss={sum(s['rss'].values()) >> 20} MiB rows={s['rows_in_use']:.0f} "
              f"waiting={s['waiting_for_row']:.0f} answers={s['answers']} unexpected={s['unexpected']}")
    print(json.dumps(report.final, indent=1))
    print("PASS" if not found else "FAIL:\n" + "\n".join(found))
    raise SystemExit(1 if found else 0)


if __name__ == "__main__":
    main()
