"""HTTP surface of vllm-steer (the ``vllm.endpoint_plugins`` entry point)."""
