#!/usr/bin/env bash
# The kit of a kernel-only GPU call (no vLLM bundle: seconds instead of ~5 min of bundle calls and install): the plugin
# wheel (bench/build_wheel.sh) and, in .whl/mini, the wheels the plugin's kernels, capture runtime and GPU kernel tests
# import that the GPU image lacks (versions from CI's lock). Run from the repo root here; on the device (carry .whl):
#   python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/s2 --upgrade .whl/vllm_steer-*.whl \
#     .whl/mini/*.whl; export PYTHONPATH=/tmp/s2:$PWD
# then e.g. `python3 -m pytest -q tests/gpu/test_allreduce_norm_gpu.py` or `python3 bench/prefill_host_cost.py
# --device cuda --baseline DIR` (s36: ~40 s a call with the machine's start).
set -euo pipefail
lock=ci/requirements.lock
names='msgspec|pydantic|pydantic-core|annotated-types|typing-extensions|typing-inspection|blake3|pybase64|pyzmq'
names+='|prometheus-client|pytest|pluggy|iniconfig|packaging|httpx|httpcore|h11|anyio|sniffio|certifi|idna|pytest-timeout'
pins=$(grep -iE "^($names)==" "$lock")
mkdir -p .whl/mini
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl/mini $pins
bash bench/build_wheel.sh
echo "mini kit: $(ls .whl/mini | wc -l) wheels in .whl/mini, $(du -sh .whl | cut -f1) to carry (.whl)"
