"""Extracted vectors as module files: safetensors (``<hook>.<layer>``, what ``/v1/steering/modules``
reads; with ``emit="ablate"`` ``project.<hook>.<layer>``: directions the module ablates) and the GGUF
control vector llama.cpp and repeng read (``direction.N``: added to decoder layer N's output, our
``post_mlp`` at N; see ``frontend.module_files``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from vllm_steer.extract.pairs import ExtractError

Vectors = dict[str, dict[int, np.ndarray]]


EMITS = ("add", "ablate")  # what a module made of the vectors does: adds them, or ablates their directions


def safetensors_bytes(vectors: Vectors, metadata: dict[str, str], emit: str = "add") -> bytes:
    from safetensors.numpy import save

    prefix = "project." if emit == "ablate" else ""
    tensors = {f"{prefix}{hook}.{layer}": np.ascontiguousarray(v, np.float32) for hook, per in vectors.items()
               for layer, v in sorted(per.items()) if emit == "add" or np.any(v)}
    return save(tensors, metadata=metadata)


def gguf_bytes(vectors: Vectors, model_hint: str) -> bytes:
    import gguf

    other = sorted(set(vectors) - {"post_mlp"})
    if other:
        raise ExtractError(f"a GGUF control vector holds post_mlp vectors only (direction.N), not {other}; "
                           "write .safetensors instead")
    fd, path = tempfile.mkstemp(suffix=".gguf")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(path, "controlvector")
        writer.add_string("controlvector.model_hint", model_hint)
        writer.add_uint32("controlvector.layer_count", len(vectors.get("post_mlp", {})))
        for layer, v in sorted(vectors.get("post_mlp", {}).items()):
            writer.add_tensor(f"direction.{layer}", np.ascontiguousarray(v, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


def file_kind(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in (".safetensors", ".gguf"):
        raise ExtractError(f"{path}: the output must end in .safetensors or .gguf")
    return suffix[1:]
