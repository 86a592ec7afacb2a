"""Capture consumers for tests/test_capture_lanes.py. They run in the capture host process (which
imports them by module path), so they are light to import and steered through files, not memory."""

from __future__ import annotations

import os
import time


class Stuck:
    """A driver whose every ``on_request_finished`` waits (≤ 60 s) for the file ``release`` to exist."""

    location = "driver"

    def __init__(self, instance: str, release: str = "", **params) -> None:
        self.release = release
        self.global_spec = None

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        pass

    def on_request_finished(self, request_id, meta):
        deadline = time.monotonic() + 60
        while self.release and not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"seen": request_id, "dropped_rows": meta.get("dropped_rows")}

    def close(self) -> None:
        pass


class Quick(Stuck):
    def on_request_finished(self, request_id, meta):
        return {"seen": request_id, "rows": meta.get("dropped_rows")}


class Raising(Stuck):
    """A driver whose ``on_request_finished`` raises; on a request asking ``{"die": true}`` it ends its process."""

    def on_request_finished(self, request_id, meta):
        if meta.get("params", {}).get("die"):
            os._exit(3)
        raise KeyError(f"no probe for {request_id}")

    @classmethod
    def validate_params(cls, params) -> None:
        return None


class Summing(Stuck):
    """A driver returning what it received: per site the positions and the rows' sum."""

    def __init__(self, instance: str, **params) -> None:
        super().__init__(instance)
        self.got: dict = {}

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        site = self.got.setdefault(request_id, {}).setdefault(f"{hook}.{layer}", [[], 0.0, None])
        site[0] += [int(p) for p in positions]
        site[1] += float(rows.astype("float64").sum())
        site[2] = str(rows.dtype)

    def on_request_finished(self, request_id, meta):
        return {"sites": self.got.pop(request_id, {}), "dropped": meta.get("dropped")}


class Recording(Summing):
    """A driver returning every row it received through ``on_rows`` (raw: bf16 as its bits), per site."""

    raw_rows = True

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        site = self.got.setdefault(request_id, {}).setdefault(f"{hook}.{layer}", [[], []])
        site[0] += [int(p) for p in positions]
        site[1] += rows.tolist()

    def on_request_finished(self, request_id, meta):
        return {"sites": self.got.pop(request_id, {})}


class Slow(Stuck):
    """A worker consumer taking ``delay`` seconds per ``on_rows`` call, each call a line in the file ``log``
    (request and positions), and "closed" there when it is closed."""

    location = "worker"

    def __init__(self, instance: str, log: str = "", delay: float = 0.0, **params) -> None:
        super().__init__(instance)
        self.log, self.delay = log, float(delay)

    @classmethod
    def validate_params(cls, params) -> None:
        return None

    def _write(self, line: str) -> None:
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        time.sleep(self.delay)
        self._write(f"{request_id} {' '.join(str(int(p)) for p in positions)}")

    def on_request_finished(self, request_id, meta) -> None:
        return None

    def close(self) -> None:
        self._write("closed")


class Burner:
    """A worker consumer whose ``on_rows`` burns CPU in pure Python (holding the GIL of whatever
    process runs it) when ``burn`` is set: the first call burns until the file ``stop`` exists (at most
    120 s), so it burns through whatever the test measures however fast the engine steps.
    ``on_request_finished`` adds the request, the seconds burned for it and its process id to the file ``log``."""

    location = "worker"

    def __init__(self, instance: str, burn: bool = False, log: str = "", stop: str = "", **params) -> None:
        self.burn, self.log, self.stop = bool(burn), log, stop
        self.global_spec = None
        self.burned: dict[str, float] = {}

    @classmethod
    def validate_params(cls, params) -> None:
        return None

    def on_rows(self, request_id, layer, hook, positions, rows, meta) -> None:
        t0 = time.perf_counter()
        x = 0
        while self.burn and time.perf_counter() - t0 < 120 and not os.path.exists(self.stop):
            for i in range(2000):
                x += i * i
        self.burn = False
        self.burned[request_id] = self.burned.get(request_id, 0.0) + time.perf_counter() - t0

    def on_request_finished(self, request_id, meta) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{request_id} {self.burned.pop(request_id, 0.0):.3f} {os.getpid()}\n")

    def close(self) -> None:
        pass


def register_entry_points(folder: str, consumers: dict[str, str]) -> str:
    """A distribution in ``folder`` advertising ``consumers`` (name -> "module:Class") in the
    ``vllm.capture_consumers`` group: put ``folder`` on an engine's PYTHONPATH to find them."""
    meta = os.path.join(folder, "vllm_steer_lane_tests-0.0.dist-info")
    os.makedirs(meta, exist_ok=True)
    with open(os.path.join(meta, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm-steer-lane-tests\nVersion: 0.0\n")
    with open(os.path.join(meta, "entry_points.txt"), "w") as f:
        f.write("[vllm.capture_consumers]\n" + "".join(f"{k} = {v}\n" for k, v in consumers.items()))
    return folder


def step_gaps(llm, prompt_ids: list[int], stop: str, log: str, steps: int = 12, warm: int = 3) -> dict:
    """An engine_job llm_call: per arm (``idle``, then ``burn``), two plain requests and one capturing
    every position to that arm's consumer decode together; the wall time of each engine step after
    ``warm`` steps is the inter-token gap of the plain requests (each step gives each one token).
    Then the burner is stopped (``stop``) and its report of the capturing request awaited in ``log``."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    out = {}
    for arm in ("idle", "burn"):
        ids = [f"{arm}-plain0", f"{arm}-plain1", f"{arm}-cap"]
        for rid in ids:
            capture = {arm: {"layers": [0], "hooks": ["post_mlp"], "positions": "all"}} if rid.endswith("cap") else None
            extra = {"extra_args": {"capture": capture}} if capture else {}
            eng.add_request(rid, {"prompt_token_ids": prompt_ids},
                            SamplingParams(temperature=0.0, max_tokens=steps + warm + 8, ignore_eos=True, **extra))
        gaps, t = [], time.perf_counter()
        for n in range(steps + warm):
            eng.step()
            now = time.perf_counter()
            if n >= warm:
                gaps.append(now - t)
            t = now
        eng.abort_request(ids)
        # one more step tells the workers those requests finished (their consumers hear of it)
        eng.add_request(f"{arm}-flush", {"prompt_token_ids": prompt_ids[:2]},
                        SamplingParams(temperature=0.0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
        out[arm] = gaps
    out["pid"] = os.getpid()  # the engine's process (uni executor, in-process core: the worker's too)
    open(stop, "w").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "burn-cap" not in (open(log).read() if os.path.exists(log) else ""):
        time.sleep(0.05)
    return out


class Counting(Stuck):
    """A driver counting finished requests in its own ``stats()`` (as the filesystem consumer counts write errors)."""

    def __init__(self, instance: str, **params) -> None:
        super().__init__(instance)
        self.finished = 0

    def on_request_finished(self, request_id, meta):
        self.finished += 1
        return {"seen": request_id}

    def stats(self) -> dict[str, int]:
        return {"write_errors": self.finished}
