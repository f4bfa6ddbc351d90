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
