"""Engine core: runs in vLLM's EngineCore process, next to the scheduler, once per step or request.

Admission by row capacity (a steered request waits until its configs fit the tables), the
prefix-cache keys of blocks generated under decode steering, and the engine side of module
registration (row pins, in-flight counts). Reads the engine payload only (``core``); never imports
the front end, the worker runtime, the kernels or the server.
"""
