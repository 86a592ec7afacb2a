"""The capture host's cost per decode step of the heavy arm, on the CPU (issue 37): every request capturing
post_mlp of every layer at its new token, through a consumer lane into the filesystem consumer (no fsync unless
``--fsync``).

Builds the packets a worker sends (``StepPlan.wire``: R requests x S sites, one row each, bf16 rows of D;
with ``--prompt P`` first one prefill packet of P rows per (request, site)), pickles them as the notifier
does, runs ``_HostLane._rows`` on each and publishes every request at the end. Prints the process's CPU per
step (lane and writer threads, from the first packet to the last publication: the ring's set-up is not
counted), the bytes written per CPU-second, ms per step for the lane (what must stay under an engine step, ~6.8 ms at
8b on an H100), the pickle round trip (the worker's notifier pays the dump), until the files are published,
the consumer's counters (``dropped_writes``: rows that found the writers' queue full) and the sync calls made
(``fsync`` and ``syncfs``, per request). ``--root`` puts the files on a given filesystem (default: a temporary
directory).

    python bench/capture_host_cost.py [--requests 16 --sites 32 --hidden 4096 --steps 300 --prompt 0 --fsync]
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time

import numpy as np

from vllm_steer.capture import filesystem as fs_module
from vllm_steer.capture.filesystem import FilesystemConsumer
from vllm_steer.runtime import capture_host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--sites", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=0, help="first a prefill packet of this many rows per (request, site)")
    ap.add_argument("--max-queued-mb", type=float, default=None, help="default: the consumer's")
    ap.add_argument("--threads", type=int, default=4, help="writer threads (the bench server's config: 4)")
    ap.add_argument("--fsync", action="store_true", help="fsync before publishing (the consumer's default)")
    ap.add_argument("--root", default=None, help="directory to write under (default: a temporary one)")
    a = ap.parse_args()
    syncs = {"fsync": 0, "syncfs": 0}
    real_fsync = os.fsync

    def counted_fsync(fd: int) -> None:
        syncs["fsync"] += 1
        real_fsync(fd)

    os.fsync = counted_fsync  # the consumer calls os.fsync (and os.syncfs where it exists)
    if hasattr(os, "syncfs"):
        real_syncfs = os.syncfs

        def counted_syncfs(fd: int) -> None:
            syncs["syncfs"] += 1
            real_syncfs(fd)

        os.syncfs = counted_syncfs
    libc_syncfs = getattr(fs_module, "_libc_syncfs", None)  # the ctypes fallback, where os has no syncfs
    if libc_syncfs is not None:
        def counted_libc(fd: int) -> int:
            syncs["syncfs"] += 1
            return libc_syncfs(fd)

        fs_module._libc_syncfs = counted_libc
    n = a.requests * a.sites
    ring = np.random.default_rng(0).integers(0, 2**16, (n * max(1, a.prompt), a.hidden), dtype=np.uint16)
    rids = [f"cmpl-{i:032x}-0" for i in range(a.requests)]
    sites = [("post_mlp", layer) for layer in range(a.sites)]
    groups = ([r for r in rids for _ in sites], [s for _ in rids for s in sites], list(range(n)),
              list(range(1, n + 1)))
    with tempfile.TemporaryDirectory(dir=a.root) as root:
        limit = {} if a.max_queued_mb is None else {"max_queued_mb": a.max_queued_mb}
        fs = FilesystemConsumer("fs", root=root, threads=a.threads, fsync=a.fsync, **limit)
        lane = capture_host._HostLane.__new__(capture_host._HostLane)  # no thread: the lane's work, timed here
        lane.bit, lane.instance, lane.consumer, lane.send = 1, "fs", fs, lambda msg: None
        pickled = 0.0
        cpu0, t0 = time.process_time(), time.perf_counter()
        if a.prompt:  # every request's prompt at once, as a prefill step hands it over
            p = a.prompt
            wire = (groups[0], groups[1], list(range(0, n * p, p)), list(range(p, n * p + 1, p)),
                    np.tile(np.arange(p, dtype=np.int64), n), np.ones(n * p, np.int64))
            lane._rows(-1, capture_host._Packet(ring, "bfloat16", 0, n * p, wire))
        for step in range(a.steps):
            wire = (*groups, np.full(n, 100 + step, np.int64), np.ones(n, np.int64))
            t = time.perf_counter()
            wire = pickle.loads(pickle.dumps(wire))
            pickled += time.perf_counter() - t
            lane._rows(step, capture_host._Packet(ring, "bfloat16", 0, n, wire))
        t1 = time.perf_counter()
        for fut in [fs.on_request_finished(r, {"prompt_len": 100}) for r in rids]:
            fut.result(timeout=120)
        user, system = (sum(x) for x in zip(*(_thread_cpu(t.native_id) for t in fs._threads)))
        writers = user + system
        fs.close()
        t2, cpu = time.perf_counter(), time.process_time() - cpu0
    written = n * a.hidden * 2 * (a.steps + a.prompt)
    print(f"process CPU {1e3 * cpu / (a.steps + 1):.2f} ms/step ({written / cpu / 1e9:.2f} GB per CPU-second), writer "
          f"threads {1e3 * writers / (a.steps + 1):.2f} ms/step ({written / max(writers, 1e-9) / 1e9:.2f} GB per CPU-second; "
          f"user {1e3 * user / (a.steps + 1):.2f}, system {1e3 * system / (a.steps + 1):.2f} ms/step); "
          f"{a.requests} requests x {a.sites} sites, D {a.hidden}, fsync {a.fsync}, {a.threads} writers: lane "
          f"{1e3 * (t1 - t0) / a.steps:.2f} ms/step (pickle round trip {1e3 * pickled / a.steps:.2f}), until published "
          f"{1e3 * (t2 - t0) / a.steps:.2f} ms/step, {written / (t2 - t0) / 1e9:.2f} GB/s written; syncs per request "
          f"{ {k: round(v / a.requests, 2) for k, v in syncs.items()} }; consumer stats {fs.stats()}")


def _thread_cpu(tid: int) -> tuple[float, float]:
    """A thread's CPU seconds (user, system) from /proc."""
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
