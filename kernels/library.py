"""The ``vllm_steer`` torch library every op of the plugin is registered in (``torch.ops.vllm_steer``)."""

from torch.library import Library

LIB = Library("vllm_steer", "FRAGMENT")
