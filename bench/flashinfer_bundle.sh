#!/usr/bin/env bash
# FlashInfer for the GPU lane (issue 40: vLLM's all-reduce + RMSNorm fusion, on by default at TP >= 2 on Hopper /
# Blackwell when FlashInfer is installed, which every pip-installed vLLM 0.26 has): the vLLM bundle leaves it out, so
# the lane's stock never fused. Written to .gpuf0, .gpuf1, ... (44 MiB parts: the 14 MB tree travels beside each, one
# part per device call): flashinfer-python 0.6.14 (vLLM 0.26.0 pins it exactly; py3-none-any, 14 MB: one part), and
# nothing else, because everything `import flashinfer`, `import flashinfer.comm` and the trtllm_comm JIT module import
# at import time is already there:
#   the image   torch, numpy, jinja2, filelock, packaging, requests, tqdm, typing_extensions, nvidia-ml-py (pynvml),
#               cuda-bindings; nvcc 13.0 and ninja for the JIT (vLLM's has_flashinfer() wants nvcc on PATH)
#   the bundle  apache-tvm-ffi 0.1.15.post2 (vLLM pins 0.1.10, but the bundle's xgrammar 0.2.8 needs >= 0.1.11;
#               FlashInfer asks >= 0.1.6, < 0.2, not 0.1.8)
# FlashInfer's other requirements are imported lazily or under try / except ImportError, and are left out (s32: the
# import with cudnn, cutlass, cuda.tile, mpi4py and tabulate blocked loads and builds the trtllm_comm spec):
#   nvidia-cudnn-frontend (cuDNN attention / GEMM backends), nvidia-cutlass-dsl (CuTe DSL kernels: FP4 norms,
#   Blackwell MoE / GEMM; the V4 parts carry 4.6.0), cuda-tile (cuTile GEMMs), einops, tabulate, click (its CLI).
# With the trtllm_comm module prebuilt here (bench/flashinfer_aot.sh: $FI_AOT_CACHE/trtllm_comm.so, sm_90a), the part
# carries it as aot/trtllm_comm/trtllm_comm.so, which fi-install puts where FlashInfer loads it without its JIT
# (flashinfer/data/aot/): minutes of nvcc on the GPU machine saved; without it arfuse-check compiles it there.
# On the device, after `bash bench/gpu_session.sh install`: each part `mkdir -p /tmp/gf && cp .gpufK/* /tmp/gf/`, then
# `bash bench/gpu_session.sh fi-install` (into /tmp/fi-site, which only the arfuse steps put on PYTHONPATH).
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --platform any \
  -d "$tmp/w" "flashinfer-python==${FLASHINFER_VERSION:-0.6.14}"
aot=${FI_AOT_CACHE:-$HOME/.cache/vllm-steer-fi-aot}/trtllm_comm.so
if [ -f "$aot" ]; then mkdir -p "$tmp/w/aot/trtllm_comm" && cp "$aot" "$tmp/w/aot/trtllm_comm/"; fi
tar -C "$tmp/w" -cf "$tmp/fi.tar" .
rm -rf .gpuf[0-9]*
(cd "$tmp" && split -b "${PART_MB:-44}M" -d -a 2 fi.tar fipart.)
i=0
for part in "$tmp"/fipart.*; do mkdir -p ".gpuf$i" && mv "$part" ".gpuf$i/"; i=$((i + 1)); done
pre="no prebuilt trtllm_comm: arfuse-check compiles it"
[ -f "$aot" ] && pre="trtllm_comm prebuilt"
echo "flashinfer: $(ls "$tmp/w"/*.whl | xargs -n1 basename) ($pre), $(du -sh "$tmp/fi.tar" | cut -f1)," \
  "in .gpuf0 .. .gpuf$((i - 1))"
