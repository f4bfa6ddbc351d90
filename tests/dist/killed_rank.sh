#!/usr/bin/env bash
# killed_rank.sh MPIRUN PROGRAM: rank 1 of 2 dies by SIGKILL before its second step, while rank 0
# waits in that step's first collective. The run must end within 60 s with a nonzero status and
# mpirun naming the killed process: no rank is left waiting (issue 19; docs/distributed.md).
set -uo pipefail
log=$(mktemp)
start=$(date +%s)
MEGATRAIN_TEST_KILL_RANK=1 timeout 60 "$1" --oversubscribe --bind-to none -np 2 "$2" -tc='*killed*' > "$log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$log"
if [[ $rc == 0 ]]; then echo "FAILED: the run ended with status 0 although rank 1 was killed"; exit 1; fi
if [[ $rc == 124 ]]; then echo "FAILED: the run did not stop within 60 s (a rank was left waiting)"; exit 1; fi
if ! grep -Eq "rank 1 .*exited on signal 9" "$log"; then echo "FAILED: mpirun did not name rank 1 as killed"; exit 1; fi
rm -f "$log"
echo "the run stopped in ${elapsed} s with status $rc"
