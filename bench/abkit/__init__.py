"""abkit: the pieces of vllm-steer's A/B suite (bench/ab_suite.py).

The entry script puts ``bench/`` (for ``abkit``) and the repository root (for ``tests.*``) on
``sys.path`` itself, so the kit runs from a checkout where only the ``vllm_steer`` wheel is
installed. Nothing here imports vLLM or torch at import time.

A/B suite (HTTP, one server process per configuration):
  common         repository paths, the log clock, the results folder
  model_dir      SHAPES and the config + tokenizer directory of a shape (weights: --load-format dummy)
  wheel_site     installs a plugin wheel (the peer plugin hotwire) into a private site folder
  site_vectors   the single-site work: site layer, the 16 vectors, hotwire files / specs, vllm-steer fields
  servers        Server / Pool: start, adopt (state file), stop the OpenAI servers
  client         the async streaming HTTP client (run_load) and http_json
  arms           the ARMS table, request bodies, steering configs, module registration
  stats          per-trial summaries, mean / SEM, deltas
  runner         run_matrix: warm-up checks, interleaved trials, progress lines
  profile_graph  the torch.profiler graph phase and the trace parser (kernels per CUDA-graph launch)
  report         the markdown report of result JSONs
The end-to-end GPU correctness checks (vllm.LLM against transformers) are pytest tests: tests/gpu_e2e/;
the kit's CPU checks (trace parser, single-site fields, paired statistics): tests/test_bench_kit.py.
"""
