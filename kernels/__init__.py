"""Triton kernels of vllm-steer, each beside its plain-torch reference (installed as vllm_steer.kernels)."""
