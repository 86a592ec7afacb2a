"""The steer config block, the version guard, and start-up failures on a bad config."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_steer.core.compat import OVERRIDE_ENV, UnsupportedVllmError, check_vllm_version
from vllm_steer.core.config import SteerConfigError, parse_steer_config


def test_no_steer_key_or_disabled_means_steering_off():
    assert parse_steer_config(None) is None
    assert parse_steer_config({}) is None
    assert parse_steer_config({"other": 1}) is None
    assert parse_steer_config({"steer": {"enabled": False}}) is None


def test_empty_steer_block_turns_steering_on_with_defaults():
    cfg = parse_steer_config({"steer": {}})
    assert cfg is not None and cfg.max_configs == 32 and cfg.hooks == ("pre_attn", "post_attn", "post_mlp")
    assert cfg.usable_rows == 31


@pytest.mark.parametrize(
    "block, key",
    [
        ({"max_configs": -1}, "max_configs"),
        ({"max_configz": 4}, "max_configz"),
        ({"max_configs": "8"}, "max_configs"),
        ({"hooks": ["post_mlp", "mid_mlp"]}, "hooks"),
        ({"layers": [-1]}, "layers"),
        ({"enabled": "yes"}, "enabled"),
        ({"max_modules": 0}, "max_modules"),
        ({"max_modules": "8"}, "max_modules"),
        ({"max_module_bytes": 0}, "max_module_bytes"),
        ({"max_module_bytes": 1.5}, "max_module_bytes"),
        ({"max_modules": 1, "modules": {"a": "a.safetensors", "b": "b.safetensors"}}, "modules"),
    ],
    ids=["negative", "unknown-key", "wrong-type", "unknown-hook", "negative-layer", "bool-type",
         "max-modules-zero", "max-modules-str", "module-bytes-zero", "module-bytes-float", "preloads-over-max"],
)
def test_malformed_config_names_the_key(block, key):
    with pytest.raises(SteerConfigError) as e:
        parse_steer_config({"steer": block})
    assert f"additional_config.steer.{key}" in str(e.value)


def test_module_limits_defaults_and_the_registration_body_cap():
    cfg = parse_steer_config({"steer": {}})
    assert cfg.max_modules == 256 and cfg.max_module_bytes == 64 << 20
    assert cfg.module_body_cap == 2 * (64 << 20) + (1 << 20)
    with pytest.raises(SteerConfigError, match=r"2 modules to preload, over steer.max_modules \(1\)"):
        parse_steer_config({"steer": {"max_modules": 1, "modules": {"a": "a.gguf", "b": "b.gguf"}}})


def test_a_preloaded_module_over_max_module_bytes_stops_start_up_naming_the_key(tmp_path):
    """``steer.modules`` files obey ``max_module_bytes``: a module over it, or a file too large to
    hold one under it (not read), is a SteerConfigError naming ``steer.modules.<name>``."""
    import numpy as np
    from safetensors.numpy import save_file

    from vllm_steer.frontend.module_registration import load_path
    from vllm_steer.frontend.spec import ModelShape

    shape = ModelShape(num_layers=4, hidden_size=64, hooks=("pre_attn", "post_attn", "post_mlp"), layers=None,
                       max_bytes=3 * 64 * 4)  # three vectors
    vec = np.ones(64, np.float32)
    save_file({f"post_mlp.{l}": vec for l in range(3)}, str(tmp_path / "fits.safetensors"))
    save_file({f"post_mlp.{l}": vec for l in range(4)}, str(tmp_path / "over.safetensors"))
    assert load_path("fits", str(tmp_path / "fits.safetensors"), shape).nbytes == 3 * 64 * 4
    with pytest.raises(SteerConfigError, match=r"additional_config\.steer\.modules\.over: .*1024 bytes of float32"
                                               r" vectors, over the server's cap of 768"):
        load_path("over", str(tmp_path / "over.safetensors"), shape)
    huge = tmp_path / "huge.safetensors"
    with open(huge, "wb") as f:  # sparse: larger than 2 x max_module_bytes + 1 MiB
        f.truncate(2 * shape.max_bytes + (1 << 20) + 1)
    with pytest.raises(SteerConfigError, match=r"additional_config\.steer\.modules\.huge: .* not read"):
        load_path("huge", str(huge), shape)


def test_steer_block_must_be_an_object():
    with pytest.raises(SteerConfigError, match="additional_config.steer: expected an object"):
        parse_steer_config({"steer": [1]})


def test_version_guard_range():
    """0.26 through 0.33 load; older or unreadable versions are refused naming the range."""
    for ok in ("0.26.0", "0.26.3+cpu", "0.29.1", "0.32.0+cpu", "0.33.0"):
        assert check_vllm_version(ok, problems=lambda: ["not consulted in the range"]) == ok
    for bad in ("0.25.1", "0.9.0", "garbage"):
        with pytest.raises(UnsupportedVllmError, match=r"supports vLLM >=0.26.0,<0.34.0"):
            check_vllm_version(bad)


def test_newer_vllm_loads_with_a_warning_unless_a_patch_target_changed(caplog):
    with caplog.at_level("WARNING", logger="vllm.steer"):
        assert check_vllm_version("0.34.0", problems=lambda: []) == "0.34.0"
    assert "newer than the newest release" in caplog.text
    with pytest.raises(UnsupportedVllmError, match=r"Scheduler.schedule: expected leading parameters"):
        check_vllm_version("0.35.1", problems=lambda: ["vllm.x:Scheduler.schedule: expected leading parameters"])


def test_version_guard_override(monkeypatch):
    monkeypatch.setenv(OVERRIDE_ENV, "1")
    assert check_vllm_version("0.25.1") == "0.25.1"
    assert check_vllm_version("0.35.0", problems=lambda: ["changed"]) == "0.35.0"


def test_server_start_up_fails_on_bad_config_with_one_clear_line(tiny_model):
    """The real CLI path: the API server refuses to start and says which key is wrong."""
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_steer.launcher", "serve", tiny_model("llama"),
         "--additional-config", '{"steer": {"max_configs": -1}}', "--port", "0"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "VLLM_PLUGINS": "steer"},
    )
    assert proc.returncode != 0
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "additional_config.steer.max_configs" in l]
    assert lines, (proc.stdout + proc.stderr)[-3000:]
    assert "greater than or equal to 2" in lines[-1]


def test_a_steered_model_handed_back_to_load_model_keeps_its_runtime():
    """vLLM 0.32+ ``load_model(model=...)`` can pass the already loaded (already steered) model
    again: the runner keeps its runtime instead of steering the model twice."""
    from types import SimpleNamespace

    from vllm_steer.runtime.manager import build_runtime

    model = object()
    runtime = SimpleNamespace(model=model)
    runner = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"steer": {}}), model=model,
                             steer_runtime=runtime)
    assert build_runtime(runner) is runtime
