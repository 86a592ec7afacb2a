"""``vllm-steer sites | modules list|show|register|delete | sae list`` against the shared test server (what they
print equals what the routes answer), and every failure as ONE line on stderr with exit status 2: a refusal
naming the command-line flag (``--replace``, ``--api-key``), a server that is down (an unused port), one that
answers garbage or has steering off (a tiny local HTTP server), for these commands and extract / calibrate /
sweep (which ask the status route first); and every ``vllm-steer`` command README.md and docs/ print parses."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.conftest import API_KEY, SAE_SITE, SAE_SLOT, SAE_SLOT_SIZE
from tests.server import free_port
from vllm_steer import cli
from vllm_steer.cli.refusals import REGISTER_FLAGS, refusal
from vllm_steer.cli.tables import layer_ranges
from vllm_steer.http_client import SteeringAPIError

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = 576


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, *words: str) -> None:
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_modules_register_list_show_replace_delete(api_server, tmp_path, capsys, monkeypatch):
    base = api_server[0]
    name = "cli-joy"
    rng = np.random.default_rng(5)
    vecs = {s: rng.standard_normal(HIDDEN).astype(np.float32) for s in
            ("post_mlp.3", "post_mlp.4", "pre_attn.7", "decode.post_mlp.9")}
    save_file(vecs, str(tmp_path / "joy.safetensors"), metadata={"description": "from the shell"})
    srv = ("--server", base)

    rc, _, err = run(capsys, "modules", "register", name, str(tmp_path / "joy.safetensors"), *srv)
    assert rc == 2  # the server's steer.api_key: the flag that sets it is named
    one_line_error(err, "(401)", "--api-key", "$VLLM_API_KEY")
    assert "Authorization: Bearer" not in err

    monkeypatch.setenv("VLLM_API_KEY", API_KEY)  # the default of --api-key
    rc, out, _ = run(capsys, "modules", "register", name, str(tmp_path / "joy.safetensors"), *srv)
    assert rc == 0 and f"registered module '{name}'" in out and "pre_attn 7; post_mlp 3-4 (3 sites)" in out
    got = httpx.get(f"{base}/v1/steering/modules/{name}", timeout=60).json()
    assert got["description"] == "from the shell" and got["sites"] == {
        "steering_vectors": ["pre_attn.7", "post_mlp.3", "post_mlp.4"], "decode_steering_vectors": ["post_mlp.9"]}

    rc, out, _ = run(capsys, "modules", "list", *srv)
    row = next(line for line in out.splitlines() if line.startswith(name + " "))
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["name", "hooks", "layers"]
    assert row.split()[1:5] == ["pre_attn,", "post_mlp", "3-4,7,9", "all,"] and "from the shell" in row
    rc, out, _ = run(capsys, "modules", "list", "--json", *srv)
    listed = {m["name"]: m for m in json.loads(out)}
    assert rc == 0 and listed[name]["sites"] == got["sites"] and "preloaded" in listed

    rc, out, _ = run(capsys, "modules", "show", name, *srv)
    assert rc == 0
    assert re.search(r"^sites \(all\): +pre_attn 7; post_mlp 3-4 \(3 sites\)$", out, re.M), out
    assert re.search(r"^sites \(decode\): +post_mlp 9 \(1 site\)$", out, re.M), out
    assert re.search(rf"^version: +{got['version']}$", out, re.M), out

    rc, _, err = run(capsys, "modules", "register", name, str(tmp_path / "joy.safetensors"), *srv)
    assert rc == 2
    one_line_error(err, "(409)", f"'{name}' exists", "pass --replace")
    assert "replace=true" not in err

    save_file({"post_mlp.12": vecs["post_mlp.3"]}, str(tmp_path / "joy2.safetensors"))
    rc, out, _ = run(capsys, "modules", "register", name, str(tmp_path / "joy2.safetensors"), "--replace",
                     "--description", "replaced", "--json", *srv)
    assert rc == 0 and json.loads(out)["sites"] == {"steering_vectors": ["post_mlp.12"]}
    assert httpx.get(f"{base}/v1/steering/modules/{name}", timeout=60).json()["description"] == "replaced"

    rc, _, err = run(capsys, "modules", "register", "cli-bad", str(tmp_path / "joy.safetensors"),
                     "--site-norms", str(tmp_path / "norms.json"), *srv)
    assert rc == 2  # a file the command reads: no request sent
    one_line_error(err, "--site-norms: cannot read", "norms.json")
    (tmp_path / "norms.json").write_text(json.dumps({"site_norms": {"post_mlp.3": -1}}))
    rc, _, err = run(capsys, "modules", "register", "cli-bad", str(tmp_path / "joy.safetensors"),
                     "--site-norms", str(tmp_path / "norms.json"), *srv)
    assert rc == 2  # the server's param site_norms, named as the flag
    one_line_error(err, "(400)", "--site-norms (post_mlp.3)", "positive")

    rc, out, _ = run(capsys, "modules", "delete", name, *srv)
    assert rc == 0 and out == f"deleted module '{name}'\n"
    assert httpx.get(f"{base}/v1/steering/modules/{name}", timeout=60).status_code == 404
    rc, out, _ = run(capsys, "modules", "list", *srv)
    assert rc == 0 and not any(line.startswith(name + " ") for line in out.splitlines())
    for verb in ("show", "delete"):
        rc, _, err = run(capsys, "modules", verb, name, *srv)
        assert rc == 2
        one_line_error(err, f"NAME: unknown steering module '{name}'", "vllm-steer modules list")


def test_sites_and_sae_list_say_what_the_server_reports(api_server, capsys):
    base = api_server[0]
    status = httpx.get(f"{base}/v1/steering", timeout=60).json()["model"]
    rc, out, _ = run(capsys, "sites", "--url", base, "--json")
    sites = json.loads(out)
    assert rc == 0 and sites["hooks"] == status["hooks"] == ["pre_attn", "post_attn", "post_mlp"]
    assert sites["sites"] == [f"{h}.{l}" for h in status["hooks"] for l in range(status["num_layers"])]
    assert sites["sae"] == {"fz": SAE_SITE} and sites["sae_slots"] == {SAE_SLOT: SAE_SLOT_SIZE}
    rc, out, _ = run(capsys, "sites", "--server", base)
    assert rc == 0 and re.search(r"^post_mlp +blocks\.L\.hook_resid_post +0-29 +30$", out, re.M), out
    assert f"90 sites of 30 layers; vectors have {HIDDEN} values" in out and f"fz at {SAE_SITE}" in out

    saes = httpx.get(f"{base}/v1/steering/sae", timeout=60).json()
    rc, out, _ = run(capsys, "sae", "list", "--server", base)
    assert rc == 0 and re.search(rf"^fz +config +{SAE_SITE} +64 +jumprelu +\d+ ", out, re.M), out
    assert f"site {SAE_SLOT} reserved for runtime SAEs ({SAE_SLOT_SIZE} features)" in out
    rc, out, _ = run(capsys, "sae", "list", "--server", base, "--json")
    assert rc == 0 and [e["name"] for e in json.loads(out)["data"]] == [e["name"] for e in saes["data"]]


def test_extract_from_too_few_pairs_warns_and_still_writes(api_server, tmp_path, capsys):
    """One pair is not accepted silently (issue 42): a one-line warning says why few pairs make a poor vector."""
    pairs = tmp_path / "one.jsonl"
    pairs.write_text(json.dumps({"positive": "I love it", "negative": "I hate it"}) + "\n")
    rc, out, err = run(capsys, "extract", "--server", api_server[0], "--pairs", str(pairs), "--layers", "3",
                       "-o", str(tmp_path / "one.safetensors"))
    assert rc == 0 and (tmp_path / "one.safetensors").is_file(), err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert warning == [line for line in err.splitlines() if line.startswith("vllm-steer extract: warning: 1 pair only")]
    assert len(warning) == 1 and "use several" in warning[0], err

COMMANDS = [("sites",), ("modules", "list"), ("modules", "show", "x"), ("modules", "register", "x", "{file}"),
            ("modules", "delete", "x"), ("sae", "list"), ("extract", "--pairs", "{pairs}", "-o", "{out}.safetensors"),
            ("calibrate", "-o", "{out}.json"), ("sweep", "--module", "x", "-o", "{out}")]


def argv(cmd: tuple, tmp_path: Path) -> list[str]:
    """``cmd`` with its files: a module file, a pairs file, an output prefix nothing may be written to."""
    save_file({"post_mlp.3": np.ones(HIDDEN, np.float32)}, str(tmp_path / "m.safetensors"))
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"positive": "I love it", "negative": "I hate it"}) + "\n")
    files = {"file": tmp_path / "m.safetensors", "pairs": tmp_path / "pairs.jsonl", "out": tmp_path / "out"}
    return [a.format(**files) for a in cmd]


def nothing_written(tmp_path: Path) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "pairs.jsonl"]


def test_a_server_that_is_down_is_one_line_and_exit_2(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for cmd in COMMANDS:
        rc, out, err = run(capsys, *argv(cmd, tmp_path), "--server", url)
        assert rc == 2 and out == ""
        command = " ".join(w for w in cmd[:2] if w.isalpha())
        one_line_error(err, f"vllm-steer {command}: error: cannot reach {url}", "is the server up? (--server)")
        nothing_written(tmp_path)
    done = subprocess.run([str(Path(sys.executable).with_name("vllm-steer")), "modules", "list", "--server", url],
                          capture_output=True, text=True, timeout=120)  # the installed command, no traceback
    assert done.returncode == 2 and done.stdout == ""
    one_line_error(done.stderr, "cannot reach", "(--server)")
    rc, _, err = run(capsys, "sites", "--server", "localhost:8000")
    assert rc == 2
    one_line_error(err, "--server 'localhost:8000' is not a URL", "http://127.0.0.1:8000")


ANSWERS = {  # what the fake server answers every route: (status, body)
    "text": (200, b"hello"), "list": (200, b"[1, 2]"),
    "shape": (200, b'{"enabled": true, "model": {"hooks": 3}, "data": [{"name": 1}], "name": 1, "deleted": "x"}'),
    "html404": (404, b"<html>Not Found</html>"), "err500": (500, b"Internal Server Error"),
    "off": (200, b'{"version": "0.3.0", "enabled": false, "model": null, "config": null, "workers": []}'),
}


@pytest.fixture(scope="module")
def fake_server():
    mode = ["text"]

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            status, body = ANSWERS[mode[0]]
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = answer

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", mode
    srv.shutdown()


@pytest.mark.parametrize("answer, words", [
    ("text", "not vllm-steer's answer"), ("list", "not vllm-steer's answer"), ("shape", "not vllm-steer's answer"),
    ("html404", "VLLM_PLUGINS=steer"), ("err500", "the server failed (500)"),
])
def test_a_server_answering_garbage_is_one_line_and_exit_2(fake_server, answer, words, tmp_path, capsys):
    url, mode = fake_server
    mode[0] = answer
    for cmd in COMMANDS:
        if answer == "shape" and cmd[1:2] == ("delete",):
            continue  # a well-formed delete answer
        rc, out, err = run(capsys, *argv(cmd, tmp_path), "--server", url)
        assert rc == 2 and out == "", (cmd, out)
        one_line_error(err, words)
        nothing_written(tmp_path)


def test_a_server_with_steering_off_is_named_before_any_work(fake_server, tmp_path, capsys):
    url, mode = fake_server
    mode[0] = "off"  # what GET /v1/steering answers without a steer block
    for cmd in [c for c in COMMANDS if c[0] in ("sites", "extract", "calibrate", "sweep")]:
        rc, out, err = run(capsys, *argv(cmd, tmp_path), "--server", url)
        assert rc == 2 and out == ""
        one_line_error(err, f"steering is off on {url}", "--additional-config")
        nothing_written(tmp_path)


@pytest.mark.parametrize("status, message, param, words", [
    (409, "steering module 'a' exists; pass replace=true to replace it", "name",
     "NAME: steering module 'a' exists; pass --replace"),
    (409, "the server holds steer.max_modules (3) steering modules; delete one or replace an existing name", "name",
     "delete one (vllm-steer modules delete NAME) or register an existing name with --replace"),
    (400, "file.post_mlp.3: expected 576 values (hidden size), got 100", "file.post_mlp.3",
     "FILE (post_mlp.3): expected 576"),
    (400, "as_ablation: expected a boolean", "as_ablation", "--as-ablation: expected a boolean"),
    (413, "module registration larger than the server's cap", "file", "(413): FILE: module registration larger"),
    (401, "Unauthorized", None, "Unauthorized; pass the server's key with --api-key"),
])
def test_refusals_name_the_flag_not_the_rest_parameter(status, message, param, words):
    line = refusal(SteeringAPIError(status, message, param), REGISTER_FLAGS)
    assert words in line and "\n" not in line and "replace=true" not in line, line


def test_layer_ranges():
    assert layer_ranges([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8" and layer_ranges([3]) == "3" and layer_ranges([]) == "-"


def test_every_vllm_steer_command_in_the_readme_and_docs_parses():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = re.sub(r"\\\n\s*", " ", "\n".join(p.read_text() for p in docs))
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()
                if line.strip().startswith("vllm-steer ")]
    assert len(commands) >= 5 and any(c.startswith("vllm-steer modules register") for c in commands), commands
    for command in commands:
        words = shlex.split(command, comments=True)
        cli.parser().parse_args(words[1:])  # SystemExit (argparse's exit 2) on a flag the CLI lacks
