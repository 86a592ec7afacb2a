#!/usr/bin/env bash
# The steps of one GPU session, run from the repo root on the GPU machine (bench/RESULTS.md has
# the session log). Before: the bundle parts were copied to /tmp/gb (one run each, carry .gpuK), and
# .whl/ holds the plugin wheel (bench/build_wheel.sh), .whl/old/ the previous release, .whl/tools/ py-spy.
#   bash bench/gpu_session.sh install     bundle + plugin + py-spy into /tmp/site, old release into /tmp/old_site
#   bash bench/gpu_session.sh kernels     tests/gpu and kernels_bench (one run: under 10 minutes)
#   bash bench/gpu_session.sh cost        request_path_cost (host cost per request, per stage) and the table-write test
#   bash bench/gpu_session.sh compiled    compiled_code (Inductor's output for stock, steer, old kernel, old inline)
#   bash bench/gpu_session.sh checks      gpu_check (HF oracle, compiled + CUDA graphs) and gpu_capture_check
#   bash bench/gpu_session.sh ab-start    start the A/B servers and keep them (stock, disabled, steer, steer_old)
#   bash bench/gpu_session.sh ab          the A/B arms on the kept servers
#   bash bench/gpu_session.sh graph-host  the graph and host phases, then stop the servers
#   bash bench/gpu_session.sh sae         tests/gpu SAE kernel tests, then the SAE arms on kept servers
#                                         (first: SERVERS=stock,sae,sae_full bash bench/gpu_session.sh ab-start)
# Every later run starts with: python3 -c 'import vllm' || exit 3 (a fresh machine fails fast).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
OLD_WHEEL="$(ls .whl/old/vllm_steer-*.whl 2>/dev/null | head -1)"
AB=(python3 bench/ab_suite.py --shape 8b --old-wheel "$OLD_WHEEL" --gpu-mem 0.23)
case "${1:-}" in
  install)
    bash /tmp/gb/install.sh || exit 4
    python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/site .whl/vllm_steer-*.whl .whl/tools/*.whl || exit 5
    python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/old_site "$OLD_WHEEL" || exit 6
    python3 -c 'import vllm, vllm_steer; print("vllm", vllm.__version__, "vllm_steer", vllm_steer.__version__)'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
  kernels)
    timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -rfE --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -15
    timeout 240 python3 bench/kernels_bench.py --out "$OUT/kernels.json" 2>&1 | tail -70
    ;;
  cost)
    timeout 120 python3 -m pytest tests/gpu/test_tables_gpu.py -q -p no:cacheprovider -rfE 2>&1 | tail -4
    timeout 240 python3 bench/request_path_cost.py --out "$OUT/request_path_cost.json" 2>&1 | tail -10
    ;;
  compiled)
    timeout 560 python3 bench/compiled_code.py --old-site /tmp/old_site 2>&1 | tail -8
    ;;
  checks)
    VLLM_PLUGINS=steer timeout 360 python3 bench/gpu_check.py --tag=-new 2>&1 | tail -12
    VLLM_PLUGINS=steer timeout 200 python3 bench/gpu_capture_check.py 2>&1 | tail -25
    ;;
  ab-start)
    timeout 590 "${AB[@]}" --phases start --servers "${SERVERS:-stock,disabled,steer,steer_old}" --keep-servers --tag start 2>&1 | tail -12
    ;;
  ab)
    timeout 590 "${AB[@]}" --phases ab --reuse-servers --keep-servers --tag ab --trials "${TRIALS:-5}" \
      --arms "${ARMS:-stock,disabled,enabled_idle,named_shared,per_request_n16,enabled_idle_old,named_shared_old,per_request_n16_old,stock_c256,disabled_c256,k256,k256_old}" \
      --long-arms "${LONG_ARMS:-stock,per_request_n16,per_request_n16_old}" 2>&1 | tail -60
    ;;
  graph-host)
    timeout 590 "${AB[@]}" --phases graph,host --reuse-servers --tag graphhost --host-duration 60 \
      --graph-servers "${GRAPH_SERVERS:-stock,disabled,steer,steer_old}" --host-servers "${HOST_SERVERS:-stock,steer,steer_old}" 2>&1 | tail -40
    ;;
  sae)
    timeout 120 python3 -m pytest tests/gpu/test_sae_norm_gpu.py -q -p no:cacheprovider -rfE 2>&1 | tail -6
    timeout 470 "${AB[@]}" --phases ab --reuse-servers --keep-servers --tag sae --trials "${TRIALS:-3}" --long-arms "" \
      --arms "${ARMS:-stock,sae_idle,sae_delta_n16,sae_full_idle,sae_reconstruct_n16}" 2>&1 | tail -40
    ;;
  *) echo "usage: bash bench/gpu_session.sh install|kernels|cost|compiled|checks|ab-start|ab|graph-host|sae" >&2; exit 2 ;;
esac
