"""How many capture pool rows one token of a request takes on a worker, by position class.

A worker's capture pool holds ``steer.capture_max_rows`` rows a step: one row per captured (site, token),
shared by every consumer that wants that cell (``runtime.capture_plan``). The scheduler keeps a step's cells
inside the pool by chunking capturing prefills (``engine.capture_budget``); it needs, per request, the rows a
token costs in each position class (``capture.spec.POSITION_CLASSES``: before the last prompt token, the last
prompt token, generated). Counted here, once per request, from its specs and the consumers' global specs:

- only the sites a worker hooks (``steer.layers``), per pipeline stage (each stage's pool holds its own sites;
  the widest stage is the request's cost);
- consumers reduced on the device to their ``last`` row (``activations``' ``reduce: last``) take no step rows
  (their slot rows are apart from the pool's step rows); ``mean`` ones do (their tokens may take step rows);
- explicit positions count in every class (an upper bound: which class they fall in depends on the prompt).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from vllm_steer.capture.consumer import reduces_on_device
from vllm_steer.capture.spec import POSITION_CLASSES, CaptureSpec

def takes_step_rows(cls: type, spec: CaptureSpec) -> bool:
    """Whether a consumer's cells occupy the step's pool rows (a device ``last`` reduction does not)."""
    return not (reduces_on_device(cls) and cls.device_reduce(dict(spec.params)) == "last")


def row_cost(specs: Iterable[tuple[CaptureSpec, type]], stage_of: Callable[[str, int], int],
             hooked: Any = None) -> tuple[int, int, int]:
    """Pool rows one token takes, per position class, on the widest pipeline stage. ``hooked``: the layers
    workers hook (None: all)."""
    cells: dict[tuple[int, int], set] = {}  # (class, stage) -> sites
    for spec, cls in specs:
        if not takes_step_rows(cls, spec):
            continue
        classes = POSITION_CLASSES.get(spec.positions, (0, 1, 2)) if isinstance(spec.positions, str) else (0, 1, 2)
        for hook, layer in spec.sites:
            if hooked is not None and layer not in hooked:
                continue
            stage = stage_of(hook, layer)
            for c in classes:
                cells.setdefault((c, stage), set()).add((hook, layer))
    return tuple(max((len(s) for (c, _), s in cells.items() if c == k), default=0) for k in range(3))
