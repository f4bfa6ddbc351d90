#!/usr/bin/env python3
"""Checkpoints of a run on several GPUs, written by every process (docs/distributed.md).

    python3 bench/dist_save.py --megatrain .devbuild/bin/megatrain-train --work /tmp/mt-save \\
        [--gpus 2] [-- megatrain-train options: the model and batch, e.g. --preset qwen2.5-1.5b --batch 64]

Trains 3 steps on --gpus processes (`megatrain-train --gpus N`) saving after steps 2 and 3 (each
save written while the next step trains, every process its part), prints each save's line (size,
seconds, what training waited for it) and the step times, then resumes from step 2 on the same
number of GPUs and checks that step 3 gives the same loss and gradient norm, bit for bit. Needs
twice the checkpoint's size on the disk of --work.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--megatrain", required=True)
ap.add_argument("--work", required=True)
ap.add_argument("--gpus", default="2")
ap.add_argument("rest", nargs="*", help="megatrain-train options after --")
a = ap.parse_args()
# (default: the Qwen2.5-14B shape cut to 6 layers, 3.2B parameters: a 36 GiB train state)
shape = a.rest or ["--hidden", "5120", "--layers", "6", "--heads", "40", "--kv-heads", "8", "--intermediate", "13824",
                   "--vocab", "152064", "--tie-embeddings", "false", "--seq", "1024", "--batch", "64"]
env = dict(os.environ, NCCL_NVLS_ENABLE="0")


def train(args, out):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [a.megatrain] + args + ["--out", out]
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(f"$ {' '.join(cmd)}\n  exit {r.returncode} in {time.time() - t0:.1f} s", flush=True)
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith(("saved step", "resumed from", "megatrain-train: warning")):
            print("  " + line, flush=True)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:])
        sys.exit(1)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


os.makedirs(a.work, exist_ok=True)
first = os.path.join(a.work, "run")
m = train(shape + ["--gpus", a.gpus, "--steps", "3", "--save-every", "2", "--keep", "2", "--eval-every", "0",
                   "--eval-batches", "1"], first)
print("step times: " + ", ".join(f"{s}: {m[s]['step_time_s']:.2f} s" for s in sorted(m)))
ckpt = os.path.join(first, "checkpoints", "step-00000002")
files = os.listdir(ckpt)
print(f"checkpoint of step 2: {len(files)} files, "
      f"{sum(os.path.getsize(os.path.join(ckpt, f)) for f in files) / 2**30:.2f} GiB")
shutil.rmtree(os.path.join(first, "checkpoints", "step-00000003"))  # (room on the disk for the resumed run's)
r = train(["--gpus", a.gpus, "--resume", ckpt, "--save-every", "0"], os.path.join(a.work, "resumed"))
same = r[3]["loss"] == m[3]["loss"] and r[3]["grad_norm"] == m[3]["grad_norm"]
print(f"| step 3 resumed from the checkpoint of step 2 on {a.gpus} GPUs | loss {r[3]['loss']!r} vs {m[3]['loss']!r}, "
      f"norm {r[3]['grad_norm']!r} vs {m[3]['grad_norm']!r} | {'the same bits' if same else 'DIFFERENT'} |")
sys.exit(0 if same else 1)
