"""Device buffers of directional projections (``steer.max_projections`` = K > 0), allocated once, updated in place.

Per hooked site of this rank: ``count`` [R] int32 (the row's live directions there; 0: none, what row 0 and
every row without projections at the site hold), ``dirs`` [R, K, D] float32 (unit directions) and ``bounds``
[R, K, 2] float32 (lo, hi: ablation is 0, 0), the steered norm's ``proj`` descriptor for the slot the site
is folded into (``kernels/steered_rms_norm``). Rows share the numbering of the steering tables: a config key
owns one row for its vectors, clamps and projections. A row is written with the config that takes it, and a
reused row's old sites are cleared first (count 0), as SAE rows are. Each tensor is allocated on its own, so
every view handed to the model is 16-byte aligned (NOTES: Inductor copies misaligned inputs).
Writes are control-plane (when a row is written), never per step; no host sync (staged in pinned buffers).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.runtime.pinned_ring import PinnedRing

Site = tuple[str, int]
_STAGING_SLOTS = 4  # pinned buffers per ring: a busy ring falls back to a fresh pinned block


class ProjectionTables:
    def __init__(self, sites: set[Site], num_rows: int, k: int, hidden: int, device: torch.device) -> None:
        self.k = k
        self.hidden = hidden
        self.descs: dict[Site, list[torch.Tensor]] = {
            site: [torch.zeros(num_rows, dtype=torch.int32, device=device),
                   torch.zeros(num_rows, k, hidden, dtype=torch.float32, device=device),
                   torch.zeros(num_rows, k, 2, dtype=torch.float32, device=device)]
            for site in sorted(sites)}
        # a row's directions and bounds are staged in pinned memory (one buffer per write, a part per site) and
        # copied non-blocking: a pageable host -> device copy would wait for the forward in flight
        n = max(1, len(self.descs))
        self._dirs_ring = PinnedRing((n, k, hidden), torch.float32, device, _STAGING_SLOTS)
        self._bounds_ring = PinnedRing((n, k, 2), torch.float32, device, _STAGING_SLOTS)
        self._written: dict[int, list[Site]] = {}  # row -> the sites whose count it set

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in self.descs.values() for t in d)

    def write_row(self, row: int, entries: list | None) -> int:
        """Give ``row`` the projections ``entries`` (``frontend.projection_spec`` wire form; sites of other
        ranks skipped) and none anywhere else it had some; bytes written. No host sync: device writes are
        kernel fills and non-blocking copies out of pinned buffers."""
        written = 0
        for site in self._written.pop(row, []):
            self.descs[site][0][row : row + 1].fill_(0)
            written += 4
        mine = [((hook, int(layer)), dirs, bounds) for hook, layer, dirs, bounds in entries or ()
                if (hook, int(layer)) in self.descs]  # others: another rank's sites
        if not mine:
            return written
        dirs_host, land_dirs = self._dirs_ring.stage()
        bounds_host, land_bounds = self._bounds_ring.stage()
        for j, (site, dirs, bounds) in enumerate(mine):
            count, d_table, b_table = self.descs[site]
            n = len(bounds) // 8
            dirs_host[j, :n] = np.frombuffer(dirs, dtype=np.float32).reshape(n, self.hidden)
            bounds_host[j, :n] = np.frombuffer(bounds, dtype=np.float32).reshape(n, 2)
            land_dirs(d_table[row, :n], (j, slice(0, n)))
            land_bounds(b_table[row, :n], (j, slice(0, n)))
            count[row : row + 1].fill_(n)
            written += len(dirs) + len(bounds) + 4
        self._written[row] = [site for site, _, _ in mine]
        return written
