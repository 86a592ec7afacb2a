#!/usr/bin/env bash
# Everything a GPU session carries, built here in one command from the repo root (before the first device call):
# the vLLM bundle (../shared/gpu/make-bundle.sh, .gpu0..N: parts too big beside the tree for one 64 MiB call) re-cut
# into 40 MiB parts .gpux0..K (PART_MB; the tree, ~20 MiB in s40, travels beside each) (install.sh in .gpux0), the plugin wheel (bench/build_wheel.sh), the tools wheels
# (bench/tools_wheels.sh), with V4=1 the DeepSeek-V4 parts (bench/v4_bundle.sh, without nvcc: the image has it), and
# with FI=1 FlashInfer's part .gpuf0 (bench/flashinfer_bundle.sh: the arfuse steps, TP=2 against vLLM's fused stock).
# Then, back to back: each .gpuxK in its own call (`mkdir -p /tmp/gb && cp .gpuxK/* /tmp/gb/`), the last one with
# .whl and `bash bench/gpu_session.sh install` (and the lanes' `start`s: bench/gpu_lanes.sh).
set -euo pipefail
[ -d .gpu0 ] || bash ../shared/gpu/make-bundle.sh > /dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat $(ls .gpu[0-9]*/part* | sort -V) | (cd "$tmp" && split -b "${PART_MB:-40}M" -d -a 2 - part)
rm -rf .gpux[0-9]*
k=0
for p in $(ls "$tmp"/part* | sort -V); do mkdir -p ".gpux$k" && mv "$p" ".gpux$k/"; k=$((k + 1)); done
cp ../shared/gpu/install.sh .gpux0/
bash bench/build_wheel.sh > /dev/null
bash bench/tools_wheels.sh > /dev/null
[ "${V4:-0}" = 1 ] && V4_NVCC=0 bash bench/v4_bundle.sh > /dev/null
[ "${FI:-0}" = 1 ] && bash bench/flashinfer_bundle.sh > /dev/null
echo "parts: .gpux0 .. .gpux$((k - 1)) ($(du -shc .gpux[0-9]* | tail -1 | cut -f1)); wheels: $(ls .whl/*.whl .whl/tools | wc -l)" \
  "$( [ "${V4:-0}" = 1 ] && echo "; v4: $(ls -d .gpuv[0-9]* | tr '\n' ' ')")" \
  "$( [ "${FI:-0}" = 1 ] && echo "; flashinfer: $(ls -d .gpuf[0-9]* | tr '\n' ' ')")"
