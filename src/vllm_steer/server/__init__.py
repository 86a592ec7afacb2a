"""HTTP surface: runs in the API server process (the ``vllm.endpoint_plugins`` entry point).

Routes under /v1/steering, steering fields in OpenAI request bodies, and the response field that
reports the applied steering. Engine work goes through ``engine_client.collective_rpc``. May import
``core``, ``capture`` and the front end; never the worker runtime, the kernels or the engine core.
"""
