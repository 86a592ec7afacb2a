"""vllm-steer: per-request activation steering for stock vLLM, as a plugin.

Turn it on with ``VLLM_PLUGINS=steer`` and ``--additional-config '{"steer": {}}'``; see README.md.
"""

__version__ = "0.3.0"

__all__ = ["__version__"]
