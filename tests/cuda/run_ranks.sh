#!/usr/bin/env bash
# run_ranks.sh N PROGRAM [ARGS...]: runs N copies of PROGRAM as ranks 0 .. N-1 of one run, with
# torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
# MASTER_PORT a free port) and NVLink multicast off. Exits nonzero if a rank failed, 77 if the
# ranks skipped (and none failed), 0 otherwise.
set -uo pipefail
n=$1
shift
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for ((r = 0; r < n; ++r)); do
  RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port NCCL_NVLS_ENABLE=0 "$@" &
  pids+=($!)
done
rc=0
skipped=0
for p in "${pids[@]}"; do
  wait "$p"
  c=$?
  if [[ $c == 77 ]]; then skipped=1; elif [[ $c != 0 ]]; then rc=$c; fi
done
if [[ $rc != 0 ]]; then exit "$rc"; fi
if [[ $skipped == 1 ]]; then exit 77; fi
exit 0
