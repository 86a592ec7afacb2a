"""The current CUDA stream as a kept ``Stream`` object, for the per-step host path (the capture plan's upload, its
copies to the host): ``torch.cuda.current_stream()`` builds a new Python ``Stream`` at every call (lazy-init check,
device index, constructor: 25-50 us of host time a call on a loaded GPU host, s36's op times), and so does
``Event.record()`` without a stream. The stream's identity is one C call; the object is built once per stream."""

from __future__ import annotations

import torch

_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The current stream of CUDA device ``device`` (CUDA initialized: a runtime's tensors live there)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    data = torch._C._cuda_getCurrentStream(index)
    stream = _STREAMS.get(data)
    if stream is None:
        stream = _STREAMS[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
    return stream
