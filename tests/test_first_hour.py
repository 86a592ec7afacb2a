"""A newcomer's first hour without a server: misspelled steering fields are refused (and nothing else is),
``./dev`` runs what it is given and prints commands that work, the shell blocks of README.md and docs/*.md are
pasteable."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_steer import devserve
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.vectors import REQUEST_FIELDS
from vllm_steer.frontend import field_names
from vllm_steer.server.request_body import SteeringRequestMiddleware

ROOT = Path(__file__).resolve().parent.parent

TYPOS = [  # (key, the field suggested)
    ("steering_vector", "steering_vectors"), ("steer_vectors", "steering_vectors"), ("steering", "steering_vectors"),
    ("steer", "steering_vectors"), ("steering_vectros", "steering_vectors"), ("Steering-Vectors", "steering_vectors"),
    ("SteeringVectors", "steering_vectors"), ("stearing_vectors", "steering_vectors"),
    ("prefill_steering_vector", "prefill_steering_vectors"), ("decode_steering", "decode_steering_vectors"),
    ("steering_modules", "steering_module"), ("stearing_module", "steering_module"), ("steeringModule", "steering_module"),
    ("capure", "capture"), ("captures", "capture"), ("Capture", "capture"), ("captrue", "capture"),
    ("SAE", "sae"), ("Sae", "sae"), ("steering_condtion", "steering_condition"),
    ("steering_projection", "steering_projections"), ("decode_steering_projection", "decode_steering_projections"),
]
EXTRAS = [  # plausible non-steering fields: vLLM's, OpenAI's newer ones, proxies' and vendors'
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "reasoning_effort",
    "session_id", "request_id", "x-request-id", "trace_id", "tags", "cache_salt", "seed", "stream_options",
    "priority", "kv_transfer_params", "mm_processor_kwargs", "vllm_xargs", "extra_body", "caption", "stage",
    "state", "sampler", "safe", "save", "sea", "sa", "scale", "strength", "temperature_schedule", "vector",
    "vectors", "module", "condition", "projection", "gateway", "litellm_params", "provider", "web_search_options",
]


@pytest.mark.parametrize("key, meant", TYPOS)
def test_a_near_miss_is_named_with_the_field_meant(key, meant):
    assert field_names.near_miss(key) == meant
    with pytest.raises(SteeringSpecError) as e:
        field_names.check({"model": "m", "prompt": "hi", key: {"post_mlp": {}}})
    assert e.value.field == key and f"did you mean `{meant}`?" in str(e.value)
    raw = json.dumps({"model": "m", "prompt": "hi", key: 1}).encode()
    assert field_names.suspect(raw)


def test_plausible_extras_and_every_vllm_field_pass():
    assert [k for k in EXTRAS if field_names.near_miss(k)] == []
    body = {"model": "m", "prompt": "hi", **{k: 1 for k in EXTRAS if k not in ("vllm_xargs", "extra_body")},
            "vllm_xargs": {"my_logits_processor": "x", "tenant": 3}, "extra_body": {"user": "u"}}
    field_names.check(body)
    assert not field_names.suspect(json.dumps(body).encode())
    # the rule itself (not the exclusion of vLLM's fields) lets every field vLLM's requests declare through
    declared = field_names.declared_by_vllm()
    assert len(declared) > 40 and [k for k in declared if field_names.looks_like_steering(k)] == []
    for field in REQUEST_FIELDS:  # the real fields are not near-misses of one another
        assert field_names.near_miss(field) is None


def test_near_misses_in_xargs_and_extra_body_are_refused():
    with pytest.raises(SteeringSpecError) as e:
        field_names.check({"vllm_xargs": {"steering_vectros": "{}", "tenant": 1}})
    assert e.value.field == "vllm_xargs.steering_vectros" and "`steering_vectors`" in str(e.value)
    with pytest.raises(SteeringSpecError) as e:
        field_names.check({"extra_body": {"steering_vectors": {}}})
    assert e.value.field == "extra_body.steering_vectors" and "top level" in str(e.value)
    field_names.check({"vllm_xargs": {"vllm_steer_prepared": "t"}})  # the reserved token: refused elsewhere


def test_the_byte_scan_reads_keys_only():
    prompt = 'say "steering_vector": {} and \\"capure\\": 1'
    assert not field_names.suspect(json.dumps({"model": "m", "prompt": prompt}).encode())
    assert field_names.suspect(b'{"model": "m", "messages": [], "steering_vector" : {}}')


def _full_rule(key: str) -> bool:
    """The rule as the module docstring states it: ``distance`` to every field, no shortcut."""
    k = key.lower().replace("-", "_")
    return "steer" in k or any(field_names.distance(k, f) <= field_names.max_distance(f) for f in REQUEST_FIELDS)


def test_new_body_keys_are_screened_by_length_before_any_edit_distance(monkeypatch):
    """Every key of every plain body is read once (``suspect``): keys whose length is far from every field's
    (a logit_bias's token ids, most schema properties) compute no edit distance at all, and the shortcut
    decides like the full rule on near misses and random keys alike."""
    rng = __import__("random").Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz_-"
    keys = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 30))) for _ in range(1500)]
    for f in REQUEST_FIELDS:  # one to three random edits of each field: many within its distance, many not
        for _ in range(60):
            k = list(f)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(k))
                k[i:i + 1] = rng.choice(([], [rng.choice(letters)], [k[i], rng.choice(letters)]))
            keys.append("".join(k))
    decided = [field_names.looks_like_steering(k) for k in keys]
    assert decided == [_full_rule(k) for k in keys] and 100 < sum(decided) < len(keys) - 100
    calls = []
    real = field_names.distance
    monkeypatch.setattr(field_names, "distance", lambda *a: calls.append(a) or real(*a))
    field_names.near_miss.cache_clear()
    body = json.dumps({"model": "m", "prompt": "hi", "logit_bias": {str(t): 1.0 for t in range(1000, 1100)},
                       "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                           "properties": {"x": {}, "answer_text": {}}}}}}).encode()
    assert not field_names.suspect(body)
    # only keys of a near length are compared (6 vs "capture", 15 vs "steering_module" / "steering_vectors"):
    # not the 100 token ids, nor the other 8 keys
    assert {c[0] for c in calls} == {"prompt", "schema", "response_format"}
    assert field_names.suspect(b'{"model": "m", "capure": 1}') and calls  # a near one is still compared


def _call(body: bytes) -> tuple[list[dict], list[bytes]]:
    """Drive the request middleware with ``body`` (steering on, no engine): what it sent, what vLLM's app got."""
    seen: list[bytes] = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    state = SimpleNamespace(steer_config=SimpleNamespace(body_cap=1 << 20), steer_frontend=None,
                            steer_engine_client=None)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "app": SimpleNamespace(state=state),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    asyncio.run(SteeringRequestMiddleware(app)(scope, receive, send))
    return sent, seen


def test_the_middleware_refuses_a_lone_misspelled_field_in_vllms_error_shape():
    sent, seen = _call(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "steering_vector": {}}')
    assert seen == [] and sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["param"] == "steering_vector" and "did you mean `steering_vectors`?" in error["message"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    body = json.dumps({"model": "m", "messages": [], "user": "u", "metadata": {"a": "b"}, "x-vendor": 1}).encode()
    sent, seen = _call(body)
    assert sent == [] and seen == [body]  # untouched, not even re-encoded


def _example():
    spec = importlib.util.spec_from_file_location("openai_steering", ROOT / "examples" / "openai_steering.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: no server needed
    return module


def test_the_example_takes_the_server_or_its_openai_base():
    url = _example().server_url
    for arg in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"):
        assert url(["x", arg]) == "http://127.0.0.1:8000"
    assert url(["x"]) == "http://127.0.0.1:8000"
    printed = devserve.howto(".venv/bin/python", 8123)
    arg = re.search(r"openai_steering\.py (\S+)", printed)[1]
    assert url(["x", arg]) == "http://127.0.0.1:8123"
    assert f'"model":"{devserve.SERVED_NAME}"' in printed


def test_the_ready_line_says_what_is_served():
    status = {"version": "0.3.0", "enabled": True,
              "model": {"num_layers": 30, "hidden_size": 576, "hooks": ["pre_attn", "post_attn", "post_mlp"]},
              "config": {"capture": [{"name": "activations", "instance": None, "params": {}}], "modules": {"a": "/a"}}}
    line = devserve.ready_line(status, devserve.SERVED_NAME, "http://127.0.0.1:8000", "py")
    assert line.startswith("vllm-steer ready: 90 sites (30 layers x pre_attn, post_attn, post_mlp), hidden 576, "
                           "capture: activations, modules: 1, version 0.3.0;")
    assert line.endswith("Try: py examples/openai_steering.py http://127.0.0.1:8000")
    off = devserve.ready_line({"enabled": False, "model": None, "config": None}, "m", "http://h:1")
    assert "steering is OFF" in off


def test_extra_additional_config_merges_into_the_steer_block_or_is_refused():
    out = devserve.merge_additional_config(["--max-num-seqs", "4", "--additional-config", '{"steer": {"max_configs": 8}}',
                                            '--additional-config={"other": 1}'])
    assert out[:2] == ["--max-num-seqs", "4"] and out[2] == "--additional-config"
    assert json.loads(out[3]) == {"steer": {"capture": ["activations"], "max_configs": 8}, "other": 1}
    for bad in (["--additional-config", "[1]"], ["--additional-config", "{nope"], ["--additional-config"],
                ["--additional-config", '{"steer": 3}']):
        with pytest.raises(devserve.ArgsError):
            devserve.merge_additional_config(bad)


@pytest.fixture()
def fake_venv(tmp_path):
    """A venv whose python records the arguments ``./dev`` runs it with (vllm_steer.devserve runs for real)
    and an ``uv`` that installs nothing: ``./dev``'s own logic, in a second."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (tmp_path / "uvbin").mkdir()
    scripts = {
        bindir / "python": f"""#!/bin/sh
case "$2" in
  vllm_steer.devserve) [ "$3" = ready ] && exit 0; exec {sys.executable} "$@" ;;
  tests.fixtures.models) printf 'smollm2\\t/models/smollm2\\n'; exit 0 ;;
esac
printf '%s\\n' "$@" > {tmp_path}/argv
printf '%s' "$VLLM_CPU_OMP_THREADS_BIND" > {tmp_path}/bind
""",
        tmp_path / "uvbin" / "uv": "#!/bin/sh\nexit 0\n",
    }
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    def dev(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        env = {**os.environ, "VLLM_STEER_VENV": str(tmp_path / "venv"), "PYTHONPATH": str(ROOT / "src"),
               "PATH": f"{tmp_path / 'uvbin'}:{os.environ['PATH']}"}
        (tmp_path / "argv").unlink(missing_ok=True)
        done = subprocess.run([str(ROOT / "dev"), *args], env=env, capture_output=True, text=True, timeout=60)
        argv = (tmp_path / "argv").read_text().splitlines() if (tmp_path / "argv").exists() else []
        return done, argv

    return dev


def test_dev_test_runs_only_the_files_named(fake_venv):
    _, argv = fake_venv("test", "tests/test_layout.py", "-x", "-k", "docstring")
    assert argv[:2] == ["-m", "pytest"]
    assert "tests/test_layout.py" in argv and "tests" not in argv
    assert argv[-3:] == ["-x", "-k", "docstring"]
    _, argv = fake_venv("test", "-x")
    assert "tests" in argv and argv[-1] == "-x"


def test_dev_serve_merges_additional_config_and_prints_a_working_command(fake_venv):
    done, argv = fake_venv("serve", "--max-num-seqs", "2", "--additional-config", '{"steer": {"max_configs": 8}}')
    assert done.returncode == 0, done.stderr
    assert argv[:4] == ["-m", "vllm_steer.launcher", "serve", "/models/smollm2"]
    assert argv.count("--additional-config") == 1
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config == {"steer": {"capture": ["activations"], "max_configs": 8}}
    assert argv[argv.index("--served-model-name") + 1] == devserve.SERVED_NAME
    assert "examples/openai_steering.py http://127.0.0.1:8000\n" in done.stdout  # the server, not .../v1
    done, argv = fake_venv("serve", "--additional-config", "[1]")
    assert done.returncode == 2 and argv == [] and "must be a JSON object" in done.stderr


def test_dev_serve_leaves_cpu_cores_unpinned_unless_told(fake_venv, tmp_path, monkeypatch):
    """vLLM's CPU default pins every server to the first core: two on one machine crawl. ./dev serve runs
    unpinned (nobind); a binding the caller sets is kept."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert fake_venv("serve")[0].returncode == 0
    assert (tmp_path / "bind").read_text() == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert fake_venv("serve")[0].returncode == 0
    assert (tmp_path / "bind").read_text() == "0-1"


# README.md and docs/*.md: every ```bash block is checked statically or listed here with why it is not.
SKIPPED = {
    "./dev test": "runs the whole suite (CI runs it)",
}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    text = re.sub(r"(?m)^\s*#.*$", "", text)
    joined, out = "", []
    for line in text.splitlines():  # a quoted JSON body may span lines
        joined = f"{joined}\n{line}" if joined else line
        try:
            shlex.split(joined, comments=True)
        except ValueError:
            continue
        if joined.strip():
            out.append(joined.strip())
        joined = ""
    assert not joined, f"unbalanced quotes in a shell block:\n{block}"
    return out


def _single_quoted(command: str) -> list[str]:
    return re.findall(r"'([^']*)'", command)


def test_readme_and_docs_shell_blocks_work_as_written():
    checked, skipped = 0, []
    assert len(DOCS) > 8, DOCS  # README.md and the docs/ pages
    for path in DOCS:
        served = None  # the model name the latest server above, in this file, answers to
        for block in _bash_blocks(path):
            commands = _commands(block)
            if block.strip() in SKIPPED:
                skipped.append(block.strip())
                continue
            for cmd in commands:
                where = f"{path.relative_to(ROOT)}: {cmd}"
                words = shlex.split(cmd, comments=True)
                for quoted in _single_quoted(cmd):
                    assert not re.search(r"\$[A-Za-z_{(]", quoted), f"a $ inside single quotes never expands: {where}"
                assert words[:3] != ["pip", "install", "vllm-steer"], f"not on the package index yet: {where}"
                if "vllm" in words and "serve" in words or any(w.endswith("vllm-steer-serve") for w in words):
                    assert "VLLM_PLUGINS=steer" in words, where
                    launcher = next(i for i, w in enumerate(words) if w in ("vllm", "vllm-steer-serve"))
                    assert words[launcher + 1] == "serve", f"the subcommand `serve` is missing: {where}"
                    config = json.loads(words[words.index("--additional-config") + 1])
                    assert isinstance(config.get("steer"), dict), where
                    served = (words[words.index("--served-model-name") + 1] if "--served-model-name" in words
                              else words[launcher + 2])
                if words[:2] == ["./dev", "serve"]:
                    served = devserve.SERVED_NAME
                if words[0] == "curl" and "-d" in words:
                    body = words[words.index("-d") + 1]
                    if body.startswith("{") and '"model"' in body:
                        assert json.loads(body)["model"] == served, f"{where}\nthe server above serves {served}"
                checked += 1
    assert checked >= 10 and sorted(skipped) == sorted(SKIPPED), (checked, skipped)


def test_a_test_server_ends_when_the_test_process_is_killed(tmp_path):
    """``tests.server.spawn`` (every HTTP test's server): a test process killed with SIGKILL (no cleanup runs)
    takes its server down with it."""
    script = ("import os, subprocess, sys; from tests.server import spawn; "
              "p = spawn(['sleep', '120'], dict(os.environ), subprocess.DEVNULL); print(p.pid, flush=True); "
              "os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"the server process {child} outlived its killed parent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is gone (its parent died, init reaps it)
    except FileNotFoundError:
        return False
