#!/usr/bin/env bash
# Several GPU lanes at once on one multi-GPU machine: each lane is a background chain of bench/gpu_session.sh steps
# pinned to one GPU, with its own TMPDIR (A/B state file, model, caches), ports and results folder, so the A/B suites
# of different lanes never adopt each other's servers. Run from the repo root on the GPU machine, after `install`.
#   start GPU NAME 'STEP; STEP; ...'   a lane (GPU: one index, or a list "2,3" for a TP lane): each STEP is `[VAR=value ...] step` of gpu_session.sh, run in order;
#                                      a NAME started again (its steps ended, or it was lost) goes on in its folder, so
#                                      its A/B suite adopts the servers its earlier steps kept
#   poll [SECONDS]                     wait (at most SECONDS, default 0) while any lane runs, then print each lane's
#                                      state (ended / running: its step / LOST: its process gone before its log
#                                      ended) and its log's tail, and pack every log and result into $OUT/lanes.tgz
#                                      (a call brings back only a few files: one archive comes back whole)
# A lane on GPU k gets CUDA_VISIBLE_DEVICES=k, TMPDIR=/tmp/lanes/NAME/tmp, PORT_BASE=8100+100*k, OUT=/tmp/lanes/NAME/out.
set -uo pipefail
L=${LANES_DIR:-/tmp/lanes}  # LANES_DIR: tests put the lanes elsewhere
ended() { tail -1 "$1" | grep -q "lane done"; }  # a lane's log whose steps have all run
alive() { local p; p=$(cat "${1%.log}.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }  # its process still runs
running() { ! ended "$1" && alive "$1"; }  # (a log that never ended, with its process gone: a lost lane)
case "${1:-}" in
  start)
    # the device tool ends the calling command's process group when the call returns: a lane runs in its own session
    [ -z "${LANES_SESSION:-}" ] && exec env LANES_SESSION=1 setsid -w bash "$0" "$@"
    gpu=${2:?gpu} name=${3:?name} steps=${4:?steps}
    if [ -e "$L/$name.log" ] && running "$L/$name.log"; then
      echo "lane $name is still running" >&2; exit 2
    fi
    [ -e "$L/$name.log" ] && ! ended "$L/$name.log" && echo "=== $(date +%T) lane lost: started again" >> "$L/$name.log"
    mkdir -p "$L/$name/tmp" "$L/$name/out"
    (
      # GPU may list several ("2,3": a TP=2 lane): the port base is its first's
      export CUDA_VISIBLE_DEVICES=$gpu TMPDIR=$L/$name/tmp PORT_BASE=$((8100 + 100 * ${gpu%%,*})) OUT=$L/$name/out
      IFS=';' read -ra list <<< "$steps"
      for s in "${list[@]}"; do
        read -ra w <<< "$s"
        [ ${#w[@]} -gt 0 ] || continue
        echo "=== $(date +%T) $s"
        env "${w[@]:0:${#w[@]}-1}" bash bench/gpu_session.sh "${w[-1]}"; rc=$?
        echo "=== $(date +%T) rc=$rc $s"
      done
      echo "=== $(date +%T) lane done"
    ) >> "$L/$name.log" 2>&1 < /dev/null &
    echo $! > "$L/$name.pid"; disown; echo "lane $name on GPU $gpu: pid $!"
    ;;
  poll)
    end=$((SECONDS + ${2:-0}))
    any() { for f in "$L"/*.log; do [ -e "$f" ] && running "$f" && return 0; done; return 1; }
    while [ $SECONDS -lt $end ] && any; do sleep 2; done
    for f in "$L"/*.log; do
      state="ended"
      ended "$f" || { alive "$f" && state="running: $(grep "^=== " "$f" | tail -1)"; } \
        || state="LOST: its process is gone and its log never ended"
      echo "##### $(basename "$f" .log) ($state)"
      grep -v "Deprecat\|warnings.warn\|INFO\|WARNING" "$f" | tail -"${TAIL:-25}"
    done
    mkdir -p "${OUT:=/tmp/out}" && tar -C "$L" -czf "$OUT/lanes.tgz" --exclude='*/tmp' .
    ;;
  *) echo "usage: bash bench/gpu_lanes.sh start GPU NAME 'STEPS' | poll [SECONDS]" >&2; exit 2 ;;
esac
