"""``vllm-steer calibrate``: each site's typical residual norm on a server (or a ``vllm.LLM``), measured over
a small prompt set through the ``activations`` capture consumer, written to a file that ``steer.site_norms``
or a module registration (``site_norms``) reads; ``core.site_norms`` has the statistic and the file form.

Cost: one 1-token request per prompt (the default set: ``PROMPTS``, 16 short texts of mixed kinds).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.core.site_names import tl_hook
from vllm_steer.core.site_norms import file_object, measure
from vllm_steer.extract.pairs import ExtractError
from vllm_steer.extract.sources import Text, capture_field, source_of

# Mixed registers and lengths: the norm at the last prompt token varies little across them (a few %).
PROMPTS = (
    "The weather today is",
    "Once upon a time, in a small village by the sea,",
    "To install the package, run the following command:",
    "My favourite food is",
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):",
    "Dear hiring manager, I am writing to apply for",
    "The three laws of thermodynamics state that",
    "I can't believe you did that! Why would",
    "Here is a short poem about autumn leaves:",
    "Q: What is 17 times 3?\nA:",
    "The meeting has been moved to Thursday because",
    "In 1969, the first humans walked on",
    "Please summarise the following article in two sentences.",
    "She opened the door slowly and saw",
    "The best way to learn a new language is",
)


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line (blank lines skipped; ``\\n`` in a line is a newline)."""
    lines = [line.replace("\\n", "\n") for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ExtractError(f"{path}: no prompts in the file")
    return lines


def calibrate(target: Any, prompts: Iterable[str] | None = None, *, layers: Any = "all",
              hooks: Iterable[str] = ("post_mlp",), chat: bool = False, model: str | None = None,
              api_key: str | None = None, instance: str = "activations",
              progress: Callable[[int, int], None] | None = None) -> dict:
    """The norms file's object (``core.site_norms.file_object``) for ``target`` (a server URL or a ``vllm.LLM``
    with the ``activations`` consumer), over ``prompts`` (default ``PROMPTS``)."""
    from vllm_steer.extract import _layers

    prompts = list(PROMPTS if prompts is None else prompts)
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ExtractError("prompts: expected non-empty strings")
    hooks = [tl_hook(h) or h for h in hooks]
    bad = [h for h in hooks if h not in HOOK_NAMES]
    if not hooks or bad:
        raise ExtractError(f"hooks: expected some of {list(HOOK_NAMES)} (or hook_resid_pre|mid|post), got {bad or hooks}")
    source = source_of(target, model=model, api_key=api_key)
    texts = [Text(p, None, chat) for p in prompts]
    rows = source.activations(texts, capture_field(_layers(layers), hooks, "last", instance), progress)
    return file_object(measure(rows), getattr(source, "model", "") or "", len(texts),
                       f"vllm-steer calibrate ({'chat-templated' if chat else 'plain'} prompts)")


def write(obj: dict, path: str | Path) -> Path:
    """The norms file (JSON), written whole or not at all."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(p)
    return p
