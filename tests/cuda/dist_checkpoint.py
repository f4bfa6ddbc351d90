#!/usr/bin/env python3
"""megatrain-train on 2 GPUs (`--gpus 2`, ZeRO-1): every process writes its part of each checkpoint
into one folder (pieces where a tensor straddles the parts); resumed on 2 GPUs the run continues bit
for bit, on 1 GPU to bf16 rounding; its bf16 export (from the bf16 weights, nothing gathered) is one
process's export of the same state, byte for byte. Usage: dist_checkpoint.py MEGATRAIN_TRAIN WORK_DIR. Exits 77
(skipped) where fewer than 2 GPUs are visible."""
import json
import os
import shutil
import struct
import subprocess
import sys

TRAIN, WORK = sys.argv[1:3]
try:
    gpus = len([l for l in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
                if l.startswith("GPU ")])
except OSError:
    gpus = 0
if gpus < 2:
    print(f"skipped: {gpus} GPU(s) visible, 2 needed")
    sys.exit(77)

# (--gemm-tuning false: fresh runs compared bit for bit take the same cuBLASLt algorithms)
SHAPE = ["--hidden", "256", "--layers", "3", "--heads", "4", "--kv-heads", "2", "--intermediate", "704",
         "--seq", "128", "--batch", "8", "--eval-every", "0", "--lr", "1e-3", "--gemm-tuning", "false"]
ENV = dict(os.environ, NCCL_NVLS_ENABLE="0")


def fail(msg):
    print("FAILED: " + msg)
    sys.exit(1)


def run(args):
    r = subprocess.run([TRAIN] + args, env=ENV, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        fail(f"megatrain-train {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


def tensors(path):
    """{name: bytes} of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items() if k != "__metadata__"}


def out(name):
    p = os.path.join(WORK, name)
    shutil.rmtree(p, ignore_errors=True)
    return p


os.makedirs(WORK, exist_ok=True)
two = out("two")
two_hf = out("two_hf")
run(SHAPE + ["--gpus", "2", "--steps", "6", "--save-every", "3", "--out", two, "--export", two_hf])
ckpt = os.path.join(two, "checkpoints", "step-00000003")
with open(os.path.join(ckpt, "train-state.safetensors.index.json")) as f:
    names = json.load(f)["weight_map"]
pieces = [n for n in names if "@" in n]
if not pieces:
    fail(f"the checkpoint of 2 processes holds no piece: {sorted(names)}")
print(f"checkpoint of 2 processes: {len(names)} tensors, {len(pieces)} of them pieces, "
      f"{len(set(names.values()))} files")

# The bf16 export of the 2 processes (from the bf16 weights they hold, nothing gathered) is the one a
# single process writes from the last checkpoint's fp32 masters, byte for byte.
one_hf = out("one_hf")
run(["--resume", os.path.join(two, "checkpoints", "step-00000006"), "--steps", "0", "--eval-batches", "0",
     "--export", one_hf])
x, y = (tensors(os.path.join(d, "model.safetensors")) for d in (two_hf, one_hf))
differ = sorted(k for k in y if x.get(k) != y[k])
if differ or x.keys() != y.keys():
    fail(f"the bf16 export of 2 processes differs from one process's export of the same state in {len(differ)} of "
         f"{len(y)} tensors: {differ[:12]}")
print("the bf16 export of 2 processes: the same bytes as one process's from the checkpoint")

# Each process with its own bf16 copy (as on two hosts), kept current in its part only: each GPU
# uploads its part of every unit and gathers the rest from the other (--gather-weights gpus, the
# default); the same run bit for bit as one copy the processes share, and the same export bytes
# (the copy made whole before it is written).
parts, parts_hf = out("two_parts"), out("two_parts_hf")
run(SHAPE + ["--gpus", "2", "--steps", "6", "--share-weights", "false", "--out", parts, "--export", parts_hf])
p, shared = metrics(parts), metrics(two)
for s in range(1, 7):
    if p[s]["loss"] != shared[s]["loss"] or p[s]["grad_norm"] != shared[s]["grad_norm"]:
        fail(f"the weights gathered on the GPUs, step {s}: loss {p[s]['loss']!r} norm {p[s]['grad_norm']!r} vs "
             f"{shared[s]['loss']!r} {shared[s]['grad_norm']!r} with one shared copy (want the same bits)")
z = tensors(os.path.join(parts_hf, "model.safetensors"))
if z != x:
    fail("the export of a run whose weights were gathered on the GPUs differs from the shared copy's")
print("each process its own copy, the weights gathered on the GPUs: the same losses and export bytes as one shared copy")

# (the resumed runs below replay the run's options, --export included: it is compared first)
again = out("two_again")
run(["--gpus", "2", "--resume", ckpt, "--out", again])
one = out("one")
run(["--resume", ckpt, "--out", one])
a, b, c = metrics(two), metrics(again), metrics(one)
for s in (4, 5, 6):
    if b[s]["loss"] != a[s]["loss"] or b[s]["grad_norm"] != a[s]["grad_norm"]:
        fail(f"resumed on 2 GPUs, step {s}: loss {b[s]['loss']!r} norm {b[s]['grad_norm']!r} vs "
             f"{a[s]['loss']!r} {a[s]['grad_norm']!r} uninterrupted (want the same bits)")
    rel = abs(c[s]["loss"] - a[s]["loss"]) / abs(a[s]["loss"])
    if rel > 1e-2:
        fail(f"resumed on 1 GPU, step {s}: loss {c[s]['loss']!r} vs {a[s]['loss']!r} (rel {rel:.2e} > 1e-2)")
    print(f"step {s}: loss {a[s]['loss']:.6f} uninterrupted, the same bits resumed on 2 GPUs, "
          f"{c[s]['loss']:.6f} on 1 (rel {rel:.1e})")
print("passed")
