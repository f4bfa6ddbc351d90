#!/usr/bin/env bash
# torchrun_launch.sh PYTHON TEST_BINARY: processes launched by torchrun itself (PyTorch's
# torch.distributed.run, whose agent keeps its own store on MASTER_PORT) meet through megatrain's
# rendezvous: 3 processes on one "host" (--standalone), then 2 "hosts" of 2 processes each
# (--nnodes 2 on 127.0.0.1, static rendezvous). Skipped (77) where torch is not importable.
set -uo pipefail
py=$1 bin=$2
"$py" -c "import torch.distributed.run" 2>/dev/null || { echo "SKIP: torch (torchrun) is not importable"; exit 77; }
export MEGATRAIN_TEST_LAUNCHED=1 OMP_NUM_THREADS=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
run() { timeout 120 "$py" -m torch.distributed.run "$@" --no-python "$bin" -tc='*own environment*' -s; }
log=$(mktemp -d)
run --standalone --nproc-per-node 3 > "$log/one" 2>&1
rc=$?
cat "$log/one"
[[ $rc == 0 ]] || { echo "FAILED: 3 processes under torchrun --standalone (status $rc)"; exit 1; }
[[ $(grep -c "met the others on" "$log/one") == 3 ]] || { echo "FAILED: not every process said it met the others"; exit 1; }
port=$(( 20000 + RANDOM % 20000 ))
for node in 0 1; do
  run --nnodes 2 --node-rank $node --nproc-per-node 2 --master-addr 127.0.0.1 --master-port $port > "$log/node$node" 2>&1 &
done
wait %1; rc0=$?
wait %2; rc1=$?
cat "$log/node0" "$log/node1"
[[ $rc0 == 0 && $rc1 == 0 ]] || { echo "FAILED: 2 torchrun 'hosts' of 2 processes (status $rc0, $rc1)"; exit 1; }
[[ $(cat "$log/node0" "$log/node1" | grep -c "met the others on") == 4 ]] || { echo "FAILED: not every process met"; exit 1; }
rm -rf "$log"
echo "torchrun: 3 processes on one host and 4 on two met through megatrain's rendezvous"
