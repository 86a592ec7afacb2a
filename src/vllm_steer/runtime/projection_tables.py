"""Device buffers of directional projections (``steer.max_projections`` = K > 0), allocated once, updated in place.

Per hooked site of this rank: ``count`` [R] int32 (the row's live directions there; 0: none, what row 0 and
every row without projections at the site hold), ``dirs`` [R, K, D] float32 (unit directions) and ``bounds``
[R, K, 2] float32 (lo, hi: ablation is 0, 0), the steered norm's ``proj`` descriptor for the slot the site
is folded into (``kernels/steered_rms_norm``). Rows share the numbering of the steering tables: a config key
owns one row for its vectors, clamps and projections. A row is written with the config that takes it, and a
reused row's sites are all rewritten (count 0 where it has none). Every view handed to the model is 16-byte aligned
(NOTES: Inductor copies misaligned inputs).
Writes are control-plane (when a row is written), never per step; no host sync (staged in pinned buffers).
Stored as one tensor per kind (``dirs`` [R, sites, K, D] so a row is one copy; ``bounds`` and ``count`` site-major,
so each site's view is contiguous): writing a row is five device operations whatever the number of sites (per-site
tensors took three per site: 96 at 32 sites, at every admission).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.runtime.pinned_ring import PinnedRing

Site = tuple[str, int]


class ProjectionTables:
    def __init__(self, sites: set[Site], num_rows: int, k: int, hidden: int, device: torch.device) -> None:
        self.k = k
        self.hidden = hidden
        self.sites = sorted(sites)
        self._index = {site: i for i, site in enumerate(self.sites)}  # site -> its place in a row
        n, r_pad, d_pad = max(1, len(self.sites)), -(-num_rows // 4) * 4, -(-hidden // 4) * 4
        # one allocation per kind, a row's sites side by side where a row is written (one copy), each site's
        # view 16-byte aligned (padded rows and hidden size): the views are what the norms read
        self._dirs = torch.zeros(num_rows, n, k, d_pad, dtype=torch.float32, device=device)  # row-major: one copy
        self._bounds = torch.zeros(n, r_pad, k, 2, dtype=torch.float32, device=device)
        self._count = torch.zeros(n, r_pad, dtype=torch.int32, device=device)
        self.descs: dict[Site, list[torch.Tensor]] = {
            site: [self._count[i, :num_rows], self._dirs[:, i, :, :hidden], self._bounds[i, :num_rows]]
            for site, i in self._index.items()}
        # a row is staged in pinned memory and copied non-blocking: a pageable host -> device copy would wait for
        # the forward in flight
        self._dirs_ring = PinnedRing((n, k, d_pad), torch.float32, device)
        self._bounds_ring = PinnedRing((n, k, 2), torch.float32, device)
        self._count_ring = PinnedRing((n,), torch.int32, device)
        self._live: set[int] = set()  # rows with a projection somewhere

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self._dirs, self._bounds, self._count))

    def write_row(self, row: int, entries: list | None) -> int:
        """Give ``row`` the projections ``entries`` (``frontend.projection_spec`` wire form; sites of other
        ranks skipped) and none anywhere else; bytes written. At most five device operations (the row's
        directions, bounds and counts over every site of this rank, staged in pinned buffers and copied
        non-blocking), none for a row that had and gets no projection; no host sync."""
        mine = [(self._index[(hook, int(layer))], dirs, bounds) for hook, layer, dirs, bounds in entries or ()
                if (hook, int(layer)) in self._index]  # others: another rank's sites
        if not mine and row not in self._live:
            return 0
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
            land_dirs(self._dirs[row])
            land_bounds(self._bounds[:, row])
            self._live.add(row)
        else:
            self._live.discard(row)
        land_count(self._count[:, row])
        return count_host.nbytes + (dirs_host.nbytes + bounds_host.nbytes if mine else 0)
