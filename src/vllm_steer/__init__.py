"""vllm-steer: per-request activation steering for stock vLLM, as a plugin.

Turn it on with ``VLLM_PLUGINS=steer`` and ``--additional-config '{"steer": {}}'``; see README.md.
The public API is what ``__all__`` names (imported on first use, so loading the plugin stays light):

- requests: ``pack``, ``steering_body``, ``msgpack_body`` (vectors in the wire format);
- a server: ``Client``, ``AsyncClient``, ``SteeringAPIError``, and the typed answers they return (``Status``,
  ``Module``, ``Sae``, ``Completion`` with its ``Applied`` report, ...: ``client_types``);
- an in-process ``vllm.LLM``: ``register_module``, ``delete_module``, ``register_sae``, ``delete_sae``,
  ``collect`` (driver consumers' results onto the outputs);
- capture results: ``load_request`` (the filesystem consumer's files), ``decode_activations`` (the
  ``activations`` consumer's result as ``{site: vector}``);
- extraction: ``extract``, ``Extraction``, ``ExtractError``.
"""

from importlib import import_module
from typing import Any

__version__ = "0.3.0"

_EXPORTS = {
    "pack": "vllm_steer.client", "steering_body": "vllm_steer.client", "msgpack_body": "vllm_steer.client",
    "Client": "vllm_steer.http_client", "AsyncClient": "vllm_steer.http_client",
    "SteeringAPIError": "vllm_steer.http_client",
    **{name: "vllm_steer.client_types" for name in (
        "Status", "ModelSites", "Worker", "Module", "ModuleList", "Sae", "SaeList", "SaeSlot", "Deleted",
        "Completion", "Choice", "Message", "Usage", "Applied", "AppliedModule")},
    "register_module": "vllm_steer.frontend.module_registration",
    "delete_module": ("vllm_steer.frontend.module_registration", "unregister_module"),
    "register_sae": "vllm_steer.frontend.sae_registration",
    "delete_sae": ("vllm_steer.frontend.sae_registration", "unregister_sae"),
    "collect": "vllm_steer.capture.collect",
    "load_request": "vllm_steer.capture.filesystem",
    "decode_activations": ("vllm_steer.capture.activations", "decode_result"),
    "extract": "vllm_steer.extract", "Extraction": "vllm_steer.extract", "ExtractError": "vllm_steer.extract",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'vllm_steer' has no attribute {name!r}")
    module, attr = target if isinstance(target, tuple) else (target, name)
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
