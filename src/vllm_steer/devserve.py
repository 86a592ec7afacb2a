"""What ``./dev serve`` computes and prints: the server's arguments, the how-to, the ready line.

- ``args``: the user's extra ``vllm serve`` arguments with every ``--additional-config`` merged into the
  dev server's one (the ``steer`` blocks key by key, the user's keys winning): vLLM would keep only the
  last one, silently dropping the steer block. A value that is not a JSON object is refused (exit 2).
- ``howto``: the commands printed before the server starts, each one working once it is up.
- ``ready``: waits (bounded) for the server, then prints one "vllm-steer ready: ..." line under vLLM's
  start-up logs, so the how-to does not scroll away unseen; it gives up when the server process exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from typing import Any

SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # --served-model-name of the dev server (README's curl)
DEFAULT_CONFIG = {"steer": {"capture": ["activations"]}}
READY_TIMEOUT_S = 900.0


class ArgsError(ValueError):
    pass


def merge_additional_config(args: list[str], base: dict | None = None) -> list[str]:
    """``args`` without its ``--additional-config`` options, then one holding ``base`` merged with each."""
    merged = json.loads(json.dumps(DEFAULT_CONFIG if base is None else base))  # a deep copy
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--additional-config" or arg.startswith("--additional-config="):
            if "=" in arg:
                text = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                text, i = args[i + 1], i + 1
            else:
                raise ArgsError("--additional-config needs a JSON object after it")
            try:
                extra = json.loads(text)
            except ValueError as e:
                raise ArgsError(f"--additional-config {text!r} is not JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ArgsError(f"--additional-config must be a JSON object, got {text!r}")
            steer = extra.pop("steer", None)
            if steer is not None:
                if not isinstance(steer, dict):
                    raise ArgsError(f"--additional-config: \"steer\" must be an object, got {json.dumps(steer)}")
                merged["steer"].update(steer)
            merged.update(extra)
        else:
            rest.append(arg)
        i += 1
    return rest + ["--additional-config", json.dumps(merged)]


def howto(python: str, port: int | str, model: str = SERVED_NAME) -> str:
    base = f"http://127.0.0.1:{port}"
    body = ('import json,numpy as np; from vllm_steer import steering_body; '
            'v=np.random.default_rng(0).standard_normal((1,576)).astype("f4")*2.5; '
            f'print(json.dumps({{"model":"{model}","prompt":"The capital of France is","max_tokens":16,'
            '"temperature":0,**steering_body({"post_mlp":(v,[14])})}))')
    return (f"Serving SmolLM2-135M-Instruct on {base} with vllm-steer (CPU). Once it is up, steer it:\n"
            f"  {python} examples/openai_steering.py {base}\n"
            "or with curl (a packed float32 vector at post_mlp of layer 14, built by vllm_steer.pack):\n"
            f"  curl -s {base}/v1/completions -H 'content-type: application/json' -d \"$({python} -c '{body}')\"")


def ready_line(status: dict, model: str, base: str, python: str = "python") -> str:
    """The line printed once the server answers, from GET /v1/steering's answer."""
    if not status.get("enabled"):
        return (f"vllm-steer loaded but steering is OFF at {base} (no \"steer\" block in --additional-config): "
                "steering fields get a 400")
    shape, cfg = status["model"], status.get("config") or {}
    hooks = shape["hooks"]
    consumers = [c["instance"] or c["name"] if isinstance(c, dict) else str(c) for c in cfg.get("capture") or ()]
    parts = [f"{shape['num_layers'] * len(hooks)} sites ({shape['num_layers']} layers x {', '.join(hooks)})",
             f"hidden {shape['hidden_size']}", f"capture: {', '.join(consumers) or 'off'}",
             f"modules: {len(cfg.get('modules') or {})}", f"version {status.get('version')}"]
    return (f"vllm-steer ready: {', '.join(parts)}; model {model} at {base}/v1. "
            f"Try: {python} examples/openai_steering.py {base}")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_ready(base: str, pid: int, python: str, timeout: float = READY_TIMEOUT_S) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return 1
        try:
            status = _get(f"{base}/v1/steering")
            model = _get(f"{base}/v1/models")["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(1.0)
            continue
        print(ready_line(status, model, base, python), flush=True)
        return 0
    print(f"vllm-steer: the server at {base} did not answer within {timeout:.0f} s", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["args"]:
        try:
            out = merge_additional_config(argv[1:])
        except ArgsError as e:
            print(f"./dev serve: {e}", file=sys.stderr)
            return 2
        sys.stdout.write("\0".join(out) + "\0")
        return 0
    if argv[:1] == ["howto"] and len(argv) == 3:
        print(howto(argv[1], argv[2]))
        return 0
    if argv[:1] == ["ready"] and len(argv) == 4:
        return wait_ready(argv[1], int(argv[2]), argv[3])
    print("usage: python -m vllm_steer.devserve args ARGS... | howto PYTHON PORT | ready BASE_URL PID PYTHON",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
