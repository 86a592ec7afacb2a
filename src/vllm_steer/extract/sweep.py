"""``vllm-steer sweep``: prompts x strengths -> a table (CSV and markdown) and a PNG plot, so a user sees
where a steering vector starts to break the text.

For each prompt the unsteered greedy completion is generated once; then for each strength (``norm`` or
``scale`` of a registered module, or of a vectors file sent inline) the steered greedy completion, and
two scores, each a **mean per-token log-prob over a completion's tokens** (from ``prompt_logprobs`` of a
1-token request over prompt + completion, temperature 0):

- ``fluency``: the steered completion under the *unsteered* model. Readable text stays near the
  unsteered completion's own value (strength 0); text that breaks (repeats, word salad) drops far below.
- ``shift``: the unsteered completion under the *steered* model. It falls as steering pulls the model
  away from what it would have said: the effect, where ``fluency`` is the cost.
- ``distinct``: distinct tokens / tokens of the steered completion (1: no repetition; loops fall toward 0).

Pick the largest strength whose ``fluency`` stays within ~1 nat of strength 0's and whose ``shift`` has
moved: past it the text breaks. The plot (``extract.png_chart``, no plotting library) has two panels over the
strengths: ``fluency`` (blue) and ``shift`` (orange) in mean log-prob per token, then ``distinct`` (grey, 0 to 1).
"""

from __future__ import annotations

import csv
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from vllm_steer.core.site_names import parse_site_name
from vllm_steer.extract.pairs import ExtractError
from vllm_steer.extract.png_chart import Series, chart, png_bytes
from vllm_steer.client_types import Completion
from vllm_steer.http_client import Client, SteeringAPIError

UNITS = ("norm", "scale")
COLUMNS = ("strength", "prompt", "fluency", "shift", "distinct", "text")
COLORS = {"fluency": (31, 119, 180), "shift": (255, 127, 14), "distinct": (127, 127, 127)}  # the plot's lines


@dataclass
class Cell:
    """One prompt at one strength."""

    strength: float
    prompt: int  # its index in the prompt list
    fluency: float
    shift: float
    distinct: float
    text: str


def vectors_from_file(path: str | Path) -> dict[str, dict[int, np.ndarray]]:
    """``{hook: {layer: vector}}`` of a module safetensors file's plain sites (what ``extract`` writes)."""
    from safetensors.numpy import load

    try:
        tensors = load(Path(path).read_bytes())
    except Exception as e:  # safetensors raises its own types
        raise ExtractError(f"{path}: not a readable safetensors file: {e}") from None
    out: dict[str, dict[int, np.ndarray]] = {}
    for name, arr in tensors.items():
        try:
            hook, layer = parse_site_name(name)
        except ValueError:
            raise ExtractError(f"{path}: tensor {name!r}: sweep sends plain <hook>.<layer> vectors only "
                               "(register the file and sweep --module instead)") from None
        out.setdefault(hook, {})[layer] = np.asarray(arr, np.float32).reshape(-1)
    if not out:
        raise ExtractError(f"{path}: no vectors in the file")
    return out


def steering_fields(strength: float, unit: str, module: str | None, vectors: dict | None) -> dict:
    """The request's steering fields at one strength (``Client.complete`` keywords)."""
    if unit not in UNITS:
        raise ExtractError(f"unit: expected one of {list(UNITS)}, got {unit!r}")
    if module is not None:
        return {"module": {"name": module, unit: strength}}
    from vllm_steer.client import pack

    tier = {}
    for hook, per in vectors.items():
        layers = sorted(per)
        packed = pack(np.stack([per[l] for l in layers]), layers)
        tier[hook] = {**packed, "norm": strength} if unit == "norm" else {**packed, "scales": [strength] * len(layers)}
    return {"steering_vectors": tier}


def _mean_logprob(answer: Completion, start: int, ids: list[int]) -> float:
    """Mean log-prob of ``ids`` at prompt positions ``start..`` of a ``prompt_logprobs`` answer."""
    entries = answer.choices[0].prompt_logprobs[start:start + len(ids)]
    if not ids:
        return float("nan")
    return float(np.mean([e[str(t)]["logprob"] for e, t in zip(entries, ids)]))


class _Sweep:
    def __init__(self, client: Client, max_tokens: int) -> None:
        self.c = client
        self.max_tokens = max_tokens

    def _call(self, **kwargs: Any) -> Completion:
        try:
            return self.c.complete(**kwargs)
        except SteeringAPIError as e:
            raise ExtractError(f"the server refused a sweep request ({e.status}, {e.param or 'body'}): "
                               f"{e.detail}") from None

    def generate(self, prompt: str, steering: dict) -> tuple[list[int], list[int], str]:
        a = self._call(prompt=prompt, max_tokens=self.max_tokens, temperature=0, return_token_ids=True, **steering)
        choice = a.choices[0]
        return list(choice.prompt_token_ids or ()), list(choice.token_ids or ()), choice.content

    def score(self, prompt_ids: list[int], ids: list[int], steering: dict) -> float:
        a = self._call(prompt=prompt_ids + ids, max_tokens=1, temperature=0, prompt_logprobs=0, **steering)
        return _mean_logprob(a, len(prompt_ids), ids)

    def cell(self, strength: float, index: int, prompt: str, base: tuple, steering: dict) -> Cell:
        prompt_ids, base_ids, _ = base
        _, ids, text = self.generate(prompt, steering)
        return Cell(strength, index, self.score(prompt_ids, ids, {}), self.score(prompt_ids, base_ids, steering),
                    len(set(ids)) / len(ids) if ids else float("nan"), text)


def sweep(base_url: str, prompts: Sequence[str], strengths: Sequence[float], *, unit: str = "norm",
          module: str | None = None, vectors: dict | None = None, max_tokens: int = 32, model: str | None = None,
          api_key: str | None = None, concurrency: int = 8) -> list[Cell]:
    """Every (strength, prompt) cell, strength-major (see the module docstring for the metrics)."""
    if (module is None) == (vectors is None):
        raise ExtractError("sweep needs a module name or vectors (one of them)")
    if not prompts or not strengths:
        raise ExtractError("sweep needs at least one prompt and one strength")
    with Client(base_url, api_key=api_key, model=model, timeout=600.0) as client:
        if client.model is None:
            client.model = client.served_models()[0]
        s = _Sweep(client, max_tokens)
        with ThreadPoolExecutor(concurrency) as pool:
            bases = list(pool.map(lambda p: s.generate(p, {}), prompts))
            jobs = [(x, i, p, bases[i], steering_fields(x, unit, module, vectors))
                    for x in strengths for i, p in enumerate(prompts)]
            return list(pool.map(lambda j: s.cell(*j), jobs))


def summary(cells: list[Cell]) -> list[dict]:
    """Per strength (in the order given): the mean of each metric over the prompts, and prompt 0's text."""
    out: dict[float, dict] = {}
    for c in cells:
        row = out.setdefault(c.strength, {"strength": c.strength, "fluency": [], "shift": [], "distinct": [],
                                          "text": None})
        for k in ("fluency", "shift", "distinct"):
            row[k].append(getattr(c, k))
        if c.prompt == 0:
            row["text"] = c.text
    return [{**r, **{k: float(np.nanmean(r[k])) for k in ("fluency", "shift", "distinct")}} for r in out.values()]


def csv_text(cells: list[Cell]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for c in cells:
        w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(c).items()})
    return buf.getvalue()


def markdown(cells: list[Cell], unit: str) -> str:
    """The summary table: one line per strength, prompt 0's steered text beside it."""
    lines = [f"| {unit} | fluency | shift | distinct | prompt 0's completion |", "|---:|---:|---:|---:|---|"]
    for r in summary(cells):
        text = " ".join((r["text"] or "").split()).replace("|", "\\|")[:120]
        lines.append(f"| {r['strength']:g} | {r['fluency']:.2f} | {r['shift']:.2f} | {r['distinct']:.2f} | {text} |")
    return "\n".join(lines) + "\n"


def plot(cells: list[Cell], path: str | Path) -> Path:
    """The metrics' means against strength as a PNG: fluency (blue) and shift (orange) above, distinct (grey, on
    0 to 1) below."""
    rows = summary(cells)
    xs = [r["strength"] for r in rows]
    panels = [[Series([r[k] for r in rows], COLORS[k]) for k in ("fluency", "shift")],
              [Series([r["distinct"] for r in rows], COLORS["distinct"])]]
    data = png_bytes(chart(panels, xs, ylims=[None, (0.0, 1.05)]))
    Path(path).write_bytes(data)
    return Path(path)


def write(cells: list[Cell], unit: str, prefix: str | Path) -> dict[str, Path]:
    """``<prefix>.csv`` (every cell), ``<prefix>.md`` (the summary) and ``<prefix>.png`` (the plot)."""
    prefix = Path(prefix)
    paths = {"csv": prefix.with_name(prefix.name + ".csv"), "md": prefix.with_name(prefix.name + ".md")}
    paths["csv"].write_text(csv_text(cells))
    paths["md"].write_text(markdown(cells, unit))
    paths["png"] = plot(cells, prefix.with_name(prefix.name + ".png"))
    return paths
