"""Front end: runs in the API server process (or the ``vllm.LLM`` process), once per request.

Validates a request's steering fields (400 naming the field), resolves tiers and named modules,
hashes each effective vector set, packs the engine payload and folds the prefill key into the
request's ``cache_salt``, all before the request reaches the engine. Also the API-side store of
named modules and their file formats. May import ``core`` and ``capture`` (the consumer contract);
never the worker runtime, the kernels, the engine core or the HTTP server.
"""
