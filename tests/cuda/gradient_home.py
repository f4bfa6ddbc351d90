"""megatrain-train on one GPU, --gradients auto (the default; docs/planner.md#what-the-plan-decides):
where the GPU (capped by --gpu-memory) has no room for the waiting gradients but host memory
does, the plan puts them in host memory and the run trains; resumed with room on the GPU, the run
keeps its checkpoint's home (its micro-batches add up in the same order) and continues bit for
bit, while one told --gradients device, or given device units (whose micro-batches add up on the
GPU), says that its sums come in another order.
    python3 tests/cuda/gradient_home.py --megatrain BIN/megatrain-train [--work DIR]
(scripts/gpu_check.sh BIN OUT train runs it)"""
import argparse
import os
import sys

import train_runs

p = argparse.ArgumentParser()
p.add_argument("--megatrain", required=True)
p.add_argument("--work", default="/tmp/mt-gradient-home")
a = p.parse_args()
# (16 blocks of 12.6M parameters: their fp32 gradients, 0.69 GB, fit a GPU capped at 850M only in
# host memory, as megatrain-plan --gpu-memory 850M --backend cuda says of this shape; with 16G the
# plan alone would keep them on the GPU. No device units: their count, which the GPU's memory
# decides, would change the bits of micro-batches added up in host memory.)
SHAPE = ["--hidden", "1024", "--layers", "16", "--heads", "8", "--kv-heads", "2", "--intermediate", "2816", "--seq", "512",
         "--batch", "16", "--micro-batches", "2", "--eval-every", "0", "--lr", "1e-3", "--schedule", "constant",
         "--backend", "cuda", "--steps", "6", "--gemm-tuning", "false", "--device-units", "0"]


def run(args, name):
    return train_runs.run(a.megatrain, a.work, args, name)


def says(log, text, what):
    if text not in log:
        sys.exit(f"FAILED: {what}: the run does not say '{text}':\n{log}")


os.makedirs(a.work, exist_ok=True)
first, log = run(SHAPE + ["--gpu-memory", "850M", "--save-every", "3"], "first")
says(log, "gradients wait for the norm in host memory (--gradients auto)", "a GPU of 850M")
ckpt = os.path.join(a.work, "first", "checkpoints", "step-00000003")
resumed, log = run(["--resume", ckpt, "--gpu-memory", "16G"], "resumed")
says(log, "gradients wait for the norm in host memory (--gradients auto)", "resumed with a GPU of 16G")
train_runs.same_bits_resumed(first, resumed, log, (4, 5, 6))
_, log = run(["--resume", ckpt, "--gpu-memory", "16G", "--gradients", "device"], "moved")
says(log, "micro-batches added up in GPU memory (checkpoint: host)", "resumed with --gradients device")
_, log = run(["--resume", ckpt, "--gpu-memory", "16G", "--device-units", "auto"], "with_units")
says(log, "with micro-batches added up in host memory", "resumed with device units")
_, log = run(SHAPE + ["--gpu-memory", "16G"], "roomy")
says(log, "gradients wait for the norm in GPU memory (--gradients auto)", "a fresh run on a GPU of 16G")
print("passed: a GPU of 850M: gradients in host memory (auto); resumed on 16G: kept there, steps 4-6 bit for bit; "
      "told --gradients device, or given device units: said; a fresh run on 16G: the GPU")
