"""The capture host's cost for the heavy arm, on the CPU (issue 37): every request capturing post_mlp of every
layer at every position (its prompt in its first step, then one row a generated token), through the host's real
consumer lane (``capture_host._HostLane``, its own thread) into the filesystem consumer (no fsync unless
``--fsync``).

A closed loop like the GPU arm's client (``bench/ab_suite.py``, capture_fs_all_nosync: 64 requests at c16,
prompt 256 + 128 generated): ``--requests`` slots, each running one request at a time; a step (paced at
``--step-ms``) is one packet as a worker sends it (``StepPlan.wire``: request, then site, then token; bf16 rows
of D out of a ring), pickled and unpickled as the notifier and the host do; a request's finish notice follows its
last step's packet, and its slot takes the next request only once the request is published (the response waits
for its files), so late publications cost throughput as on the GPU. Prints, per step: the capture host's CPU
(lane thread + writer threads, from ``/proc``; user and system), bytes per CPU-second, and per request the
publication latency (finish notice -> published: p50 / p90 / max) and the slots' occupancy (a request's steps
over slots x steps elapsed: 100% when no slot waits for a publication, the stock server's), the consumer's
counters and the sync calls made. ``--root`` puts the files on a given filesystem (default: a temporary directory);
``--skip-row-writes`` leaves the rows' writes out (the kernel's page-cache copy, whose cost depends on the machine:
on the shared CPU box it is most of the writers' CPU) to time what the host itself does.

    python bench/capture_host_cost.py --requests 16 --sites 32 --hidden 4096 --prompt 256 [--gen 128 --total 64
        --step-ms 5 --stagger 0 --fsync --root DIR]
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import threading
import time

import numpy as np

from vllm_steer.capture import filesystem as fs_module
from vllm_steer.capture.filesystem import FilesystemConsumer
from vllm_steer.runtime import capture_host

MAX_ROW_PACKETS = 256  # the worker's bound on a lane's packets in flight (runtime.capture MAX_QUEUED_ROW_PACKETS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests (the client's slots)")
    ap.add_argument("--sites", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=256, help="prompt rows per (request, site), in its first step")
    ap.add_argument("--gen", type=int, default=128, help="decode steps per request (one row per site each)")
    ap.add_argument("--total", type=int, default=64, help="requests measured")
    ap.add_argument("--warmup", type=int, default=16, help="requests before them (a long-lived server is warm)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="engine step period (0: as fast as the host takes them)")
    ap.add_argument("--stagger", type=int, default=0, help="slot i's first request starts at step i x this")
    ap.add_argument("--max-queued-mb", type=float, default=None, help="default: the consumer's")
    ap.add_argument("--threads", type=int, default=4, help="writer threads (the bench server's config: 4)")
    ap.add_argument("--fsync", action="store_true", help="sync before publishing (the consumer's default)")
    ap.add_argument("--root", default=None, help="directory to write under (default: a temporary one)")
    ap.add_argument("--skip-row-writes", action="store_true",
                    help="rows are not written (the consumer's writes of over 4 KiB skipped): the host's own CPU "
                         "without the kernel's page-cache copy of the rows")
    a = ap.parse_args()
    syncs = _count_syncs()
    if a.skip_row_writes:
        real_write_all = fs_module._write_all
        fs_module._write_all = lambda fd, chunks: (real_write_all(fd, chunks) if sum(map(len, chunks)) <= 4096
                                                   else None)
    sites = [("post_mlp", layer) for layer in range(a.sites)]
    ring_rows = a.requests * a.sites * max(1, a.prompt)  # a step where every slot prefills
    ring = np.random.default_rng(0).integers(0, 2**16, (ring_rows, a.hidden), dtype=np.uint16)
    with tempfile.TemporaryDirectory(dir=a.root) as root:
        limit = {} if a.max_queued_mb is None else {"max_queued_mb": a.max_queued_mb}
        fs = FilesystemConsumer("fs", root=root, threads=a.threads, fsync=a.fsync, **limit)
        published: dict[str, float] = {}
        in_flight = [0]
        cond = threading.Condition()

        def send(msg: tuple) -> None:
            with cond:
                if msg[0] == "done":
                    in_flight[0] -= 1
                elif msg[0] == "finished":
                    published[msg[1]] = time.perf_counter()
                cond.notify_all()

        lane = capture_host._HostLane(1, "fs", fs, send)
        threads = {"lane": [lane.thread.native_id], "writers": [t.native_id for t in fs._threads]}
        # slot state: (request id, steps done) or None (waiting for its publication / no request left)
        slots: list[list | None] = [None] * a.requests
        start_at = [i * a.stagger for i in range(a.requests)]
        waiting: dict[int, str] = {}  # slot -> request whose publication it waits for
        finished_at: dict[str, float] = {}
        next_req, steps, busy_steps, dropped_packets, rows_sent = 0, 0, 0, 0, 0
        total = a.warmup + a.total
        cpu0, t0, step0 = None, time.perf_counter(), 0
        while len(published) < total:
            if a.step_ms:
                time.sleep(max(0.0, t0 + steps * a.step_ms / 1e3 - time.perf_counter()))
            if cpu0 is None and next_req >= a.warmup:  # measured from the first measured request's step
                cpu0, t1, step0, busy_steps, rows_sent = ({k: [_thread_cpu(t) for t in v] for k, v in threads.items()},
                                                          time.perf_counter(), steps, 0, 0)
            with cond:
                done = {s for s, rid in waiting.items() if rid in published}
            for s in done:
                del waiting[s]
            for s in range(a.requests):
                if slots[s] is None and s not in waiting and next_req < total and steps >= start_at[s]:
                    slots[s] = [f"cmpl-{next_req:032x}-0", -1]
                    next_req += 1
            rids, gsites, starts, ends, positions = [], [], [], [], []
            n = 0
            for s in range(a.requests):
                if slots[s] is None:
                    continue
                rid, k = slots[s]
                pos = np.arange(a.prompt, dtype=np.int64) if k < 0 else np.array([a.prompt + k], np.int64)
                for site in sites:
                    rids.append(rid)
                    gsites.append(site)
                    starts.append(n)
                    n += len(pos)
                    ends.append(n)
                    positions.append(pos)
            if n:
                busy_steps += sum(s is not None for s in slots)
                wire = (rids, gsites, starts, ends, np.concatenate(positions), np.ones(n, np.int64))
                with cond:
                    full = in_flight[0] >= MAX_ROW_PACKETS
                    in_flight[0] += not full
                if full:  # the worker never waits: the packet is dropped
                    dropped_packets += 1
                else:
                    wire = pickle.loads(pickle.dumps(wire))
                    lane.queue.put(("rows", steps, capture_host._Packet(ring, "bfloat16", 0, n, wire)))
                    rows_sent += n
            for s in range(a.requests):
                if slots[s] is None:
                    continue
                slots[s][1] += 1
                if slots[s][1] == a.gen:  # its last token: the finish notice follows the step's packet
                    rid = slots[s][0]
                    if int(rid.split("-")[1], 16) >= a.warmup:
                        finished_at[rid] = time.perf_counter()
                    lane.queue.put(("finish", rid, rid, {"prompt_len": a.prompt}))
                    waiting[s] = rid
                    slots[s] = None
            steps += 1
        elapsed, steps = time.perf_counter() - t1, steps - step0
        cpu = {k: [_thread_cpu(t) for t in v] for k, v in threads.items()}
        lane.queue.put(None)
        lane.thread.join()
        stats = fs.stats()
        fs.close()
    user = {k: sum(c[0] for c in cpu[k]) - sum(c[0] for c in cpu0[k]) for k in cpu}
    system = {k: sum(c[1] for c in cpu[k]) - sum(c[1] for c in cpu0[k]) for k in cpu}
    host = sum(user.values()) + sum(system.values())
    written = rows_sent * a.hidden * 2
    lat = np.array([published[r] - finished_at[r] for r in finished_at]) * 1e3
    per = 1e3 / steps
    print(f"{a.requests} x {a.sites} sites, D {a.hidden}, prompt {a.prompt} + {a.gen}, {a.total} requests (after "
          f"{a.warmup}), step "
          f"{a.step_ms} ms, fsync {a.fsync}, {a.threads} writers{', rows not written' * a.skip_row_writes}: {steps} steps, {written / 1e9:.2f} GB in "
          f"{elapsed:.1f} s ({written / elapsed / 1e9:.2f} GB/s)\n"
          f"  host CPU {per * host:.2f} ms/step ({written / max(host, 1e-9) / 1e9:.2f} GB per CPU-second): "
          + ", ".join(f"{k} {per * (user[k] + system[k]):.2f} (user {per * user[k]:.2f}, system {per * system[k]:.2f})"
                      for k in cpu)
          + f"\n  publication after the finish notice p50 {np.percentile(lat, 50):.1f} / p90 "
          f"{np.percentile(lat, 90):.1f} / max {lat.max():.1f} ms; slots busy {100 * busy_steps / (a.requests * steps):.1f}%"
          f"; packets dropped (lane behind) {dropped_packets}; syncs per request "
          f"{ {k: round(v / a.total, 2) for k, v in syncs.items()} }; consumer stats {stats}")


def _count_syncs() -> dict[str, int]:
    """Count the consumer's fsync and syncfs calls (it calls ``os.fsync``, and ``os.syncfs`` or libc's)."""
    syncs = {"fsync": 0, "syncfs": 0}

    def counted(name: str, fn):
        def call(fd: int):
            syncs[name] += 1
            return fn(fd)
        return call

    os.fsync = counted("fsync", os.fsync)
    if hasattr(os, "syncfs"):
        os.syncfs = counted("syncfs", os.syncfs)
    if getattr(fs_module, "_libc_syncfs", None) is not None:
        fs_module._libc_syncfs = counted("syncfs", fs_module._libc_syncfs)
    return syncs


def _thread_cpu(tid: int) -> tuple[float, float]:
    """A thread's CPU seconds (user, system) from /proc."""
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
