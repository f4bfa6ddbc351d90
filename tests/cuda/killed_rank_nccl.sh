#!/usr/bin/env bash
# killed_rank_nccl.sh PROGRAM: test_dist_train_cuda's ranks over NCCL, rank 1 killed by SIGKILL after
# joining; rank 0's gradient sum on the GPU must be aborted by the watchdog within the collective
# timeout (5 s here), and its next collective then fail, each with a message that says so and names
# rank 1 as ended (its beacon refused), not wait forever (issue 19; docs/distributed.md). 77 (skipped) with fewer
# than 2 GPUs.
set -uo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
log=$(mktemp)
start=$(date +%s)
MEGATRAIN_TEST_KILL_RANK=1 MEGATRAIN_COLLECTIVE_TIMEOUT=5 timeout 60 bash "$dir/run_ranks.sh" 2 "$1" > "$log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$log"
if [[ $rc == 77 ]]; then rm -f "$log"; exit 77; fi
if [[ $rc == 124 ]]; then echo "FAILED: a rank was left waiting (still running after 60 s)"; exit 1; fi
if ! grep -q "rank 0 of 2: a collective on the GPUs (a gradient's sum, or a unit's weights gathered) did not complete within 5 s; another rank stopped: rank 1 of 2: its process has ended (killed or failed)" "$log" ||
   ! grep -q "rank 0: stopped as it should: rank 0 of 2: an earlier collective failed or did not complete (another rank stopped: rank 1 of 2: its process has ended" "$log"; then
  echo "FAILED: rank 0 did not stop with the watchdog's and the collective's messages, naming rank 1"
  exit 1
fi
rm -f "$log"
echo "rank 0 stopped in ${elapsed} s"
