"""cProfile in every Python process of a server, for ``bench/idle_cost.py --profile`` (on PYTHONPATH only then).

With ``VLLM_STEER_IDLE_PROFILE=<dir>`` set, each process (the API server, the engine core, the capture host; a
forked child starts afresh) profiles every thread (before Python 3.12 each thread its own ``cProfile.Profile``, started on the
thread's first profiled call; thread CPU time, so a preempted thread's wait is not counted; from 3.12 one profiler
for the process, whose call counts are exact and own times mix threads) and writes the
merged stats to ``<dir>/<pid>.prof`` every 5 s and at exit, with
``<pid>.argv`` naming the process. Nothing happens without the variable.
"""

import os

_DIR = os.environ.get("VLLM_STEER_IDLE_PROFILE")

if _DIR:
    import atexit
    import cProfile
    import marshal
    import sys
    import threading
    import time

    _EVERY_S = 5.0
    # Python 3.12+ runs cProfile on sys.monitoring: one profiler per interpreter sees every thread, and a second
    # one fails ("Another profiling tool is already active"). There one profiler serves the whole process: call
    # counts stay exact, own times mix threads (read the counts).
    _PER_THREAD = sys.version_info < (3, 12)
    _profs: list = []
    _lock = threading.Lock()

    def _start_thread(*_a):
        # per thread: CPU time of the thread (preemption is not counted); one for the process: wall time (a thread
        # clock read by events of several threads could run backwards)
        prof = cProfile.Profile(time.thread_time_ns if _PER_THREAD else time.perf_counter_ns, 1e-9)
        with _lock:
            _profs.append(prof)
        prof.enable()  # replaces this thread's profile function (this one) with cProfile's

    def _dump() -> None:
        merged: dict = {}
        with _lock:
            profs = list(_profs)
        for prof in profs:
            try:
                prof.snapshot_stats()
            except Exception:
                continue
            for func, (cc, nc, tt, ct, callers) in prof.stats.items():
                old = merged.get(func)
                if old is None:
                    merged[func] = (cc, nc, tt, ct, dict(callers))
                    continue
                calls = dict(old[4])
                for k, v in callers.items():
                    o = calls.get(k)
                    calls[k] = v if o is None else tuple(a + b for a, b in zip(o, v))
                merged[func] = (old[0] + cc, old[1] + nc, old[2] + tt, old[3] + ct, calls)
        path = os.path.join(_DIR, f"{os.getpid()}.prof")
        with open(path + ".tmp", "wb") as fh:
            marshal.dump(merged, fh)
        os.replace(path + ".tmp", path)

    def _dumper() -> None:
        while True:
            time.sleep(_EVERY_S)
            try:
                _dump()
            except Exception:
                pass

    def _begin() -> None:
        os.makedirs(_DIR, exist_ok=True)
        with open(os.path.join(_DIR, f"{os.getpid()}.argv"), "w") as fh:
            fh.write(" ".join(sys.argv))
        if _PER_THREAD:
            threading.setprofile(_start_thread)
        _start_thread()
        threading.Thread(target=_dumper, daemon=True, name="idle-profile-dump").start()

    def _after_fork() -> None:
        for prof in _profs:
            prof.disable()
        _profs.clear()
        _begin()

    os.register_at_fork(after_in_child=_after_fork)
    atexit.register(_dump)
    _begin()
