"""Host-side capture state of the step for the ops' eager path: "does anyone capture this step?" and the step's
plan when it is made inside the forward.

Outside CUDA graphs (eager mode, or batches larger than the largest captured size) the ops are called from
Python every step, so one may return at once when the runtime said that nothing is captured. While a CUDA graph is
being captured it never skips: the graph must hold the kernel, and the per-token plan decides at replay.

An eager step's capture plan may be left to its forward (``deferred``, set by the worker runtime before the forward):
the first op that captures calls ``ready`` before its launch, so the plan is made while the GPU runs the layers
before that site instead of before the forward's first launch (a prefill step's GPU idles for host work done before
the launch; s37). A step a CUDA graph replays never defers: no Python runs inside it.
"""

import torch

capture_live = True  # set by the worker runtime before each forward's first capturing op
deferred = None  # the step's capture plan, made by the first capturing op of an eager forward (``ready``)
# the plan rows (by ``data_ptr``) a request may capture at: every other site's row holds -1 whatever the step's plan
# (None: no capture runtime keeps it here, every row may hold cells)
wanted: frozenset | None = None


def ready(*plans) -> None:
    """Make the step's deferred capture plan now (once; nothing when none is pending) if one of ``plans`` (an op's
    plan rows, None where it has none) is a row a request may capture at, or when called without any. Every op that
    reads the capture plan calls it with its rows before its launch (and before ``may_skip``): an op at a site no
    request captures (layer 0's ``capture_rows_`` op of a server whose requests capture deeper layers) does not make
    the plan there, at the forward's start where the GPU has nothing queued to hide it (s37's profile: ~2 ms idle)."""
    global deferred
    plan = deferred
    if plan is None:
        return
    if plans and wanted is not None and not any(p is not None and p.data_ptr() in wanted for p in plans):
        return
    deferred = None
    plan()


def may_skip(on_cuda: bool, plan=None) -> bool:
    """Whether an eager op may return at once: nothing is captured this step, or (``plan``: its plan row) no request
    captures at its site (the row is all -1: ``wanted`` holds every row a plan cell can be in). ``on_cuda``: the op's
    tensors are on a GPU (a CPU op is never part of a graph capture). Not
    ``torch.cuda.is_available()``: under vLLM (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) it asks NVML on every call
    while CUDA is not initialized: ~0.15-0.4 ms a call on the CPU lane, once a step."""
    if capture_live and (plan is None or wanted is None or plan.data_ptr() in wanted):
        return False
    return not (on_cuda and torch.cuda.is_current_stream_capturing())
