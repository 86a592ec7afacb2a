"""Host-side "does anyone capture this step?" flag for the capture op's eager path.

Outside CUDA graphs (eager mode, or batches larger than the largest captured size) the op is
called from Python every step, so it may return at once when the runtime said, before this
step's forward, that nothing is captured. While a CUDA graph is being captured it never skips:
the graph must hold the kernel, and the per-token plan decides at replay.
"""

import torch

capture_live = True  # set by the worker runtime before each forward


def may_skip(on_cuda: bool) -> bool:
    """``on_cuda``: the op's tensors are on a GPU (a CPU op is never part of a graph capture). Not
    ``torch.cuda.is_available()``: under vLLM (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) it asks NVML on every call
    while CUDA is not initialized: ~0.15-0.4 ms a call on the CPU lane, once a step."""
    if capture_live:
        return False
    return not (on_cuda and torch.cuda.is_current_stream_capturing())
