"""Worker runtime (data plane): runs in each vLLM worker process, next to the model.

Installs the steered norms into the loaded model, owns the device tables, the row allocator and
the per-step token -> row index, runs capture plans and the dispatch thread, and answers the
``vllm_steer_*`` collective RPCs. May import ``core``, ``capture`` (consumers run here) and the
kernels; never the front end, the engine core or the HTTP server.
"""
