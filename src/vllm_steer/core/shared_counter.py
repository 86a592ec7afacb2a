"""A generation number that one process writes and the other processes of the host read without a call.

It is an 8-byte file in ``/dev/shm`` (or the temp dir), mapped into memory. The engine core bumps it
whenever its module registry changes (``engine.module_registry``). Each API server process compares
it with the generation its cache holds (``frontend.registry_sync``): one memory read per request, and
a call to the engine core only after a change. An aligned 8-byte load or store is atomic on the
platforms vLLM runs on, so a reader sees the old or the new number, never a mix.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import tempfile
from pathlib import Path

_FMT = "<Q"


class SharedCounter:
    def __init__(self, path: str, owner: bool) -> None:
        self.path = path
        flags = os.O_RDWR if owner else os.O_RDONLY
        fd = os.open(path, flags)
        try:
            self._map = mmap.mmap(fd, 8, access=mmap.ACCESS_WRITE if owner else mmap.ACCESS_READ)
        finally:
            os.close(fd)

    @classmethod
    def create(cls) -> SharedCounter:
        """A new counter at 0, its file removed when this process exits."""
        shm = Path("/dev/shm")
        fd, path = tempfile.mkstemp(prefix="vllm-steer-gen-", dir=shm if shm.is_dir() else None)
        try:
            os.write(fd, struct.pack(_FMT, 0))
        finally:
            os.close(fd)
        atexit.register(_unlink, path)
        return cls(path, owner=True)

    @classmethod
    def open(cls, path: str) -> SharedCounter | None:
        """The counter another process created, read-only; None when its file is not on this host."""
        try:
            return cls(path, owner=False)
        except (OSError, ValueError):
            return None

    @property
    def value(self) -> int:
        return struct.unpack_from(_FMT, self._map, 0)[0]

    def bump(self) -> int:
        value = self.value + 1
        struct.pack_into(_FMT, self._map, 0, value)
        return value


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
