#!/usr/bin/env bash
# killed_rank_nccl.sh PROGRAM: test_dist_train_cuda's ranks over NCCL, rank 1 gone after joining
# (issue 19; docs/distributed.md). 77 (skipped) with fewer than 2 GPUs.
#  1. killed by SIGKILL, the collective timeout an hour: rank 0's gradient sum on the GPU is aborted
#     by the watchdog within seconds (rank 1's beacon refused), and its next collective fails, each
#     saying so and naming rank 1 as ended.
#  2. alive but not joining the collectives (asleep for 20 s), the collective timeout 5 s: rank 0
#     stops at the timeout, saying that every other rank's process still answers.
#  3. failed in NCCL (a collective given host memory, refused with NCCL_CHECK_POINTERS=1), the
#     collective timeout an hour: rank 1 reports NCCL's error and ends; rank 0 stops as in 1.
set -uo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
log=$(mktemp)
start=$(date +%s)
MEGATRAIN_TEST_KILL_RANK=1 MEGATRAIN_COLLECTIVE_TIMEOUT=3600 timeout 60 bash "$dir/run_ranks.sh" 2 "$1" > "$log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$log"
if [[ $rc == 77 ]]; then rm -f "$log"; exit 77; fi
if [[ $rc == 124 ]]; then echo "FAILED: a rank was left waiting (still running after 60 s)"; exit 1; fi
if ! grep -q "rank 0 of 2: a collective on the GPUs (a gradient's sum, or a unit's weights gathered) waits for a rank that is gone; another rank stopped: rank 1 of 2: its process has ended (killed or failed)" "$log" ||
   ! grep -q "rank 0: stopped as it should: rank 0 of 2: an earlier collective failed or did not complete (another rank stopped: rank 1 of 2: its process has ended" "$log"; then
  echo "FAILED: rank 0 did not stop with the watchdog's and the collective's messages, naming rank 1 as ended"
  exit 1
fi
echo "killed: rank 0 stopped in ${elapsed} s"
start=$(date +%s)
MEGATRAIN_TEST_KILL_RANK=1 MEGATRAIN_TEST_STUCK_RANK=1 MEGATRAIN_COLLECTIVE_TIMEOUT=5 timeout 90 bash "$dir/run_ranks.sh" 2 "$1" > "$log" 2>&1
rc=$?
cat "$log"
if [[ $rc == 124 ]]; then echo "FAILED: a rank was left waiting (still running after 90 s)"; exit 1; fi
if ! grep -q "rank 0 of 2: a collective on the GPUs (a gradient's sum, or a unit's weights gathered) did not complete within 5 s; another rank stopped or is stuck; every other rank's process still answers" "$log" ||
   ! grep -q "rank 0: stopped as it should:" "$log"; then
  echo "FAILED: rank 0 did not stop at the collective timeout saying that rank 1 still answers"
  exit 1
fi
start=$(date +%s)
MEGATRAIN_TEST_KILL_RANK=1 MEGATRAIN_TEST_NCCL_ERROR=1 NCCL_CHECK_POINTERS=1 MEGATRAIN_COLLECTIVE_TIMEOUT=3600 \
  timeout 60 bash "$dir/run_ranks.sh" 2 "$1" > "$log" 2>&1
rc=$?
nccl_elapsed=$(( $(date +%s) - start ))
cat "$log"
if [[ $rc == 124 ]]; then echo "FAILED: a rank was left waiting after rank 1's NCCL error (still running after 60 s)"; exit 1; fi
if ! grep -q "rank 1: failed in NCCL: .*ncclAllReduce.*returned invalid argument" "$log" ||
   ! grep -q "rank 0 of 2: a collective on the GPUs (a gradient's sum, or a unit's weights gathered) waits for a rank that is gone; another rank stopped: rank 1 of 2: its process has ended (killed or failed)" "$log" ||
   ! grep -q "rank 0: stopped as it should: rank 0 of 2: an earlier collective failed or did not complete (another rank stopped: rank 1 of 2: its process has ended" "$log"; then
  echo "FAILED: rank 1 did not report NCCL's error, or rank 0 did not stop naming rank 1 as ended"
  exit 1
fi
rm -f "$log"
echo "stuck: rank 0 stopped at the collective timeout; killed: in ${elapsed} s; failed in NCCL: in ${nccl_elapsed} s"
