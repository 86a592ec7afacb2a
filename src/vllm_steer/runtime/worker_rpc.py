"""Methods added to vLLM's worker class, reached with ``collective_rpc("vllm_steer_<name>")``: those
``core.rpc.METHODS`` gives to the workers, each taking its typed arguments (``core.rpc.parse_args``).

``vllm.v1.worker.worker_base.WorkerBase`` gains methods (nothing existing is replaced):
collective_rpc is vLLM's documented way to reach every worker, and the plugin cannot pass
``--worker-extension-cls`` on the user's behalf.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from vllm_steer.core.rpc import WORKER, CapturePublish, ForgetModules, NoArgs, StageModule, StageSae, methods_of, parse_args


def _runtime(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    return getattr(runner, "steer_runtime", None)


def status(self, _: NoArgs) -> dict[str, Any]:
    """This worker's view: its pid, whether the ops are installed, and row usage."""
    rt = _runtime(self)
    status: dict[str, Any] = {"pid": os.getpid(), "runner": type(getattr(self, "model_runner", None)).__name__}
    if rt is None:
        status.update(steering=False)
    else:
        status.update(
            steering=True,
            ops=rt.num_ops,
            steered_norms=len(rt.steered_norms),
            hooks=list(rt.hooked_layers),
            rows=rt.cfg.max_configs,
            live_configs=len(rt.rows.live_keys()),
            peak_live_configs=rt.peak_live_configs,
            preemptions_seen=rt.preemptions_seen,
            row_uploads=rt.row_uploads,
            row_upload_bytes=rt.row_upload_bytes,
            row_evictions=rt.rows.evictions,
            module_versions=len(rt.modules),
            capture=rt.capture.status() if rt.capture is not None else None,
        )
    return status


def stage_module(self, args: StageModule) -> list[str]:
    """Keep a module's tiers on this worker and materialize its rows into the row cache."""
    from vllm_steer.core.payload import tiers_from_wire

    rt = _runtime(self)
    if rt is None:
        return []
    return rt.register_module(args.name, args.version, tiers_from_wire(args.wire, rt.hidden_size))


def forget_modules(self, args: ForgetModules) -> None:
    """Drop module versions no request can use any more (the engine core decides which)."""
    rt = _runtime(self)
    if rt is not None:
        rt.modules.forget(args.versions)


def stage_sae(self, args: StageSae) -> list[str]:
    """Stage a runtime SAE into those of its ``sites`` (``hook.layer``) this worker holds; returns them.
    Deleting one needs no worker: the engine core keeps a site from being re-staged while it is in use."""
    rt = _runtime(self)
    if rt is None or rt.sae is None:
        return []
    mine = [(h, int(l)) for h, _, l in (s.partition(".") for s in args.sites)]
    return [f"{h}.{l}" for h, l in rt.sae.load_runtime(args.path, args.format, args.site, tuple(args.features), mine)]


def capture_publish(self, args: CapturePublish) -> int:
    """End now the given finished requests this worker has not yet heard finished (an in-process
    engine is not stepped after its last output); their results go out on the capture result channel
    (``runtime.capture.CaptureRuntime.publish``). Called once per ``capture.collect``."""
    rt = _runtime(self)
    if rt is None or rt.capture is None:
        return 0
    return rt.capture.publish(list(args.request_ids))


HANDLERS: dict[str, Callable[[Any, Any], Any]] = {
    "vllm_steer_capture_publish": capture_publish,
    "vllm_steer_status": status,
    "vllm_steer_stage_module": stage_module,
    "vllm_steer_forget_modules": forget_modules,
    "vllm_steer_stage_sae": stage_sae,
}
assert set(HANDLERS) == methods_of(WORKER), "core.rpc.METHODS and the worker's HANDLERS disagree"


def _method(name: str, handler: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def method(self, *args):
        return handler(self, parse_args(name, args))

    method.__name__ = name
    method.__doc__ = handler.__doc__
    return method


WORKER_METHODS = {name: _method(name, handler) for name, handler in HANDLERS.items()}


def patch_worker() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in WORKER_METHODS.items():
        if not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)
