"""``core.gc_watch``: the opt-in log of slow garbage collections (``VLLM_STEER_GC_WATCH``)."""

import gc
import logging

from vllm_steer.core import gc_watch


def test_slow_collections_are_logged_only_when_asked(monkeypatch, caplog):
    monkeypatch.setattr(gc_watch, "_watching", [])
    monkeypatch.delenv("VLLM_STEER_GC_WATCH", raising=False)
    assert gc_watch.install() is False and gc_watch._watching == []  # unset: nothing installed
    monkeypatch.setenv("VLLM_STEER_GC_WATCH", "0")  # every collection counts as slow
    assert gc_watch.install() is True
    watch = gc_watch._watching[0]
    try:
        assert gc_watch.install() is True and gc.callbacks.count(watch) == 1  # once a process
        with caplog.at_level(logging.WARNING, logger="vllm.steer.gc"):
            for _ in range(3):  # garbage only a collection frees: reference cycles
                a: list = []
                a.append(a)
            del a
            gc.collect(2)
        lines = [r.getMessage() for r in caplog.records if r.name == "vllm.steer.gc"]
        assert any(line.startswith("vllm-steer gc: generation 2 took ") for line in lines), lines
        collected = [int(line.split("(")[1].split()[0]) for line in lines if "generation 2" in line]
        assert max(collected) >= 3
    finally:
        gc.callbacks.remove(watch)
