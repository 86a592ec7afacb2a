"""Shared core: what every process of the plugin agrees on.

The hook points, the ``steer`` config block, the vLLM version check, the request-field names and
tier arithmetic, the config hash and the engine payload (the wire contract between the front end,
the engine core and the workers). Any package of vllm_steer may import from here; modules here
import nothing of vllm_steer outside ``core`` (enforced by tests/test_layout.py).
"""
