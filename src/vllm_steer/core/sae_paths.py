"""Which files an SAE load may open: the path policy of runtime SAE registrations (issue 30).

``POST /v1/steering/sae`` and ``register_sae(llm, ...)`` name files on the server. They may only name
files inside ``steer.sae_root`` (one directory or several), judged after resolving symlinks and ``..``
(``os.path.realpath``), for the path given and for every file actually opened (a manifest's per-site
files, a sae-lens folder's two files, a Gemma Scope ``params.npz``). Only regular files are opened
(``os.stat`` + ``S_ISREG`` before the open, the descriptor's ``fstat`` compared after it), each of at
most ``steer.max_sae_bytes`` (per file, checked before reading). A path outside every root, missing,
a symlink or ``..`` leaving the root, or not a regular file (or, for the path given, a directory) is
one ``SaePathError`` with one message whatever the reason, so answers never tell whether a file
exists. Without a root, registration by path is off. The API process checks before the engine is
asked; every worker checks again with the same ``FileAccess`` (built from the steer config) before
it reads. Start-up ``steer.sae`` entries are the operator's own: ``UNRESTRICTED`` (regular files only).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import BinaryIO

DENIED = ("no SAE this server may read at this path: it must be a file or directory inside steer.sae_root "
          "(after resolving symlinks and '..')")
NO_ROOT = ("registering SAEs by path is off on this server: start it with steer.sae_root (the directories "
           "runtime registrations may read)")


class SaePathError(PermissionError):
    """A path a runtime registration may not read (403 naming ``path``); the message never says why."""

    def __init__(self, message: str = DENIED) -> None:
        super().__init__(message)

    @staticmethod
    def within(e: BaseException) -> SaePathError | None:
        """The refusal carried by ``e`` (a worker's, re-raised by vLLM's collective_rpc as another type)."""
        text = str(e)
        return next((SaePathError(m) for m in (DENIED, NO_ROOT) if m in text), None)


class SaeFileRefused(ValueError):
    """A file inside the roots that is not read: over the size cap, or not a regular file (unrestricted)."""


@dataclass(frozen=True)
class FileAccess:
    """``roots`` None: any path (start-up config); ``()``: none (no steer.sae_root). ``max_bytes``
    None: no cap."""

    roots: tuple[str, ...] | None
    max_bytes: int | None = None

    def _real(self, path: str) -> str:
        """The resolved path; SaePathError unless it lies inside a root (when roots are set)."""
        if self.roots is not None and not self.roots:
            raise SaePathError(NO_ROOT)
        try:
            real = os.path.realpath(os.fspath(path))
        except ValueError:  # an embedded NUL byte
            if self.roots is None:
                raise
            raise SaePathError() from None
        if self.roots is not None and not any(_inside(real, os.path.realpath(r)) for r in self.roots):
            raise SaePathError()
        return real

    def resolve(self, path: str) -> str:
        """Check the path a registration names (a file or a directory); returns it resolved."""
        real = self._real(path)
        if self.roots is not None:
            try:
                mode = os.stat(real).st_mode
            except OSError:
                raise SaePathError() from None
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise SaePathError()
        return real

    def open(self, path: str) -> BinaryIO:
        """``path`` opened for reading in binary, once it passed every check. OSError (e.g. not found)
        passes through when roots are None."""
        real = self._real(path)
        try:
            before = os.stat(real)
        except OSError:
            if self.roots is None:
                raise
            raise SaePathError() from None
        self._check(before)
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO swapped in never blocks
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            raise SaePathError() if self.roots is not None else SaeFileRefused("changed while being opened")
        return os.fdopen(fd, "rb")

    def _check(self, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise SaePathError() if self.roots is not None else SaeFileRefused("not a regular file")
        if self.max_bytes is not None and st.st_size > self.max_bytes:
            raise SaeFileRefused(f"{st.st_size} bytes, over steer.max_sae_bytes ({self.max_bytes})")

    def shown(self, path: str) -> str:
        """How an error names a file: relative to its root (the path as given without roots)."""
        if not self.roots:
            return path
        real = os.path.realpath(path)
        for r in self.roots:
            root = os.path.realpath(r)
            if _inside(real, root):
                return os.path.relpath(real, root)
        return os.path.basename(path)


UNRESTRICTED = FileAccess(None)


def _inside(real: str, root: str) -> bool:
    return os.path.commonpath([root, real]) == root


def runtime_access(sae_root: tuple[str, ...] | None, max_sae_bytes: int) -> FileAccess:
    """What runtime registrations may read under ``steer.sae_root`` / ``steer.max_sae_bytes``."""
    return FileAccess(tuple(sae_root or ()), max_sae_bytes)
