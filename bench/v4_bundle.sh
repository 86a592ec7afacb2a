#!/usr/bin/env bash
# What vLLM 0.26's DeepSeek-V4 path needs on the GPU machine beyond the vLLM bundle (issue 43 item 4: the tiny V4
# oracle, tests/gpu_e2e/test_deepseek_v4_gpu.py), for Python 3.12 / manylinux, in .gpuv0, .gpuv1, ... (40 MiB parts,
# one per device call, like bench/ray_bundle.sh). The image has torch 2.11.0+cu130 (and with it cuda-bindings and the
# CUDA 13 runtime / NVRTC wheels); the vLLM bundle has apache-tvm-ffi 0.1.15 and vLLM's vendored DeepGEMM and FlashMLA.
#   kernels  tilelang (vLLM's mHC kernels; vLLM 0.26 pins 0.1.9) + z3-solver, ml-dtypes, torch-c-dlpack-ext;
#            the CuTe DSL (nvidia-cutlass-dsl 4.6.0: base, core, the cu13 libraries; not the cu12 ones, which its
#            metadata asks for but which a CUDA 13 driver does not load) + nvidia-cuda-nvdisasm and quack-kernels
#            (`quack.compile_utils`: V4's three CuTe DSL ops, e.g. the compressor of a head-512 compressed layer);
#            cloudpickle, einops, protobuf where the image lacks them;
#            quack-kernels 0.6.1: vLLM 0.26.0's METADATA asks `nvidia-cutlass-dsl[cu13]==4.6.0`, `quack-kernels>=0.4.0`;
#            0.6.1 is the newest quack that pins DSL 4.6.0 exactly (what a fresh install resolved when 0.26.0 shipped,
#            vllm#47571; vLLM's main pinned 0.6.1 until vllm#51566 moved both to 0.6.4 / DSL 4.6.2). 0.4.0 (s28's
#            GPU run) and 0.4.1 do not import with DSL 4.6.0 (`from cutlass.base_dsl import Arch`, `cute.core.ThrMma`)
#            apache-tvm-ffi 0.1.10 (vLLM's pin: TileLang 0.1.9 does not import with the vLLM bundle's 0.1.15) and
#            xgrammar 0.2.7 beside it (the bundle's 0.2.8 needs tvm-ffi >= 0.1.11: `load_lib_module(extra_lib_paths=)`,
#            every engine of the s29 GPU run failed on it; 0.2.7 asks >= 0.1.10, vLLM 0.26 >= 0.2.1)
#   nvcc     nvidia-cuda-nvcc / -crt / nvvm / -cccl 13.0 (torch's cuda-toolkit 13.0.2): TileLang and DeepGEMM compile
#            their kernels at runtime; used only where the image has no nvcc (`bash bench/gpu_session.sh v4` looks)
# On the device: each part `mkdir -p /tmp/gv && cp .gpuvK/* /tmp/gv/`, then `bash bench/gpu_session.sh v4`.
# V4_NVCC=0 leaves the nvcc parts out (when a probe found nvcc on the machine; s28's image had /usr/local/cuda/bin/nvcc
# and g++).
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get() {  # exact versions, no dependency resolution (the image and the vLLM bundle hold the rest; the list is the point)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 -d "$@"
}
get "$tmp/kernels" tilelang==0.1.9 z3-solver==4.15.4.0 ml-dtypes==0.6.0 torch-c-dlpack-ext==0.1.5 \
  nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0 nvidia-cutlass-dsl-libs-core==4.6.0 \
  nvidia-cutlass-dsl-libs-cu13==4.6.0 nvidia-cuda-nvdisasm==13.5.37 quack-kernels==0.6.1 \
  cloudpickle==3.1.3 einops==0.8.2 protobuf==6.33.6 apache-tvm-ffi==0.1.10 \
  xgrammar==0.2.7
[ "${V4_NVCC:-1}" = 1 ] && get "$tmp/nvcc" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-cccl==13.0.85
rm -rf .gpuv*
i=0
for kind in kernels nvcc; do
  [ -d "$tmp/$kind" ] || continue
  tar -C "$tmp/$kind" -cf "$tmp/$kind.tar" .
  (cd "$tmp" && split -b 40M -d -a 2 "$kind.tar" "v4$kind.")
  first=$i
  for part in "$tmp"/v4"$kind".*; do mkdir -p ".gpuv$i" && mv "$part" ".gpuv$i/"; i=$((i + 1)); done
  echo "v4 $kind: $(ls "$tmp/$kind" | wc -l) wheels, $(du -sh "$tmp/$kind.tar" | cut -f1)," \
    "in .gpuv$first .. .gpuv$((i - 1))"
done
du -sh .gpuv* | sed 's/^/  /'
echo "device calls: for k in 0 .. $((i - 1)): carry [\".gpuv\$k\"]," \
  "command 'mkdir -p /tmp/gv && cp .gpuv\$k/* /tmp/gv/';"
echo "  after the vLLM bundle is installed (bash bench/gpu_session.sh install): bash bench/gpu_session.sh v4"
