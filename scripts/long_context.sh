#!/usr/bin/env bash
# The long-context stretch on one GPU (issue 56): one training step of the 7B shape at 524,288
# tokens in one sequence, and of the 1.5B shape (all 28 layers) at 1,048,576 tokens. A step takes
# 10 to 15 minutes, longer than one device command, so the run is started in the background with
# setsid and read in a later command:
#
#   scripts/long_context.sh start BIN DIR [7b-512k|1.5b-1m]...   starts the runs, one after the other
#   scripts/long_context.sh read DIR OUT                          what has finished, copied to OUT
#
# BIN holds bench_train and megatrain-plan (with libtbb in BIN/../lib). DIR must outlive the
# command (e.g. /tmp/mt-long, not $OUT). Each shape first asks megatrain-plan whether exact
# clipping fits on this GPU and a 120 GiB host; if it does not, the step runs without clipping.
# The log says which (DIR/<shape>.mode), and bench_train prints the step time, the GPU and host
# memory measured and planned.
set -uo pipefail
cmd=${1:-}
shift || true

args_of() {
  case $1 in
    7b-512k) echo "--preset qwen2.5-7b --batch 1 --seq 524288" ;;
    1.5b-1m) echo "--preset qwen2.5-1.5b --batch 1 --seq 1048576" ;;
    *) echo "unknown shape $1 (7b-512k or 1.5b-1m)" >&2; return 2 ;;
  esac
}

run_shape() {  # BIN DIR SHAPE
  local bin=$1 dir=$2 shape=$3 mode=exact
  read -r -a args <<< "$(args_of "$shape")" || return 2
  local gpu_bytes
  gpu_bytes=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)  # MiB
  if ! MEGATRAIN_HOST_MEMORY=120G "$bin/megatrain-plan" "${args[@]}" --backend cuda --gpu-memory "${gpu_bytes}M" \
       --host-memory 120G > "$dir/$shape.plan-exact.log" 2>&1; then
    mode=none
  fi
  echo "$mode" > "$dir/$shape.mode"
  MEGATRAIN_HOST_MEMORY=120G "$bin/bench_train" "${args[@]}" --steps 1 --skip 0 --clip-mode "$mode" \
    > "$dir/$shape.log" 2>&1
  echo "$?" > "$dir/$shape.rc"
}

case $cmd in
  start)
    bin=$(cd "$1" && pwd) dir=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
    shapes=${*:-7b-512k 1.5b-1m}
    for s in $shapes; do args_of "$s" > /dev/null || exit 2; done
    NV=$(python3 -c "import os,torch;print(os.path.dirname(torch.__path__[0]))" 2>/dev/null)/nvidia
    export LD_LIBRARY_PATH=$bin/../lib:$NV/cudnn/lib:$NV/nccl/lib:$NV/cu13/lib:${LD_LIBRARY_PATH:-}
    export -f run_shape args_of
    setsid nohup bash -c 'for s in '"$shapes"'; do date +%s > "$1/$s.start"; run_shape "$0" "$1" "$s"; done' \
      "$bin" "$dir" > "$dir/driver.log" 2>&1 < /dev/null &
    echo "started: $shapes (pid $!); read with: scripts/long_context.sh read $dir OUT"
    ;;
  read)
    dir=$1 out=$(mkdir -p "$2" && cd "$2" && pwd)
    cp "$dir"/* "$out"/ 2>/dev/null
    for log in "$dir"/*.start; do
      [[ -e $log ]] || { echo "nothing started in $dir"; exit 1; }
      s=$(basename "$log" .start)
      if [[ -e $dir/$s.rc ]]; then
        echo "$s: exit $(cat "$dir/$s.rc"), clipping $(cat "$dir/$s.mode")"
        grep -E '^\| (tokens/s|step time|peak|plan)' "$dir/$s.log"
      else
        echo "$s: running for $(( $(date +%s) - $(cat "$log") )) s"
      fi
    done
    ;;
  *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
