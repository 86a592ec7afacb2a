#!/usr/bin/env bash
# The steps of one GPU session, from the repo root on the GPU machine (bench/RESULTS.md logs them). Before: the
# bundle parts in /tmp/gb, .whl/ the plugin wheel (bench/build_wheel.sh), .whl/tools/ py-spy, the test-only wheels
# and loguru (bench/tools_wheels.sh), .whl/peer/ hotwire-vllm. Several steps at once, one GPU each: bench/gpu_lanes.sh.
#   install    bundle + plugin + .whl/tools into /tmp/site
#   kernels    tests/gpu and kernels_bench;   cost   request_path_cost, the table-write test, capture_reduce_cost,
#              launch_cost (the eager launch's host µs)
#   checks     tests/gpu_e2e, or the files CHECKS names (VLLM_STEER_E2E_TP / VLLM_STEER_E2E_PP set the parallel sizes);
#              an engine test needs its GPU free of kept A/B servers (stop them first: s33's Gemma Scope engine did not
#              start beside three); the whole log in $OUT/checks.log.gz
#   ab-start   start the A/B servers (SERVERS, default stock,disabled,steer) and keep them
#   ab         the A/B arms on the kept servers;   graph   the graph phase (GRAPH_SERVERS), then stop the servers
#              (GRAPH_NS: its request counts, default 4,16: n16 profiles per_request_n16 / project_n16 beside idle;
#              GRAPH_LOADS: its rows, decode (default), prefill (prefill-prof's), or decode,prefill)
#   sae        SAE kernel tests and sae_kernel_bench, then the SAE arms (first: SERVERS=stock,sae,sae_serial ab-start;
#              transcoders: SERVERS=stock,sae,transcoder ab-start, ARMS=stock,sae_delta_n16,transcoder_idle,transcoder_n16)
#   topk       the full SAE encoder's launch variants (bench/sae_kernel_bench.py --topk-sweep: tiles, warps, K split,
#              stages, hi / lo planes; _select's histogram rounds and warps) at N 16, 1, 64, each beside W_enc's
#              bound (~3 min on an H200 for 12 variants in s31; 16 now)
#   cond       the cond-norm test, then cond vs per-request steering (first: SERVERS=stock,steer,steer_cond ab-start)
#   proj       the projection kernel tests (interpreted and GPU), then project_n16 (16 requests each ablating one
#              direction at every layer's post_mlp) vs per_request_n16 and stock (first: SERVERS=stock,steer,steer_proj
#              ab-start); the late kernel path beside the default EARLY (VLLM_STEER_NORM_EARLY=0): SERVERS and
#              GRAPH_SERVERS add steer_late,steer_proj_late, ARMS add enabled_idle_late,per_request_n16_late,
#              project_idle_late,project_n16_late
#   capture    capture idle, capturing (activations) and writing every layer to disk vs stock (first:
#              GPU_MEM=0.3 SERVERS=stock,steer_capture,steer_capture_fs ab-start; then
#              GRAPH_SERVERS=stock,steer_capture graph counts the capture kernels per decode step)
#   prefill    prefill capture (4 layers, prompt 512, 1 token, 256 requests at c32) to files / to memory vs stock
#              and vLLM's extract_hidden_states (after capture: SERVERS=steer_capture stop, then this starts
#              extract_hs; it needs stock and steer_capture_fs kept)
#   prefill-prof  issue 37: the graph phase's prefill rows alone (GRAPH_LOADS=prefill graph): stock, capture to files
#              (nowait) and to memory, extract_hs, each under the prefill arms' load (prompt 512, max_tokens 1, c32,
#              GRAPH_PREFILL_REQUESTS=128) in torch.profiler: GPU busy / idle between steps, copies, host syncs
#              (first: GPU_MEM=0.3 SERVERS=stock,steer_capture_fs,extract_hs ab-start; stops them at the end)
#   arnorm     issue 40's give-back C: kernels/allreduce_norm's test and bench on two GPUs (lane GPU "0,1"; ~2 min)
#   capture-host  issue 37: bench/prefill_host_cost.py on this host's GPU (prefill arms' shape, then capture_gen_n16's),
#              with --profile: the capture calls' functions by own time ($OUT/*_host_prof.txt; ~3 min, no server)
#   gates      the GPU tests that gate a default or a claim (tiled prefill clamps, full-pack kernels served, transcoders,
#              projections, DeepSeek-V4), then the disk's own fsynced write rate; for a second GPU beside the A/B
#              servers: CUDA_VISIBLE_DEVICES=1 nohup setsid bash bench/gpu_session.sh gates > $OUT/gates.log &
#   idle       launch_cost, then idle_cost --profile (stock vs IDLE_ARMS' steer arm, its own servers, GPU_MEM each)
#   stop       stop the kept servers named in SERVERS
#   host       py-spy on the kept servers of HOST_ARMS (default stock,capture_gen_n16) under their load (an arm's own
#              load if it has one: the prefill arms'); HOST_GIL=1: py-spy --gil (who holds the GIL, per thread and step)
#   ray        the e2e tests with vLLM's Ray executor at TP=2 (first: bench/ray_bundle.sh parts into /tmp/gr)
#   v4         the DeepSeek-V4 oracle with TileLang, the CuTe DSL and (where the image has none) nvcc from
#              bench/v4_bundle.sh's parts in /tmp/gv, installed into /tmp/v4-prefix (after install)
#   small      1b shape: stock, hotwire and vllm-steer on the single-site arms (post_mlp of layer 8, 16 vectors);
#              KEEP=1 keeps the servers, REUSE=1 adopts kept ones (1b servers only)
#   offline    1b shape, engine side only (bench/offline_pairs.py): two stock LLMs (the method's spread) and a steer LLM,
#              enabled_idle / site_named16 / site_inline16, TRIALS (default 40) shuffled trials of one fixed batch
#   fi-install FlashInfer (bench/flashinfer_bundle.sh's parts in /tmp/gf) into /tmp/fi-site, after install; only the
#              arfuse steps put it on PYTHONPATH (in /tmp/site it would turn vLLM's fusion on in every TP step's stock)
#   arfuse-*   issue 40: TP=2 (TP; both GPUs of nvidia-h200-x2) against stock as production runs it, with vLLM's
#              all-reduce + RMSNorm fusion (FlashInfer; on by default at TP >= 2 on Hopper / Blackwell); the fusion's
#              all-reduce is pinned to FlashInfer's IPC backend (trtllm; vLLM's default, mnnvl, uses NVSwitch multicast,
#              which the lent machines forbid); in order, one device call each or all in one lane (bench/gpu_lanes.sh
#              start 0,1 arf 'arfuse-check; arfuse-check; arfuse-start; arfuse-start; arfuse-logs; arfuse-graph;
#              arfuse-ab; SERVERS=stock,stock_nofuse,steer stop'); s32's estimates for 2 x H200, not yet run:
#     arfuse-check  has_flashinfer(), the backend, the trtllm_comm module: prebuilt (bench/flashinfer_aot.sh, in the
#              FlashInfer part) or else built once by FlashInfer's JIT into FLASHINFER_WORKSPACE_BASE, which every
#              server's ranks share (nvcc, 3 sources in parallel: ~3-4 min estimated; the build outlives the call: if
#              the call ends first, call arfuse-check again), then the fused kernel on 2 GPUs vs NCCL + float32 torch
#              (bench/arfuse_check.py; ~30 s with the prebuilt module)
#     arfuse-start  start SERVERS (default stock,stock_nofuse,steer; stock_nofuse: stock with
#              pass_config.fuse_allreduce_rms off) and keep them (TP=2 8b: ~2.5 min each, s19 145-152 s, so three take
#              two calls: the second adopts those still starting)
#     arfuse-logs   each kept server's fusion lines (config, backend, workspace, pass disabled / failed, multicast, our
#              warning; arfuse-start logs the pass at DEBUG: patterns replaced per process) and the fused / steered ops
#              in its compiled code; the logs into $OUT (seconds)
#     arfuse-graph  the graph phase on GRAPH_SERVERS (default stock,stock_nofuse,steer; GRAPH_NS default 16), servers kept:
#              kernels and all-reduce kernels per decode step (~2 min)
#     arfuse-ab     TRIALS=6 A/B (ARMS default stock,stock_nofuse,enabled_idle,per_request_n16; no long arms: ~3 min);
#              then `SERVERS=stock,stock_nofuse,steer stop`
# TRIALS, ARMS, LONG_ARMS, REQUESTS override the defaults; KERNEL_TESTS= (empty) makes `kernels` the bench alone;
# PORT_BASE moves a second suite's ports (a suite beside another also needs its own TMPDIR: bench/gpu_lanes.sh);
# SHAPE (default 8b) the model shape of ab-start / ab / graph / host (1b: issue 41's engine-side numbers);
# KV_GB (GiB, e.g. 6 at 8b): every server's KV cache fixed (--kv-cache-memory-bytes, no memory profiling) and ab-start's
# servers started together (a config's second server once its first is ready: its compile cache); untried on a GPU
# before s39: four 8b servers one by one took 397 s of a session's 1800. 8b: 128 KiB a token, so the prefill arms
# (32 x 513 tokens) and c16 want >= 3, the c256 arms (256 x 384) >= 13; GPU_MEM x the GPU must still be free at each
# server's start;
# TP sets every A/B server's --tensor-parallel-size, QUANT its
# --quantization (fp8: issue 43's FP8 cost; fp8_block: a block-FP8 checkpoint's config, whose linears quantize in the
# graph only off FlashInfer's sm90 GEMM: with VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0 (DeepGEMM) or also
# VLLM_USE_DEEP_GEMM=0 (CUTLASS); stop the bf16 servers first, kept servers do not record
# it). A later run starts with python3 -c 'import vllm' || exit 3
# Every step's commands run under `timeout -k 20`: a process stuck in a CUDA call does not run Python's SIGTERM handler
# (the twenty-seventh's kernels_bench outlived its `timeout 240` by 15 minutes), so SIGKILL follows.
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# multicast stays off in every step and every process it starts (KINDS.md: it can take a lent host's GPUs out of service
# for a day): the machine sets the last three; FlashInfer's all-reduce (vLLM's fusion, once FlashInfer is importable)
# defaults to mnnvl (NVSwitch multicast) in vLLM 0.26: trtllm is CUDA IPC through PyTorch symmetric memory
export VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache  # FlashInfer's JIT cache, one for the check and every server's ranks
mkdir -p "${OUT:=/tmp/out}"
case "${1:-}" in arfuse-*) TP=${TP:-2} ;; esac  # before AB: every arfuse server is TP=2 unless TP says otherwise
PT=(python3 -m pytest -q -p no:cacheprovider -rfE)
AB=(python3 bench/ab_suite.py --shape "${SHAPE:-8b}" --gpu-mem "${GPU_MEM:-0.23}" --tp "${TP:-1}" ${QUANT:+--quantization "$QUANT"}
    ${PORT_BASE:+--port-base "$PORT_BASE"} ${KV_GB:+--kv-cache-gb "$KV_GB"})
KEPT=("${AB[@]}" --phases ab --reuse-servers --keep-servers)
FLAGS=()
[ "${KEEP:-0}" = 1 ] && FLAGS+=(--keep-servers)
[ "${REUSE:-0}" = 1 ] && FLAGS+=(--reuse-servers)
fi_env() {  # FlashInfer importable (fi-install) and nvcc on PATH: vLLM's has_flashinfer() needs both, FlashInfer's JIT too
  [ -d /tmp/fi-site/flashinfer ] || { echo "no FlashInfer in /tmp/fi-site: run fi-install (after the .gpufK calls)"; exit 6; }
  export PYTHONPATH=/tmp/site:/tmp/fi-site
  command -v nvcc > /dev/null || export PATH=/usr/local/cuda/bin:$PATH
  command -v nvcc > /dev/null || { echo "no nvcc: vLLM's has_flashinfer() is False without it"; exit 7; }
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
}
ARF_SERVERS=${SERVERS:-stock,stock_nofuse,steer}
case "${1:-}" in
  install)
    bash /tmp/gb/install.sh || exit 4
    shopt -s nullglob
    python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/site .whl/vllm_steer-*.whl \
      .whl/tools/*.whl || exit 5
    python3 -c 'import vllm, vllm_steer; print("vllm", vllm.__version__, "vllm_steer", vllm_steer.__version__)'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
  kernels)
    [ -n "${KERNEL_TESTS-tests/gpu}" ] && timeout -k 20 300 "${PT[@]}" ${KERNEL_TESTS-tests/gpu} \
      --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -15
    timeout -k 20 330 python3 bench/kernels_bench.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -90
    ;;
  cost)
    timeout -k 20 120 "${PT[@]}" tests/gpu/test_tables_gpu.py 2>&1 | tail -4
    timeout -k 20 240 python3 bench/request_path_cost.py --out "$OUT/request_path_cost.json" 2>&1 | tail -10
    timeout -k 20 120 python3 bench/capture_reduce_cost.py --out "$OUT/capture_reduce_cost.json" 2>&1 | tail -3
    timeout -k 20 120 python3 bench/launch_cost.py --ns 16,8192 --out "$OUT/launch_cost.json" 2>&1 | tail -16
    ;;
  arnorm)  # issue 40: the one-shot all-reduce + add + RMSNorm kernel on two GPUs (a lane on "0,1"); after fi-install
    # the bench times FlashInfer's fused kernel beside it (stock's at TP >= 2)
    timeout -k 20 300 "${PT[@]}" tests/gpu/test_allreduce_norm_gpu.py 2>&1 | tail -15
    arb() { timeout -k 20 300 python3 bench/allreduce_norm_bench.py --out "$OUT/allreduce_norm.json" 2>&1 | tail -12; }
    if [ -d /tmp/fi-site/flashinfer ]; then (fi_env; arb) || arb; else arb; fi  # fi_env exits where nvcc is missing
    ;;
  capture-host)  # issue 37: the capture runtime's main-thread work at the prefill arms' shape and capture_gen_n16's, on
    # this GPU's host, with cProfile of the capture calls (where the prefill plan's ms go)
    timeout -k 20 240 python3 bench/prefill_host_cost.py --device cuda --profile "$OUT/prefill_host_prof.txt" \
      --out "$OUT/prefill_host.json" 2>&1 | tail -28
    timeout -k 20 240 python3 bench/prefill_host_cost.py --device cuda --load decode --steps 256 \
      --profile "$OUT/decode_host_prof.txt" --out "$OUT/decode_host.json" 2>&1 | tail -24
    ;;
  checks)
    # an engine test asks for 0.3 of its GPU: say so at once where kept servers leave less (s33's Gemma Scope start)
    nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i "$CUDA_VISIBLE_DEVICES"} --query-gpu=index,memory.used,memory.total \
      --format=csv,noheader,nounits 2>/dev/null \
      | awk -F', ' '$2 > 0.65 * $3 {printf "WARNING: GPU %s has %d of %d MiB in use (kept A/B servers?): an engine test"\
          " needs 0.3 of it free; stop them first (SERVERS=... stop)\n", $1, $2, $3}'
    # the whole log comes back (an engine's root cause sits far above pytest's last 25 lines: s33's Gemma Scope start)
    VLLM_PLUGINS=steer timeout -k 20 560 "${PT[@]}" ${CHECKS:-tests/gpu_e2e} --junitxml="$OUT/gpu_e2e.xml" 2>&1 \
      | tee "$OUT/checks.log" | tail -25
    rc=$?
    gzip -f "$OUT/checks.log"
    (exit $rc)
    ;;
  ab-start)
    timeout -k 20 590 "${AB[@]}" --phases start --servers "${SERVERS:-stock,disabled,steer}" --reuse-servers --keep-servers \
      --tag start 2>&1 \
      | tail -12
    # where each server's start went (the sessions' largest fixed cost: ~95 s an 8b server in s38)
    for f in "${TMPDIR:-/tmp}"/vllm_steer_ab/logs/*.log; do
      [ -e "$f" ] && grep -ho "Model loading took.*\|torch.compile took.*\|Initial profiling/warmup run took.*\|Graph capturing finished in.*\|init engine (profile.*" "$f" \
        | sed "s|^|$(basename "$f" .log): |" | tail -6
    done
    ;;
  ab)
    timeout -k 20 590 "${KEPT[@]}" --tag ab --trials "${TRIALS:-5}" --long-arms "${LONG_ARMS:-stock,per_request_n16}" \
      --arms "${ARMS:-stock,disabled,enabled_idle,named_shared,per_request_n16,stock_c256,disabled_c256,k256}" \
      2>&1 | tail -60
    ;;
  graph)
    timeout -k 20 590 "${AB[@]}" --phases graph --reuse-servers --tag graph \
      --graph-servers "${GRAPH_SERVERS:-stock,disabled,steer}" 2>&1 | tail -40
    ;;
  prefill-prof)
    GRAPH_LOADS=prefill timeout -k 20 590 "${AB[@]}" --phases graph --reuse-servers --tag prefill_prof \
      --graph-servers "${GRAPH_SERVERS:-stock,steer_capture_fs,extract_hs}" 2>&1 | tail -40
    ;;
  sae)
    timeout -k 20 120 "${PT[@]}" tests/gpu/test_sae_norm_gpu.py 2>&1 | tail -6
    timeout -k 20 150 python3 bench/sae_kernel_bench.py --out "$OUT/sae_kernel.json" 2>&1 | tail -60
    timeout -k 20 300 "${KEPT[@]}" --tag sae --trials "${TRIALS:-4}" --long-arms "" --deadline-s 280 \
      --arms "${ARMS:-stock,sae_idle,sae_serial_idle,sae_delta_n16,sae_serial_delta_n16}" 2>&1 | tail -40
    ;;
  topk)
    timeout -k 20 420 python3 bench/sae_kernel_bench.py --topk-sweep --out "$OUT/topk_sweep.json" 2>&1 \
      | tee "$OUT/topk_sweep.log" | tail -90
    ;;
  cond)
    timeout -k 20 120 "${PT[@]}" tests/gpu/test_cond_norm_gpu.py 2>&1 | tail -6
    timeout -k 20 420 "${KEPT[@]}" --tag cond --trials "${TRIALS:-5}" --long-arms "" --deadline-s 400 \
      --arms "${ARMS:-stock,per_request_n16,cond_idle,cond_off_n16,cond_n16}" 2>&1 | tail -40
    ;;
  proj)
    timeout -k 20 240 "${PT[@]}" tests/gpu/test_proj_norm_gpu.py 2>&1 | tail -6
    timeout -k 20 420 "${KEPT[@]}" --tag proj --trials "${TRIALS:-5}" --long-arms "" --deadline-s 400 \
      --arms "${ARMS:-stock,per_request_n16,project_idle,project_n16,enabled_idle}" 2>&1 | tail -40
    ;;
  capture)
    timeout -k 20 540 "${KEPT[@]}" --tag capture --trials "${TRIALS:-5}" --long-arms "" --deadline-s 520 \
      --arms "${ARMS:-stock,capture_idle,capture_gen_n16,capture_fs_all,capture_fs_all_nosync,capture_fs_all_nowait}" 2>&1 | tail -50
    ;;
  prefill)
    timeout -k 20 580 "${KEPT[@]}" --tag prefill --trials "${TRIALS:-3}" --long-arms "" --deadline-s 560 \
      --arms "${ARMS:-prefill_stock,prefill_capture_idle,prefill_capture_fs,prefill_capture_fs_nosync,prefill_capture_fs_nowait,prefill_capture_mem,prefill_extract_hs}" 2>&1 | tail -40
    ;;
  host)
    timeout -k 20 400 "${KEPT[@]}" --phases host --tag "host${HOST_GIL:+_gil}_$(echo "${HOST_ARMS:-stock,capture_gen_n16}" | tr , _)" --host-arms "${HOST_ARMS:-stock,capture_gen_n16}" \
      ${HOST_GIL:+--host-gil} 2>&1 | tail -20
    ;;
  gates)
    for t in tests/gpu/test_sae_norm_gpu.py tests/gpu/test_sae_full_gpu.py tests/gpu/test_transcoder_gpu.py \
        tests/gpu/test_proj_norm_gpu.py; do
      # a test past 150 s dumps every thread's stack (pytest's faulthandler): the twenty-fifth's stall, if it recurs
      echo "== $t"; timeout -k 20 300 "${PT[@]}" --durations=5 -o faulthandler_timeout=150 "$t" > /tmp/gates_k.log 2>&1
      grep -B2 -A30 "Timeout (0:02:30)" /tmp/gates_k.log | head -60; tail -25 /tmp/gates_k.log
    done
    for t in tests/gpu_e2e/test_sae_full_engine_gpu.py tests/gpu_e2e/test_deepseek_v4_gpu.py; do
      echo "== $t"; VLLM_PLUGINS=steer timeout -k 20 420 "${PT[@]}" -rs "$t" > /tmp/gates_e2e.log 2>&1
      grep -v "Deprecat\|warnings.warn" /tmp/gates_e2e.log | grep "passed\|failed\|skipped\|Error\|^E " | tail -25
    done
    echo "== disk: 4 GiB, O_DSYNC, then buffered + one fsync"
    dd if=/dev/zero of=/tmp/dd_probe bs=64M count=64 oflag=dsync 2>&1 | tail -1
    dd if=/dev/zero of=/tmp/dd_probe bs=64M count=64 conv=fsync 2>&1 | tail -1
    rm -f /tmp/dd_probe; df -h /tmp | tail -1
    ;;
  idle)  # host µs per eager launch of our norm vs vLLM's, then the idle cost with every process profiled (counts of
         # our functions per request / step); the A/B suite's 8b model directory, under this lane's TMPDIR
    timeout -k 20 120 python3 bench/launch_cost.py --out "$OUT/launch.json" 2>&1 | grep -v "INFO\|WARNING" | tail -20
    M=$(python3 -c 'import sys, tempfile; from pathlib import Path; sys.path.insert(0, "bench")
from abkit.servers import SHAPES, write_model_dir
print(write_model_dir(Path(tempfile.gettempdir()) / "vllm_steer_ab" / "model-8b-bfloat16", SHAPES["8b"], "bfloat16"))')
    timeout -k 20 560 python3 bench/idle_cost.py --gpu --model "$M" --load-format dummy \
      --gpu-mem "${GPU_MEM:-0.3}" --arms "${IDLE_ARMS:-stock,steer_capture}" --concurrency 32 --requests 256 \
      --max-tokens 64 --profile --out "$OUT/idle_profile.json" 2>&1 | tail -60
    ;;
  stop)
    timeout -k 20 120 "${AB[@]}" --phases stop --reuse-servers --keep-servers --servers "${SERVERS:?names}" --tag stop \
      2>&1 | tail -5
    ;;
  ray)  # after the .gpurK calls (bench/ray_bundle.sh: each `mkdir -p /tmp/gr && cp .gpurK/* /tmp/gr/`); 2+ GPUs
    mkdir -p /tmp/rw && cat $(ls /tmp/gr/raypart* | sort -V) | tar -C /tmp/rw -xf - || exit 6
    # --prefix, not --target: requirements the image (or the bundle) already satisfies are not installed again
    python3 -m pip install -q --no-index --find-links /tmp/rw --prefix /tmp/ray-prefix ray || exit 6
    export PYTHONPATH=/tmp/site:/tmp/ray-prefix/lib/python3.12/site-packages
    python3 -c 'import ray, vllm; print("ray", ray.__version__)' || exit 6
    VLLM_PLUGINS=steer VLLM_STEER_E2E_TP="${TP:-2}" VLLM_STEER_E2E_BACKEND=ray timeout -k 20 560 "${PT[@]}" \
      tests/gpu_e2e/test_engine_vs_hf_gpu.py tests/gpu_e2e/test_capture_vs_hf_gpu.py --junitxml="$OUT/gpu_e2e_ray.xml" \
      2>&1 | tail -25
    ;;
  v4)  # after install and the .gpuvK calls (bench/v4_bundle.sh: each `mkdir -p /tmp/gv && cp .gpuvK/* /tmp/gv/`)
    python3 -c 'import vllm' || exit 3
    P=/tmp/v4-prefix
    site() { find "$P" -maxdepth 5 -type d -path '*-packages/tilelang' 2>/dev/null | head -1 | xargs -r dirname; }
    if [ -z "$(site)" ]; then
      rm -rf /tmp/vw && mkdir -p /tmp/vw/kernels
      cat $(ls /tmp/gv/v4kernels.* | sort -V) | tar -C /tmp/vw/kernels -xf - || exit 6
      W=(/tmp/vw/kernels/{tilelang,z3_solver,ml_dtypes,torch_c_dlpack_ext,nvidia_cutlass_dsl,nvidia_cuda_nvdisasm}*.whl
         /tmp/vw/kernels/quack_kernels*.whl)
      for m in cloudpickle:cloudpickle einops:einops google.protobuf:protobuf; do  # the image's own where it has them
        python3 -c "import ${m%%:*}" 2>/dev/null || W+=(/tmp/vw/kernels/"${m##*:}"-*.whl)
      done
      # --no-deps: the list is bench/v4_bundle.sh's (not nvidia-cutlass-dsl's cu12 libraries, not cuda-python)
      python3 -m pip install -q --no-deps --no-index --no-compile --prefix "$P" "${W[@]}" || exit 6
      # vLLM 0.26 pins tilelang 0.1.9 with apache-tvm-ffi 0.1.10: 0.1.9 does not import with the vLLM bundle's 0.1.15
      # ("Type 'ffi.Tensor' already has a registered class"), so 0.1.10 goes before it, for this step only, with
      # xgrammar 0.2.7 (the bundle's 0.2.8 calls tvm-ffi >= 0.1.11: every engine failed at start in s29)
      python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/v4-tvm \
        /tmp/vw/kernels/apache_tvm_ffi-*.whl /tmp/vw/kernels/xgrammar-*.whl || exit 6
    fi
    S=$(site)  # pip's --prefix layout (lib/python3.12/site-packages for the ray step; Debian's may differ)
    # the CuTe DSL's .pth (which puts dsl_packages on sys.path) runs only in site directories, not on PYTHONPATH
    export PYTHONPATH=/tmp/v4-tvm:/tmp/site:$S:$S/nvidia_cutlass_dsl/dsl_packages
    # nvcc for TileLang's and DeepGEMM's runtime compiles: the image's, else the bundle's CUDA 13.0 compiler with the
    # image's own CUDA headers (torch's nvidia-cuda-runtime) merged into its include folder
    [ -n "${CUDA_HOME:-}" ] && [ ! -x "$CUDA_HOME/bin/nvcc" ] && { echo "CUDA_HOME=$CUDA_HOME has no nvcc"; unset CUDA_HOME; }
    NV=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
    if [ -z "${CUDA_HOME:-}" ] && [ -n "$NV" ]; then export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NV")")"); fi
    if [ -z "${CUDA_HOME:-}" ] && ls /tmp/gv/v4nvcc.* > /dev/null 2>&1; then
      T=/tmp/v4-nvcc/nvidia/cu13
      if [ ! -x "$T/bin/nvcc" ]; then
        mkdir -p /tmp/vw/nvcc && cat $(ls /tmp/gv/v4nvcc.* | sort -V) | tar -C /tmp/vw/nvcc -xf - || exit 7
        python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/v4-nvcc /tmp/vw/nvcc/*.whl || exit 7
        INC=$(python3 -c 'import importlib.metadata as m, os; print(os.path.dirname(next(str(f.locate()) for f in
          m.files("nvidia-cuda-runtime") if f.name == "cuda_runtime.h")))') || exit 7
        cp -rsn "$INC"/. "$T/include/" && mkdir -p "$T/targets" && ln -sfn "$T" "$T/targets/x86_64-linux"
      fi
      export CUDA_HOME=$T PATH=$T/bin:$PATH
    fi
    echo "CUDA_HOME=${CUDA_HOME:-none} nvcc: $("${CUDA_HOME:-/none}/bin/nvcc" --version 2>&1 | tail -1)"
    echo "host compilers: $(command -v gcc g++ c++ | tr '\n' ' ')"
    python3 - <<'PY' 2>&1 | grep -v "Warning\|warn("
import tilelang, cutlass, quack, cuda.bindings.driver  # noqa: F401 - the imports are the check
from vllm.utils.deep_gemm import is_deep_gemm_supported
from vllm.utils.import_utils import has_cutedsl, has_tilelang
from vllm.v1.attention.ops.flashmla import is_flashmla_sparse_supported
print("tilelang", tilelang.__version__, "CUDA_HOME", tilelang.env.CUDA_HOME, "| vLLM sees tilelang", has_tilelang(),
      "cutedsl", has_cutedsl(), "deep_gemm", is_deep_gemm_supported(), "sparse FlashMLA", is_flashmla_sparse_supported())
PY
    VLLM_PLUGINS=steer timeout -k 20 540 "${PT[@]}" -rs tests/gpu_e2e/test_deepseek_v4_gpu.py \
      --junitxml="$OUT/gpu_e2e_v4.xml" > /tmp/v4_e2e.log 2>&1
    gzip -c /tmp/v4_e2e.log > "$OUT/v4_e2e.log.gz"
    # a stock engine's failure: its last frames (the skip reason names the deepest one, file:line: source)
    grep "^v4 stock failure| " /tmp/v4_e2e.log | tail -40
    grep -v "Deprecat\|warnings.warn\|^v4 stock failure| " /tmp/v4_e2e.log |
      grep "passed\|failed\|skipped\|SKIPPED\|Error\|^E " | tail -30
    ;;
  small)
    SITE=stock,hotwire_idle,hotwire_ids16,hotwire_ids16_tiny,enabled_idle,site_named16,site_inline16
    timeout -k 20 590 python3 bench/ab_suite.py --shape 1b --gpu-mem 0.15 --phases ab --tag small1b --long-arms "" \
      --peer-wheel "$(ls .whl/peer/hotwire_vllm-*.whl 2>/dev/null | head -1)" --trials "${TRIALS:-8}" \
      --requests "${REQUESTS:-256}" --arms "${ARMS:-$SITE,site_named16_tiny,site_inline16_tiny}" \
      ${FLAGS[@]+"${FLAGS[@]}"} 2>&1 | tail -90
    ;;
  offline)
    # the three engines start in ~3-4 min (s28: not done 4 min in); trials stop at the deadline with a summary
    timeout -k 20 590 python3 bench/offline_pairs.py --shape 1b --trials "${TRIALS:-40}" --gpu-mem "${GPU_MEM:-0.12}" \
      --deadline-s "${DEADLINE_S:-300}" --out "$OUT/offline_pairs_1b.json" 2>&1 | tee "$OUT/offline.log" \
      | grep -v "INFO\|WARNING\|Deprecat\|warnings.warn" | tail -60
    ;;
  fi-install)  # after install and the .gpufK calls (bench/flashinfer_bundle.sh: each `mkdir -p /tmp/gf && cp .gpufK/* /tmp/gf/`)
    python3 -c 'import vllm' || exit 3
    if [ ! -d /tmp/fi-site/flashinfer ]; then
      rm -rf /tmp/fw && mkdir -p /tmp/fw && cat $(ls /tmp/gf/fipart.* | sort -V) | tar -C /tmp/fw -xf - || exit 6
      # --no-deps: what FlashInfer imports is on the image or in the vLLM bundle (bench/flashinfer_bundle.sh says which)
      python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/fi-site /tmp/fw/*.whl || exit 6
      # bench/flashinfer_aot.sh's prebuilt trtllm_comm (sm_90a): FlashInfer loads data/aot/<name>/<name>.so without JIT
      [ -f /tmp/fw/aot/trtllm_comm/trtllm_comm.so ] && cp -r /tmp/fw/aot /tmp/fi-site/flashinfer/data/
    fi
    ls /tmp/fi-site/flashinfer/data/aot/*/*.so 2> /dev/null || echo "no prebuilt trtllm_comm: arfuse-check compiles it"
    fi_env
    python3 -c 'import flashinfer, flashinfer.comm; print("flashinfer", flashinfer.__version__, flashinfer.__file__)' || exit 6
    ;;
  arfuse-check)
    fi_env
    echo "nvcc $(command -v nvcc) ($(nvcc --version | tail -1)); ninja $(command -v ninja); CUDA_HOME $CUDA_HOME"
    nvidia-smi topo -m 2>&1 | head -6
    # without the prebuilt module trtllm_comm is minutes of nvcc (s32's CPU box, a share of 2 busy cores: 193, 477 and
    # 182 s for its 3 sources): loaded or built by a process in a session of its own, which neither this call's end
    # nor a timeout kills; a call that finds it running waits on it
    J=$FLASHINFER_WORKSPACE_BASE
    mkdir -p "$J"
    if [ ! -e "$J/jit.done" ] && ! { [ -e "$J/jit.pid" ] && kill -0 "$(cat "$J/jit.pid")" 2> /dev/null; }; then
      setsid nohup python3 bench/arfuse_check.py --jit-only "$J/jit.done" > "$J/jit.log" 2>&1 < /dev/null &
      echo $! > "$J/jit.pid"
    fi
    end=$((SECONDS + ${JIT_WAIT_S:-480}))
    while [ ! -e "$J/jit.done" ] && [ $SECONDS -lt $end ] && kill -0 "$(cat "$J/jit.pid")" 2> /dev/null; do sleep 2; done
    grep -v "Deprecat\|warnings.warn" "$J/jit.log" | tail -4
    [ -e "$J/jit.done" ] || { echo "trtllm_comm not built yet (or failed: jit.log above): call arfuse-check again"; exit 11; }
    timeout -k 20 300 python3 bench/arfuse_check.py 2>&1 | grep -v "Deprecat\|warnings.warn" | tail -25
    ;;
  arfuse-start)
    fi_env
    # the fusion pass's "Replaced N patterns" and FlashInfer's workspace line are DEBUG: those two loggers only
    timeout -k 20 590 "${AB[@]}" --phases start --servers "$ARF_SERVERS" --reuse-servers --keep-servers --tag arfuse_start \
      --debug-loggers vllm.compilation.passes.fusion.allreduce_rms_fusion,vllm.distributed.device_communicators.flashinfer_all_reduce \
      2>&1 | tail -12
    ;;
  arfuse-logs)
    L=$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/vllm_steer_ab/logs  # ab_suite's --workdir default
    for s in ${ARF_SERVERS//,/ }; do
      f=$L/$s.log
      [ -f "$f" ] || { echo "== $s: no log at $f"; continue; }
      echo "== $s"
      grep -o "fuse_allreduce_rms': [A-Za-z]*" "$f" | sort | uniq -c
      # vLLM 0.26's own lines (flashinfer_all_reduce.py, allreduce_rms_fusion.py) and ours (runtime/allreduce_fusion.py)
      grep -E "flashinfer allreduce backend|FlashInfer Allreduce norm|FlashInfer All Reduce|AllReduce fusion pass|allreduce fusion|mnnvl|ulticast|all-reduce \+ RMSNorm" \
        "$f" | sed -E 's/^.*(INFO|WARNING|ERROR|DEBUG)/\1/' | sort | uniq -c | head -20
      # the pass's count per compiled graph (a piece and its compile range), summed per process
      grep -E "Replaced [0-9]+ patterns" "$f" | awk '{k = "process"; if (match($0, /\(Worker[A-Za-z_0-9]*/))
        k = substr($0, RSTART + 1, RLENGTH - 1); if (match($0, /Replaced [0-9]+/)) { n[k] += substr($0, RSTART + 9,
        RLENGTH - 9); c[k]++ } } END { for (k in n) printf "  %s: %d all-reduce + norm patterns replaced in %d compiled" \
        " graphs\n", k, n[k], c[k] }' | sort
      for d in $(grep -o "Using cache directory: [^ ]*" "$f" | awk '{print $4}' | sort -u); do
        echo "  $d: fused all-reduce ops $(grep -rao flashinfer_trtllm_fused_allreduce_norm "$d" | wc -l)," \
          "steered norm ops $(grep -raoE 'vllm_steer[._]steered_norm[a-z0-9_]*' "$d" | wc -l) (in every compiled file;" \
          "0 and 0: artifacts not greppable, the graph phase's all-reduce kernels count instead)"
      done
      gzip -c "$f" > "$OUT/server_$s.log.gz"
    done
    ;;
  arfuse-graph)
    fi_env
    GRAPH_NS=${GRAPH_NS:-16} timeout -k 20 590 "${AB[@]}" --phases graph --reuse-servers --keep-servers --tag arfuse_graph \
      --graph-servers "${GRAPH_SERVERS:-stock,stock_nofuse,steer}" 2>&1 | grep -v "Deprecat\|warnings.warn" | tail -30
    ;;
  arfuse-ab)
    fi_env
    timeout -k 20 590 "${KEPT[@]}" --tag arfuse_ab --trials "${TRIALS:-6}" --long-arms "${LONG_ARMS-}" --deadline-s 560 \
      --arms "${ARMS:-stock,stock_nofuse,enabled_idle,per_request_n16}" 2>&1 | tail -40
    ;;
  *) echo "usage: bash bench/gpu_session.sh install|kernels|cost|checks|ab-start|ab|graph|prefill-prof|sae|cond|proj|capture|prefill|gates|idle|stop|host|ray|v4|small|offline|fi-install|arfuse-check|arfuse-start|arfuse-logs|arfuse-graph|arfuse-ab" >&2
     exit 2 ;;
esac
