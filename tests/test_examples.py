"""Every file in examples/ runs against the shared SmolLM2 server and does what it says (so the
examples cannot rot): steering changes the text, extraction writes a module that steers, curl
registers / uses / deletes a module, an SAE clamp applies, captured files equal the response's rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import hf_oracle
from tests.conftest import API_KEY

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
