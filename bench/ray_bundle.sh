#!/usr/bin/env bash
# Ray for the GPU machine (issue 40: the Ray executor), which has no Ray and no network: ray and the packages it
# needs for Python 3.12 / manylinux, split into .gpur0, .gpur1, ... (52 MiB parts, one per device call, like the
# vLLM bundle). On the device: cat .gpurK/* parts back together, then `bash bench/gpu_session.sh ray` installs
# them into /tmp/ray-site (after /tmp/site on PYTHONPATH) and runs the e2e tests with the Ray executor at TP=2.
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp/w" "ray==${RAY_VERSION:-2.60.0}"
tar -C "$tmp/w" -cf "$tmp/ray.tar" .
rm -rf .gpur*
(cd "$tmp" && split -b 52M -d ray.tar raypart)
i=0
for part in "$tmp"/raypart*; do mkdir -p ".gpur$i" && mv "$part" ".gpur$i/"; i=$((i + 1)); done
echo "ray bundle: $(du -sh "$tmp/ray.tar" | cut -f1) in $i parts (.gpur0 .. .gpur$((i - 1))): $(ls "$tmp/w" | wc -l) wheels"
