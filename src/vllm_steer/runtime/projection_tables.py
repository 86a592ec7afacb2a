"""Device buffers of directional projections (``steer.max_projections`` = K > 0), allocated once, updated in place.

Per hooked site of this rank: ``count`` [R] int32 (the row's live directions there; 0: none, what row 0 and
every row without projections at the site hold), ``dirs`` [R, K, D] float32 (unit directions) and ``bounds``
[R, K, 2] float32 (lo, hi: ablation is 0, 0), the steered norm's ``proj`` descriptor for the slot the site
is folded into (``kernels/steered_rms_norm``). Rows share the numbering of the steering tables: a config key
owns one row for its vectors, clamps and projections. A row is written with the config that takes it, and a
reused row's old sites are cleared first (count 0), as SAE rows are. Each tensor is allocated on its own, so
every view handed to the model is 16-byte aligned (NOTES: Inductor copies misaligned inputs).
Writes are control-plane (when a row is written), never per step; no host sync.
"""

from __future__ import annotations

import numpy as np
import torch

Site = tuple[str, int]


class ProjectionTables:
    def __init__(self, sites: set[Site], num_rows: int, k: int, hidden: int, device: torch.device) -> None:
        self.k = k
        self.hidden = hidden
        self.descs: dict[Site, list[torch.Tensor]] = {
            site: [torch.zeros(num_rows, dtype=torch.int32, device=device),
                   torch.zeros(num_rows, k, hidden, dtype=torch.float32, device=device),
                   torch.zeros(num_rows, k, 2, dtype=torch.float32, device=device)]
            for site in sorted(sites)}
        self._written: dict[int, list[Site]] = {}  # row -> the sites whose count it set

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in self.descs.values() for t in d)

    def write_row(self, row: int, entries: list | None) -> int:
        """Give ``row`` the projections ``entries`` (``frontend.projection_spec`` wire form; sites of other
        ranks skipped) and none anywhere else it had some; bytes written."""
        written = 0
        for site in self._written.pop(row, []):
            self.descs[site][0][row : row + 1].fill_(0)
            written += 4
        touched = []
        for hook, layer, dirs, bounds in entries or ():
            desc = self.descs.get((hook, int(layer)))
            if desc is None:
                continue  # another rank's site
            count, d_table, b_table = desc
            n = len(bounds) // 8
            d_table[row, :n].copy_(torch.from_numpy(np.frombuffer(dirs, dtype=np.float32).reshape(n, self.hidden).copy()))
            b_table[row, :n].copy_(torch.from_numpy(np.frombuffer(bounds, dtype=np.float32).reshape(n, 2).copy()))
            count[row : row + 1].fill_(n)
            touched.append((hook, int(layer)))
            written += len(dirs) + len(bounds) + 4
        if touched:
            self._written[row] = touched
        return written
