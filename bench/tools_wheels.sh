#!/usr/bin/env bash
# The GPU kit's extra wheels, into .whl/tools/ (run from the repo root, here; `gpu_session.sh install` installs them
# with --no-deps): py-spy for the host phase, and the test-only references the GPU tests import that the vLLM bundle
# lacks: eai-sparsify (tests/sae_oracle.sparsify_module: the transcoder oracles of tests/gpu_e2e) with the modules its
# `sparse_coder` imports; and loguru, the one requirement of compressed-tensors 0.17.0 (in the bundle without its
# dependencies) that neither the bundle nor the image has: any `--quantization` (QUANT=fp8) makes vLLM's
# get_quantization_config import every method's config, auto_awq -> fused_moe/oracle/int_wna16 -> compressed_tensors
# -> `from loguru import logger` (s28: both FP8 servers died at start). Versions are CI's lock (ci/requirements.lock),
# so both lanes test against the same code. And the peer the `small` step compares against, hotwire-vllm 0.1.2 (PyPI),
# into .whl/peer/ (ab_suite's --peer-wheel default).
set -euo pipefail
lock=ci/requirements.lock
pins=$(grep -iE '^(eai-sparsify|natsort|simple-parsing|docstring-parser|accelerate|loguru)==' "$lock")
mkdir -p .whl/tools
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
  --platform any -d .whl/tools $pins
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_17_x86_64 -d .whl/tools py-spy
mkdir -p .whl/peer
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl/peer hotwire-vllm==0.1.2 \
  || echo "no hotwire-vllm wheel: the small step runs without its peer"
ls .whl/tools .whl/peer
