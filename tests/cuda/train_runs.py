"""What the GPU scripts of tests/cuda share: a megatrain-train run into a fresh folder."""
import json
import os
import shutil
import subprocess
import sys


def run(megatrain, work, args, name, timeout=300):
    """Runs `megatrain args --out work/name` (the folder emptied first); exits the script with its
    output when it fails. Returns (metrics.jsonl by step, stdout + stderr)."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run([megatrain] + args + ["--out", out], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"FAILED: megatrain-train {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}, r.stdout + r.stderr


def same_bits_resumed(first, resumed, log, steps):
    """Exits the script unless the resumed run's `steps` have the uninterrupted run's loss and
    gradient norm, to the bit, and its output says nothing of a change."""
    if "not bit for bit" in log:
        sys.exit(f"FAILED: the resumed run says it is not bit for bit:\n{log}")
    for s in steps:
        if (resumed[s]["loss"], resumed[s]["grad_norm"]) != (first[s]["loss"], first[s]["grad_norm"]):
            sys.exit(f"FAILED: step {s} resumed: loss {resumed[s]['loss']!r} norm {resumed[s]['grad_norm']!r}, "
                     f"uninterrupted {first[s]['loss']!r} {first[s]['grad_norm']!r} (want the same bits)")
