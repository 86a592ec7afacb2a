"""msgspec type info built once, at import: ``prebuild(*structs)``.

msgspec (0.22) builds a Struct type's decoding info lazily, at its first ``convert`` / ``decode``, and two threads
doing that for the same type at once can crash the interpreter (a segfault in ``get_class_annotations``: the
extraction client's thread pool did, in CI; 5 of 30 runs of eight threads with a tiny switch interval). A module
whose Structs may first be decoded from several threads calls ``prebuild`` on them at import (the import lock
serializes it); a decoder built for a type builds the info of every Struct it contains.
"""

from __future__ import annotations

import msgspec


def prebuild(*structs: type) -> None:
    """Build and cache each type's msgspec decoding info now, in this thread."""
    for kind in structs:
        msgspec.json.Decoder(kind)
