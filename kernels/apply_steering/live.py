"""Host-side "anything to do this step?" flags for the ops' eager paths.

Outside CUDA graphs (eager mode, or batches larger than the largest captured size) the ops are
called from Python every step, so they may return at once when the runtime said, before this
step's forward, that no token is steered (or captured). While a CUDA graph is being captured they
never skip: the graph must hold the kernel, and the device-side flags decide at replay.
"""

import torch

steering_live = True  # set by the worker runtime before each forward
capture_live = True


def may_skip(live: bool) -> bool:
    if live:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
