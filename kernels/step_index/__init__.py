"""step_index: the token -> steering row index of a step, built on the device from vLLM's request boundaries."""
