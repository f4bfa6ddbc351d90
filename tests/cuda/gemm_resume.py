"""megatrain-train on one GPU with tuned matrix products (--gemm-tuning, the default): a run
resumed from its checkpoint takes the checkpoint's cuBLASLt algorithms (train_state.json's
gemm_algorithms) and continues bit for bit; prints whether a second fresh run picked the same.
    python3 tests/cuda/gemm_resume.py --megatrain BIN/megatrain-train [--work DIR]
(docs/cuda.md#tuned-matrix-products; scripts/gpu_check.sh BIN OUT train runs it)"""
import argparse
import json
import os
import sys

import train_runs

p = argparse.ArgumentParser()
p.add_argument("--megatrain", required=True)
p.add_argument("--work", default="/tmp/mt-gemm-resume")
a = p.parse_args()
SHAPE = ["--hidden", "1024", "--layers", "4", "--heads", "8", "--kv-heads", "2", "--intermediate", "2816", "--seq", "512",
         "--batch", "16", "--eval-every", "0", "--lr", "1e-3", "--backend", "cuda", "--steps", "6"]


def run(args, name):
    return train_runs.run(a.megatrain, a.work, args, name)


os.makedirs(a.work, exist_ok=True)
first, _ = run(SHAPE + ["--save-every", "3"], "first")
again, _ = run(SHAPE, "again")
ckpt = os.path.join(a.work, "first", "checkpoints", "step-00000003")
with open(os.path.join(ckpt, "train_state.json")) as f:
    saved = json.load(f)["user"].get("gemm_algorithms", "")
if not saved.startswith("megatrain gemm algorithms"):
    sys.exit("FAILED: the checkpoint keeps no gemm_algorithms")
resumed, log = run(["--resume", ckpt], "resumed")
train_runs.same_bits_resumed(first, resumed, log, (4, 5, 6))
same_fresh = all(again[s]["loss"] == first[s]["loss"] for s in range(1, 7))
print(f"passed: {len(saved.splitlines()) - 1} shapes' algorithms in the checkpoint; steps 4-6 resumed bit for bit; "
      f"a second fresh run {'took the same bits' if same_fresh else 'differs in the last bits (other algorithms timed fastest)'}")
