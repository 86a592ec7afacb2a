"""Activation capture, public API for consumer authors: the consumer contract and its entry-point
discovery, the capture spec, the built-in consumers (they run in the workers), and the readers
users call (``collect`` for ``vllm.LLM``, ``filesystem.load_request``), and the inbox where driver
results arrive in the submitting process (``inbox``). Imports only ``core``.
"""
