#!/usr/bin/env bash
# FlashInfer's trtllm_comm module (the fused all-reduce + RMSNorm kernels vLLM's AllReduceFusionPass calls) built here,
# on the CPU box, for sm_90a (H100 / H200), so the GPU session loads it instead of spending minutes of nvcc on it:
# FlashInfer loads a module from flashinfer/data/aot/<name>/<name>.so without its JIT when that file exists
# (jit/core.py JitSpec.is_aot), and bench/flashinfer_bundle.sh packs this file beside the wheel for fi-install.
# The build is FlashInfer's own JIT build (its ninja file and flags), with CUDA 13.0's nvcc from NVIDIA's wheels (the
# GPU image's CUDA; the same wheels as bench/v4_bundle.sh's nvcc part) and a Python holding torch 2.11 and
# apache-tvm-ffi 0.1.15.post2 (the GPU bundle's: the module links against libtvm_ffi, not torch or Python), FlashInfer
# and nvidia-ml-py on a scratch PYTHONPATH (nothing installed into that Python). The link needs libcuda: a stub with
# its soname (the module needs only libcudart.so.13, which torch has loaded, and libtvm_ffi's symbols). s32 on this box,
# a share of its 2 busy cores: 193, 477 and 182 s for the 3 sources, 9 MB; it loads here through tvm_ffi (no GPU).
#   FI_PYTHON=/work/main/.venv/bin/python bash bench/flashinfer_aot.sh     (writes $FI_AOT_CACHE/trtllm_comm.so)
set -euo pipefail
cache=${FI_AOT_CACHE:-$HOME/.cache/vllm-steer-fi-aot}
py=${FI_PYTHON:-$(git rev-parse --show-toplevel)/.venv/bin/python}
version=${FLASHINFER_VERSION:-0.6.14}
mkdir -p "$cache"
cd "$cache"
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform any -d wheels "$@"
}
if [ ! -x nvcc/nvidia/cu13/bin/nvcc ]; then
  get nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 \
    nvidia-cuda-runtime==13.0.96
  python3 -m pip install -q --no-deps --no-index --no-compile --target nvcc wheels/nvidia_*.whl
fi
T=$cache/nvcc/nvidia/cu13
ln -sfn lib "$T/lib64" && ln -sfn libcudart.so.13 "$T/lib/libcudart.so" && mkdir -p "$T/lib/stubs"
[ -e "$T/lib/stubs/libcuda.so" ] || echo "" | gcc -shared -Wl,-soname,libcuda.so.1 -o "$T/lib/stubs/libcuda.so" -x c -
if [ ! -d "site/flashinfer" ]; then
  get "flashinfer-python==$version" nvidia-ml-py
  mkdir -p site && for w in wheels/flashinfer_python-"$version"-*.whl wheels/nvidia_ml_py-*.whl; do
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" site; done
fi
"$py" -c 'import tvm_ffi, torch; print("tvm_ffi", tvm_ffi.__version__, "torch", torch.__version__)'
t0=$SECONDS
CUDA_HOME=$T PATH=$T/bin:$PATH FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_WORKSPACE_BASE=$cache/ws PYTHONPATH=$cache/site \
  nice -n "${NICE:-10}" "$py" -c '
from flashinfer.jit.comm import gen_trtllm_comm_module
spec = gen_trtllm_comm_module()
spec.build(verbose=False)  # its ninja build; loading needs a GPU
print(spec.jit_library_path)' > build.out
so=$(tail -1 build.out)
cp "$so" trtllm_comm.so
echo "trtllm_comm.so (sm_90a, flashinfer $version): $(du -h trtllm_comm.so | cut -f1), built in $((SECONDS - t0)) s," \
  "in $cache"
