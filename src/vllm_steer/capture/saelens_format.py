"""The filesystem consumer's ``format="sae_lens"`` output: one Hugging Face ``datasets`` directory per
site, in the layout sae-lens's ``CacheActivationsRunner`` writes and its ``ActivationsStore`` reads
(``cached_activations_path``), written with pyarrow alone (the ``sae_lens`` extra; ``datasets`` is
not needed to write).

Layout read from sae-lens 6.x (``sae_lens/cache_activations_runner.py``: ``CacheActivationsRunner.__init__``
features, ``_create_shard``, ``_consolidate_shards``; ``sae_lens/training/activations_store.py``:
``ActivationsStore.load_cached_activation_dataset``, ``_load_buffer_from_cached``, in 6.5x
``_load_raw_llm_batch_from_cached``):
``datasets.load_from_disk(dir)``; one column named by the TransformerLens hook
(``blocks.L.hook_resid_pre|mid|post``, ``core.site_names``) whose feature is
``Array2D(shape=(context_size, d_in), dtype)``: each dataset row is one context window of
``context_size`` consecutive tokens; the ``token_ids`` column is optional there and not written here
(the consumer does not see token ids). On disk: ``dataset_info.json`` (the features), ``state.json``
(the list of arrow files) and ``data-NNNNN.arrow`` (Arrow IPC streams; Array2D is datasets'
``Array2DExtensionType``: ``list<list<dtype>>`` storage named in the field's ``ARROW:extension:*``
metadata, the features in the schema's ``huggingface`` metadata).

Tokens are packed per site in the order requests are published, each request's rows by position,
across request boundaries (as sae-lens packs its tokenized documents), into windows; every
``shard_mb`` of whole windows (or the whole windows that waited ``flush_s``) becomes one arrow file,
fsynced and renamed into place before
``state.json`` (replaced atomically) lists it, so the directory always loads. ``close()`` writes the
last whole windows; a tail shorter than a window is dropped (``index.json``: ``dropped_tail_tokens``).
A shard that cannot be written (disk full) is dropped with its windows (counted in ``write_errors``)
and the add that hit it raises. ``index.json`` gives each shard's byte offset of its values, so
numpy reads a shard without pyarrow: ``np.memmap(file, dtype, "r", offset, (windows, context, d_in))``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vllm_steer.core.site_names import TL_HOOKS

TL_NAME = {ours: tl for tl, ours in TL_HOOKS.items()}  # post_mlp -> hook_resid_post


def hook_name(hook: str, layer: int) -> str:
    """The sae-lens / TransformerLens name of a site: ``("post_mlp", 3)`` -> ``blocks.3.hook_resid_post``."""
    return f"blocks.{layer}.{TL_NAME[hook]}"


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as e:  # pragma: no cover - the extra is part of the CI lock
        raise ImportError("the filesystem consumer's format 'sae_lens' writes Arrow files: "
                          "pip install 'vllm-steer[sae_lens]' (pyarrow)") from e
    return pyarrow


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


class _Site:
    """One site's dataset directory and its window buffer (one shard's worth)."""

    def __init__(self, root: Path, name: str, context: int, hidden: int, dtype: np.dtype, shard_bytes: int) -> None:
        self.dir = root / name
        self.name, self.context, self.hidden, self.dtype = name, context, hidden, dtype
        window_bytes = context * hidden * dtype.itemsize
        limit = (2**31 - 1) // (context * hidden)  # arrow list offsets are int32
        self.windows_per_shard = max(1, min(shard_bytes // window_bytes, limit))
        self.buf = np.empty((self.windows_per_shard * context, hidden), dtype)
        self.filled = 0
        self.since = 0.0  # monotonic time the oldest buffered token came (0: none buffered)
        self.shards: list[dict] = []
        self.dropped_tail = 0
        self.lock = threading.Lock()
        self.features = {name: {"shape": [context, hidden], "dtype": str(dtype), "_type": "Array2D"}}
        # datasets' Array2DExtensionType, as its __arrow_ext_serialize__ spells it (datasets need not be installed)
        self.extension = {"ARROW:extension:name": "datasets.features.features.Array2DExtensionType",
                          "ARROW:extension:metadata": json.dumps([[context, hidden], str(dtype)])}

    def add(self, rows: np.ndarray) -> None:
        if not self.filled and len(rows):
            self.since = time.monotonic()
        i = 0
        while i < len(rows):
            k = min(len(rows) - i, len(self.buf) - self.filled)
            self.buf[self.filled : self.filled + k] = rows[i : i + k]
            self.filled += k
            i += k
            if self.filled == len(self.buf):
                self.flush()

    def flush(self) -> None:
        """Write the whole windows buffered as one shard (the tail stays buffered)."""
        windows = self.filled // self.context
        if not windows:
            return
        n = windows * self.context
        tail = self.buf[n : self.filled].copy()
        try:
            self._write_shard(self.buf[:n].reshape(windows, self.context, self.hidden))
        finally:  # written or dropped, those windows leave the buffer
            self.buf[: len(tail)] = tail
            self.filled = len(tail)
            self.since = time.monotonic() if len(tail) else 0.0

    def _write_shard(self, acts: np.ndarray) -> None:
        pa = _pyarrow()
        self.dir.mkdir(parents=True, exist_ok=True)
        windows = acts.shape[0]
        inner = pa.ListArray.from_arrays(
            pa.array(np.arange(windows * self.context + 1, dtype=np.int32) * self.hidden),
            pa.array(acts.reshape(-1)))
        column = pa.ListArray.from_arrays(pa.array(np.arange(windows + 1, dtype=np.int32) * self.context), inner)
        schema = pa.schema([pa.field(self.name, column.type, metadata=self.extension)],
                           metadata={"huggingface": json.dumps({"info": {"features": self.features}})})
        name = f"data-{len(self.shards):05d}.arrow"
        tmp = self.dir / (name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                with pa.ipc.new_stream(f, schema) as w:
                    w.write_batch(pa.record_batch([column], schema=schema))
                f.flush()
                os.fsync(f.fileno())
            whole = pa.memory_map(str(tmp)).read_buffer()
            column = pa.ipc.open_stream(whole).read_all().column(0).chunk(0)
            values = getattr(column, "storage", column).values.values  # an extension array once datasets is imported
            offset = values.buffers()[1].address - whole.address
            del whole, column, values
            os.replace(tmp, self.dir / name)
            self.shards.append({"file": name, "offset": int(offset), "windows": windows})
            self._write_state()
        except OSError:
            tmp.unlink(missing_ok=True)
            if self.shards and self.shards[-1]["file"] == name:  # renamed, but state.json not written
                self.shards.pop()
                (self.dir / name).unlink(missing_ok=True)
            raise

    def _write_state(self) -> None:
        _write_json(self.dir / "dataset_info.json", {"citation": "", "description": "", "features": self.features,
                                                      "homepage": "", "license": ""})
        _write_json(self.dir / "index.json", {"hook_name": self.name, "context_size": self.context,
                                              "d_in": self.hidden, "dtype": str(self.dtype), "shards": self.shards,
                                              "dropped_tail_tokens": self.dropped_tail})
        _write_json(self.dir / "state.json", {
            "_data_files": [{"filename": s["file"]} for s in self.shards],
            "_fingerprint": f"vllm-steer-{self.name}-{len(self.shards)}", "_format_columns": None,
            "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None})


class SaeLensDatasets:
    """Every site's dataset under ``root`` (thread-safe: writer threads publish concurrently)."""

    def __init__(self, root: Path, context_size: int, shard_mb: float, count: Callable[[str], None]) -> None:
        _pyarrow()  # refuse at start, not at the first publish
        if context_size < 1:
            raise ValueError(f"context_size must be >= 1, got {context_size}")
        self.root, self.context, self.count = Path(root), int(context_size), count
        self.shard_bytes = int(shard_mb * 2**20)
        self.sites: dict[str, _Site] = {}
        self.lock = threading.Lock()

    def _site(self, hook: str, layer: int, rows: np.ndarray) -> _Site:
        name = hook_name(hook, layer)
        with self.lock:
            site = self.sites.get(name)
            if site is None:
                site = self.sites[name] = _Site(self.root, name, self.context, rows.shape[1], rows.dtype,
                                                self.shard_bytes)
            return site

    def add(self, hook: str, layer: int, positions: np.ndarray, rows: np.ndarray) -> dict:
        """A published request's rows of one site, packed in position order. Returns where they went."""
        site = self._site(hook, layer, rows)
        order = np.argsort(positions, kind="stable")
        in_order = bool((order == np.arange(len(order))).all())
        with site.lock:
            first = sum(s["windows"] for s in site.shards) * self.context + site.filled
            try:
                step = site.windows_per_shard * self.context
                for i in range(0, len(rows), step):  # a memmap is read a shard at a time
                    site.add(np.asarray(rows[i : i + step] if in_order else rows[order[i : i + step]]))
            except OSError:
                self.count("write_errors")
                raise
        return {"hook_name": site.name, "first_token": first, "tokens": len(rows)}

    def flush_stale(self, max_age_s: float) -> None:
        """Write the whole windows of sites whose oldest buffered token waited ``max_age_s`` (writer
        threads call it when idle and after a publish), so a quiet server's tokens reach the disk."""
        now = time.monotonic()
        for site in list(self.sites.values()):
            if site.since and now - site.since >= max_age_s and site.filled >= site.context and site.lock.acquire(False):
                try:
                    site.flush()
                except OSError:
                    self.count("write_errors")
                finally:
                    site.lock.release()

    def close(self) -> None:
        """Write every site's last whole windows; a shorter tail is dropped (counted in index.json)."""
        for site in list(self.sites.values()):
            with site.lock:
                try:
                    site.flush()
                    site.dropped_tail = site.filled
                    site.filled = 0
                    if site.shards:
                        site._write_state()
                except OSError:
                    self.count("write_errors")
