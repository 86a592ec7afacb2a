"""Where extraction reads activations: the engine itself, through the ``activations`` capture consumer.

``HttpSource`` sends one 1-token completion per text to a running server (``/v1/completions``, or
``/v1/chat/completions`` when the text is chat-templated: vLLM applies the model's own template);
``LLMSource`` runs them on an in-process ``vllm.LLM`` and collects the results with
``vllm_steer.capture.collect``. Both return, per text, ``{site: vector}`` (``"post_mlp.3"``).
A text with a ``prompt`` is the prompt followed by the completion: concatenated as is, or, templated,
a user turn and the start of the assistant's answer (``continue_final_message``); without one, the
text is the user turn and the position read is where the answer would start.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from vllm_steer.capture.activations import decode_result
from vllm_steer.extract.pairs import ExtractError
from vllm_steer.http_client import Client, SteeringAPIError

INSTANCE = "activations"
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Text:
    completion: str
    prompt: str | None
    chat: bool

    def messages(self) -> list[dict]:
        if self.prompt is None:
            return [{"role": "user", "content": self.completion}]
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.completion}]

    def plain(self) -> str:
        return (self.prompt or "") + self.completion


def capture_field(layers: list[int] | str, hooks: list[str], reduce: str, instance: str = INSTANCE) -> dict:
    positions = "last_prompt" if reduce == "last" else "all_prompt"
    return {instance: {"layers": layers, "hooks": hooks, "positions": positions, "reduce": reduce}}


def _rows(capture: Any, where: str) -> dict[str, np.ndarray]:
    if not capture or len(capture) != 1:
        raise ExtractError(f"{where}: no activations result came back (is the consumer enabled?)")
    (result,) = capture.values()
    if "error" in result:
        raise ExtractError(f"{where}: the activations consumer failed: {result.get('message', result['error'])}")
    if result.get("dropped_rows") or not all(result["count"]):
        raise ExtractError(f"{where}: the engine dropped {result.get('dropped_rows', 0)} of the rows asked for (a "
                           "step wanted more than steer.capture_max_rows): send fewer texts at once or raise it")
    return decode_result(result)


class HttpSource:
    """A running vllm-steer server, through ``http_client.Client`` (``base_url``: ``http://host:port``,
    a trailing ``/v1`` is fine)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 concurrency: int = 8, timeout: float = 600.0) -> None:
        self.client = Client(base_url, api_key=api_key, timeout=timeout)
        self.concurrency = concurrency
        self.model = self.client.model = model or self._call("GET /v1/models", self.client.served_models)[0]

    @staticmethod
    def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SteeringAPIError as e:
            raise ExtractError(f"{what}: the server refused it ({e.status}): {e.detail}") from None

    def _one(self, text: Text, capture: dict) -> dict[str, np.ndarray]:
        c = self.client
        if text.chat:
            where, answer = "POST /v1/chat/completions", self._call(
                "an extraction request", c.chat, text.messages(), capture=capture, max_tokens=1, temperature=0,
                add_generation_prompt=text.prompt is None, continue_final_message=text.prompt is not None)
        else:
            where, answer = "POST /v1/completions", self._call(
                "an extraction request", c.complete, text.plain(), capture=capture, max_tokens=1, temperature=0)
        return _rows({k: v for k, v in (answer.capture or {}).items() if k in capture}, where)

    def activations(self, texts: list[Text], capture: dict, progress: Progress | None = None) -> list[dict]:
        out: list[dict | None] = [None] * len(texts)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = {pool.submit(self._one, t, capture): i for i, t in enumerate(texts)}
            for done, fut in enumerate(as_completed(futures), 1):
                out[futures[fut]] = fut.result()
                if progress:
                    progress(done, len(texts))
        return out


class LLMSource:
    """An in-process ``vllm.LLM`` started with the ``activations`` consumer in its steer block."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.model = llm.llm_engine.model_config.model

    def activations(self, texts: list[Text], capture: dict, progress: Progress | None = None) -> list[dict]:
        from vllm import SamplingParams

        from vllm_steer.capture.collect import collect

        sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"capture": capture})
        out: list[dict | None] = [None] * len(texts)
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(texts):
            groups.setdefault((t.chat, t.prompt is None), []).append(i)
        done = 0
        for (chat, no_prompt), idx in groups.items():
            if chat:
                outputs = self.llm.chat([texts[i].messages() for i in idx], sp, use_tqdm=False,
                                        add_generation_prompt=no_prompt, continue_final_message=not no_prompt)
            else:
                outputs = self.llm.generate([texts[i].plain() for i in idx], sp, use_tqdm=False)
            collect(self.llm, outputs)
            for i, o in zip(idx, outputs):
                out[i] = _rows({k: v for k, v in o.capture.items() if k in capture}, "LLM.generate")
            done += len(idx)
            if progress:
                progress(done, len(texts))
        return out


def source_of(target: Any, model: str | None = None, api_key: str | None = None) -> Any:
    if isinstance(target, str):
        return HttpSource(target, model=model, api_key=api_key)
    if hasattr(target, "activations"):
        return target
    if hasattr(target, "generate") and hasattr(target, "collective_rpc"):
        return LLMSource(target)
    raise TypeError(f"extract reads from a server URL or a vllm.LLM, got {type(target).__name__}")
