"""HTTP client of the A/B suite: an async streaming client for /v1/completions and http_json.

Each request streams (``stream: true`` with usage) and records TTFT (first event with choices),
E2EL (last event), TPOT ((E2EL - TTFT) / (tokens - 1)) and the response's ``steering`` field.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw[:500].decode(errors="replace")


def _content_type(body: bytes) -> str:
    return "application/json" if body[:1] == b"{" else "application/msgpack"


async def _one(session, url: str, body: bytes) -> dict:
    rec: dict = {}
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"Content-Type": _content_type(body)}) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            first_t = None
            last_t = None
            first_obj = None
            last_payload = None
            n_events = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter()
                n_events += 1
                if first_t is None:
                    obj = json.loads(payload)
                    if obj.get("choices"):
                        first_t, first_obj = now, obj
                last_t, last_payload = now, payload
        t_end = time.perf_counter()
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return rec
    usage = None
    if last_payload is not None:
        try:
            usage = json.loads(last_payload).get("usage")
        except ValueError:
            pass
    if first_t is None or not usage:
        rec["error"] = f"no content or no usage (events={n_events})"
        return rec
    n_out = int(usage.get("completion_tokens") or 0)
    rec["ttft"] = first_t - t0
    rec["e2el"] = (last_t or t_end) - t0
    rec["tpot"] = (rec["e2el"] - rec["ttft"]) / (n_out - 1) if n_out > 1 else 0.0
    rec["out"] = n_out
    rec["prompt_tokens"] = usage.get("prompt_tokens")
    rec["events"] = n_events
    st = first_obj.get("steering")
    rec["steering"] = st if isinstance(st, dict) else None
    rec["t_start"], rec["t_end"] = t0, (last_t or t_end)
    return rec


async def _run_load(url: str, bodies: list[bytes], concurrency: int) -> tuple[list[dict], float, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=900, sock_connect=60)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    results: list[dict | None] = [None] * len(bodies)
    nxt = [0]
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def worker():
            while nxt[0] < len(bodies):
                i = nxt[0]
                nxt[0] += 1
                results[i] = await _one(session, url, bodies[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        t1 = time.perf_counter()
    return results, t0, t1  # type: ignore[return-value]


def run_load(server, bodies: list[bytes], concurrency: int) -> tuple[list[dict], float]:
    """POST ``bodies`` to ``server`` with ``concurrency`` in flight; returns the per-request
    records and the wall time (first send to last event)."""
    res, t0, t1 = asyncio.run(_run_load(server.base + "/v1/completions", bodies, concurrency))
    ends = [r["t_end"] for r in res if "t_end" in r]
    wall = (max(ends) if ends else t1) - t0
    return res, wall
