"""Device buffers of directional projections (``steer.max_projections`` = K > 0), allocated once, updated in place.

Per hooked site of this rank: ``count`` [R] int32 (the row's live directions there; 0: none, what row 0 and
every row without projections at the site hold), ``dirs`` [R, K, D] (unit directions, float32; in the model's dtype
with ``VLLM_STEER_PROJ_DIRS=model`` (``DIRS``): half the bytes a projecting token reads, an issue-38 variant off
until a GPU bench says otherwise; the directions are then rounded, so an ablation leaves ~1e-3 of the component)
and ``bounds`` [R, K, 2] float32 (lo, hi: ablation is 0, 0), the steered norm's ``proj`` descriptor for the slot
the site is folded into (``kernels/steered_rms_norm``). Rows share the numbering of the steering tables: a config key
owns one row for its vectors, clamps and projections. A row is written with the config that takes it, and a
reused row's sites are all rewritten (count 0 where it has none). Every view handed to the model is 16-byte aligned
(NOTES: Inductor copies misaligned inputs).
Writes are control-plane (when a row is written), never per step; no host sync (staged in pinned buffers).
Stored as one tensor per kind (``dirs`` [R, sites, K, D] so a row is one copy; ``bounds`` and ``count`` site-major,
so each site's view is contiguous): writing a row is five device operations whatever the number of sites (per-site
tensors took three per site: 96 at 32 sites, at every admission).

Each site's ``count[0]`` (row 0's, never a token's count: row 0 is the unsteered row) is the site's idle mark: -1 while
no live row has a projection there, 0 otherwise (a live row: one a running request holds, ``set_live``). The kernel
reads a token's count, direction and bounds only at a site not marked idle, so a server with projections pays for
them only at the sites some running request projects at (a project_n16 request ablating at post_mlp made every
steered token read a 16 KiB direction row at all 95 slots, 63 of them with count 0). Like the vector tables'
any-active flags (``runtime.tables``), the mark changes only when a site's number of live projecting rows crosses 0,
staged in a pinned ring as the rows are.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from vllm_steer.runtime.pinned_ring import PinnedRing

Site = tuple[str, int]
# the directions' dtype, read once at import: "float32" (default), "model" (the model's dtype), "bfloat16" or
# "float16" (whatever the model's: a unit vector's entries are within fp16's range, with 8x bf16's precision; how
# the CPU lane's float32 engines check the rounding against transformers' oracle)
DIRS = os.environ.get("VLLM_STEER_PROJ_DIRS", "float32")


def dirs_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the direction tables are stored in (``DIRS``)."""
    return {"model": model_dtype, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(DIRS, torch.float32)


class ProjectionTables:
    def __init__(self, sites: set[Site], num_rows: int, k: int, hidden: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.k = k
        self.hidden = hidden
        self.sites = sorted(sites)
        self._index = {site: i for i, site in enumerate(self.sites)}  # site -> its place in a row
        per16 = 16 // torch.empty((), dtype=dtype).element_size()  # elements in 16 bytes
        n, r_pad, d_pad = max(1, len(self.sites)), -(-num_rows // 4) * 4, -(-hidden // per16) * per16
        # one allocation per kind, a row's sites side by side where a row is written (one copy), each site's
        # view 16-byte aligned (padded rows and hidden size): the views are what the norms read
        self._dirs = torch.zeros(num_rows, n, k, d_pad, dtype=dtype, device=device)  # row-major: one copy
        # another dtype: the row lands in float32 on the device, then is cast there (a host-side cast would copy
        # from pageable memory, which waits for the forward in flight)
        self._dirs_f32 = (torch.zeros(n, k, d_pad, dtype=torch.float32, device=device) if dtype != torch.float32
                          else None)
        self._bounds = torch.zeros(n, r_pad, k, 2, dtype=torch.float32, device=device)
        self._count = torch.zeros(n, r_pad, dtype=torch.int32, device=device)
        self._count[:, 0] = -1  # every site idle: no live row projects anywhere yet
        self.descs: dict[Site, list[torch.Tensor]] = {
            site: [self._count[i, :num_rows], self._dirs[:, i, :, :hidden], self._bounds[i, :num_rows]]
            for site, i in self._index.items()}
        # a row is staged in pinned memory and copied non-blocking: a pageable host -> device copy would wait for
        # the forward in flight
        self._dirs_ring = PinnedRing((n, k, d_pad), torch.float32, device)
        self._bounds_ring = PinnedRing((n, k, 2), torch.float32, device)
        self._count_ring = PinnedRing((n,), torch.int32, device)
        self._idle_ring = PinnedRing((n,), torch.int32, device)
        self._projecting: set[int] = set()  # rows written with a projection somewhere
        self._sites_of: dict[int, np.ndarray] = {}  # row -> the sites (indices) where it projects
        self._running: set[int] = set()  # rows live in the runtime's sense (held by a running request)
        self._live_at = np.zeros(n, dtype=np.int64)  # per site: running rows that project there

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self._dirs, self._bounds, self._count, self._dirs_f32) if t is not None)

    def write_row(self, row: int, entries: list | None) -> int:
        """Give ``row`` the projections ``entries`` (``frontend.projection_spec`` wire form; sites of other
        ranks skipped) and none anywhere else; bytes written. At most five device operations (the row's
        directions, bounds and counts over every site of this rank, staged in pinned buffers and copied
        non-blocking), none for a row that had and gets no projection; no host sync."""
        assert row != 0, "row 0 is the unsteered row (its count holds the sites' idle marks)"
        mine = [(self._index[(hook, int(layer))], dirs, bounds) for hook, layer, dirs, bounds in entries or ()
                if (hook, int(layer)) in self._index]  # others: another rank's sites
        if not mine and row not in self._projecting:
            return 0
        sites = np.array(sorted({i for i, _, bounds in mine if len(bounds)}), dtype=np.int64)
        if row in self._running:  # rewritten while held (not done today: rows are written before they go live)
            self._move(self._sites_of.get(row), -1)
            self._move(sites, +1)
        self._sites_of[row] = sites
        count_host, land_count = self._count_ring.stage()
        count_host[:] = 0
        if mine:
            dirs_host, land_dirs = self._dirs_ring.stage()
            bounds_host, land_bounds = self._bounds_ring.stage()
            dirs_host[:], bounds_host[:] = 0, 0
            for i, dirs, bounds in mine:
                n = len(bounds) // 8
                dirs_host[i, :n, : self.hidden] = np.frombuffer(dirs, dtype=np.float32).reshape(n, self.hidden)
                bounds_host[i, :n] = np.frombuffer(bounds, dtype=np.float32).reshape(n, 2)
                count_host[i] = n
            if self._dirs_f32 is None:
                land_dirs(self._dirs[row])
            else:
                land_dirs(self._dirs_f32)
                self._dirs[row].copy_(self._dirs_f32)
            land_bounds(self._bounds[:, row])
            self._projecting.add(row)
        else:
            self._projecting.discard(row)
        land_count(self._count[:, row])
        return count_host.nbytes + (dirs_host.nbytes + bounds_host.nbytes if mine else 0)

    def set_live(self, row: int, live: bool) -> None:
        """``row`` became live (a running request holds it) or was released: the sites it projects at count it in
        (out); a site's idle mark (``count[site, 0]``) is written when its count crosses 0 (control plane)."""
        if live == (row in self._running):
            return
        (self._running.add if live else self._running.discard)(row)
        self._move(self._sites_of.get(row), 1 if live else -1)

    def _move(self, sites: np.ndarray | None, delta: int) -> None:
        """Count a running row in (+1) or out (-1) at ``sites``; land the marks if a site crossed 0."""
        if sites is None or sites.size == 0:
            return
        before = self._live_at > 0
        self._live_at[sites] += delta
        after = self._live_at > 0
        if not np.array_equal(before, after):
            host, land = self._idle_ring.stage()
            host[:] = np.where(after, 0, -1)
            land(self._count[:, 0])
