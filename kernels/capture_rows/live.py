"""Host-side "does anyone capture this step?" flag for the capture op's eager path.

Outside CUDA graphs (eager mode, or batches larger than the largest captured size) the op is
called from Python every step, so it may return at once when the runtime said, before this
step's forward, that nothing is captured. While a CUDA graph is being captured it never skips:
the graph must hold the kernel, and the per-token plan decides at replay.
"""

import torch

capture_live = True  # set by the worker runtime before each forward


def may_skip() -> bool:
    if capture_live:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
