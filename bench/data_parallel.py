#!/usr/bin/env python3
"""megatrain-train on one GPU and as two processes on two GPUs (issue 19; docs/distributed.md).

    data_parallel.py --megatrain BIN/megatrain-train --work DIR [--preset qwen2.5-1.5b] [--seq 1024]
                     [--batch-per-gpu 32] [--steps 5]

1. The same run, one process and two (ranks launched as torchrun would, through
   tests/cuda/run_ranks.sh: NCCL, ZeRO-1): a small model on the built-in text; every step's loss
   must agree within 2e-3 (bf16 products, fp32 sums in another order); the two processes started
   as threads of one process (megatrain-train --gpus 2) and started by megatrain-train itself
   (--gpus 2 --gpu-ranks processes) must give the same bits as those torchrun's way.
2. Speed: --preset at --batch-per-gpu x --seq tokens per GPU on random tokens, exact clipping: one
   GPU, then two GPUs with twice the global batch, with ZeRO-1 (the default), without
   (--shard-optimizer false), and with ZeRO-1 but every unit's AdamW on the host (--device-units 0);
   then the peer, PyTorch FSDP2 with CPUOffloadPolicy on the same two GPUs and tokens per GPU
   (bench/peer_fsdp2.py; --no-peer skips it). Prints the tokens/s of each (the mean of the steps after the first
   two), the ratios to one GPU (the issue's goal: 1.9x on two H200s), and the most host memory each
   run took (the fall of MemAvailable while it ran) in bytes a parameter. --runs picks the runs
   (e.g. the 14B shape: --preset qwen2.5-14b --runs zero1,capped --no-same-run, the peer in a call
   of its own: --runs none).
Needs two GPUs.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--megatrain", required=True)
ap.add_argument("--work", required=True)
ap.add_argument("--preset", default="qwen2.5-1.5b")
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--batch-per-gpu", type=int, default=32)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--no-peer", action="store_true", help="skip the FSDP2 + CPU offload peer (bench/peer_fsdp2.py)")
ap.add_argument("--runs", default="one,zero1,one-process,replicated,host-adamw",
                help="the megatrain speed runs, of: one (one GPU), zero1 (the bf16 weights one copy the two processes "
                     "map: --share-weights auto), one-process (one process drives both GPUs: --gpus 2), unshared (a copy a process), replicated, host-adamw (two GPUs), capped "
                     "(two GPUs, ZeRO-1, as if on two hosts: a bf16 copy a process, --host-memory --host-memory-each "
                     "each; the weights gathered on the GPUs), capped-host (the same, the weights gathered through host memory after "
                     "each update: --gather-weights host), lean (ZeRO-1, --host-memory --lean-host-memory each); none: only the peer")
ap.add_argument("--host-memory-each", default="120G")
ap.add_argument("--lean-host-memory", default="99.5G", help="--host-memory of each process in the run 'lean'")
ap.add_argument("--no-same-run", action="store_true", help="skip part 1 (the small same-run checks)")
a = ap.parse_args()
os.makedirs(a.work, exist_ok=True)
ranks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cuda", "run_ranks.sh")
env = dict(os.environ, NCCL_NVLS_ENABLE="0")


def mem_available():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def watched(cmd, timeout):
    """Runs cmd; returns (its result, the most host memory it took: the fall of MemAvailable, every 0.2 s)."""
    import threading
    base, low, done = mem_available(), [mem_available()], threading.Event()

    def watch():
        while not done.wait(0.2):
            low[0] = min(low[0], mem_available())
    t = threading.Thread(target=watch)
    t.start()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        done.set()
        t.join()
    return r, base - low[0]


def run(n, args, name):
    out = os.path.join(a.work, name)
    cmd = ([a.megatrain] if n == 1 else ["bash", ranks, str(n), a.megatrain]) + args + ["--out", out, "--overwrite", "true"]
    t0 = time.time()
    r, peak = watched(cmd, 600)
    print(f"$ {' '.join(cmd)}\n  exit {r.returncode} in {time.time() - t0:.1f} s; host memory taken at most "
          f"{peak / 2**30:.2f} GiB (MemAvailable)", flush=True)
    run.peak = peak
    if r.returncode != 0:
        print(r.stdout[-4000:], r.stderr[-4000:], flush=True)
        sys.exit(1)
    for line in r.stdout.splitlines():
        if line.startswith(("plan:", "data parallel:", "step time:")):
            print("  " + line[:400], flush=True)
        if (found := re.match(r"megatrain-train: \S+, (\d+) parameters", line)):
            run.params = float(found.group(1))  # (what the bytes a parameter need)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# 1. the same run on one GPU and on two
ok = True
# (--gemm-tuning false: the fresh runs compared bit for bit take the same cuBLASLt algorithms)
small = ["--backend", "cuda", "--batch", "8", "--seq", "128", "--steps", "6", "--eval-every", "0", "--eval-batches", "1",
         "--gemm-tuning", "false"]
if not a.no_same_run:
    one = run(1, small, "small-one")
    two = run(2, small, "small-two")
    worst = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(two, one))
    print(f"same run: losses {[round(m['loss'], 5) for m in two]} on two GPUs, {[round(m['loss'], 5) for m in one]} on one; "
          f"largest relative difference {worst:.2e}", flush=True)
    ok = ok and len(one) == len(two) == 6 and worst <= 2e-3
    # ... and the same two ranks as threads of one process (--gpus 2), and as two processes started
    # by megatrain-train itself (--gpus 2 --gpu-ranks processes): the same bits
    for how, extra in (("--gpus 2 (one process)", []), ("--gpus 2 --gpu-ranks processes", ["--gpu-ranks", "processes"])):
        gpus = run(1, small + ["--gpus", "2"] + extra, "small-gpus" + "-".join(extra))
        same_bits = [m["loss"] for m in gpus] == [m["loss"] for m in two]
        print(f"{how}: losses {[round(m['loss'], 5) for m in gpus]}, "
              f"{'the same bits as' if same_bits else 'NOT the same as'} the two processes torchrun's way", flush=True)
        ok = ok and same_bits

# 2. speed
data = os.path.join(a.work, "tokens.bin")
if not os.path.exists(data):
    import numpy as np
    rng = np.random.default_rng(0)
    rng.integers(0, 151000, size=8_000_000, dtype=np.uint32).tofile(data)
common = ["--preset", a.preset, "--data", data, "--seq", str(a.seq), "--steps", str(a.steps), "--eval-every", "0",
          "--eval-batches", "1", "--val-fraction", "0.01", "--lr", "1e-5"]
rates, memory = {}, {}
run.params = None
RUNS = {"one": ("one GPU", 1, []), "zero1": ("two GPUs, ZeRO-1", 2, []),
        "one-process": ("two GPUs, one process (--gpus 2), ZeRO-1", 1, ["--gpus", "2"]),
        "replicated": ("two GPUs, replicated", 2, ["--shard-optimizer", "false"]),
        "host-adamw": ("two GPUs, ZeRO-1, AdamW on the host", 2, ["--device-units", "0"]),
        "unshared": ("two GPUs, ZeRO-1, a bf16 copy a process", 2, ["--share-weights", "false"]),
        "lean": (f"two GPUs, ZeRO-1, --host-memory {a.lean_host_memory} each (activation checkpoints kept off the host)", 2,
                 ["--host-memory", a.lean_host_memory]),
        # (as if on two hosts: a bf16 copy a process, and each process's memory capped)
        "capped": (f"two GPUs, ZeRO-1, as two hosts of --host-memory {a.host_memory_each}", 2,
                   ["--host-memory", a.host_memory_each, "--share-weights", "false"]),
        # (the same, the updated weights gathered through host memory after each update, as before)
        "capped-host": (f"two GPUs, ZeRO-1, as two hosts of --host-memory {a.host_memory_each}, weights gathered on the host",
                        2, ["--host-memory", a.host_memory_each, "--share-weights", "false", "--gather-weights", "host"])}
for key in [k for k in a.runs.split(",") if k and k != "none"]:
    name, n, extra = RUNS[key]
    gpus = 2 if "--gpus" in extra else n  # (one process driving two GPUs: twice the global batch too)
    m = run(n, common + ["--batch", str(a.batch_per_gpu * gpus)] + extra, f"speed-{key}")
    kept = m[2:] if len(m) > 2 else m
    rates[name] = sum(x["tokens"] for x in kept) / sum(x["step_time_s"] for x in kept)
    memory[name] = run.peak
    print(f"{name}: {rates[name]:.0f} tok/s (steps 3..{len(m)}: {[round(x['step_time_s'], 3) for x in kept]} s); "
          f"host memory taken at most {run.peak / 2**30:.2f} GiB"
          + (f" ({run.peak / run.params:.2f} bytes a parameter)" if getattr(run, "params", 0) else ""), flush=True)
if not a.no_peer:  # the several-GPU peer, the same tokens per GPU on the same two GPUs
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_fsdp2.py"), "--preset", a.preset,
           "--batch-per-gpu", str(a.batch_per_gpu), "--seq", str(a.seq), "--steps", str(a.steps), "--clip", "1.0"]
    r, peak = watched(cmd, 900)
    print(f"$ {' '.join(cmd)}\n  exit {r.returncode}; host memory taken at most {peak / 2**30:.2f} GiB (MemAvailable)",
          flush=True)
    lines = [l for l in r.stdout.splitlines() if l.startswith(("peer:", "{"))]
    print("\n".join("  " + l[:400] for l in lines) if lines else (r.stdout[-3000:] + r.stderr[-3000:]), flush=True)
    if r.returncode == 0 and lines and lines[-1].startswith("{"):
        rates["FSDP2 + CPU offload, two GPUs"] = json.loads(lines[-1])["peer_tokens_per_s"]
        memory["FSDP2 + CPU offload, two GPUs"] = peak
        run.params = json.loads(lines[-1]).get("parameters") or run.params
params = run.params
base = rates.get("one GPU")
per_param = (lambda k: f", {memory[k] / params:.2f} B/param on the host" if params and k in memory else "")
print(f"| {a.preset}, {a.batch_per_gpu} x {a.seq} tokens per GPU, exact clipping | " +
      " | ".join(f"{k} {v:.0f} tok/s" + (f" ({v / base:.2f}x)" if base else "") + per_param(k) for k, v in rates.items()) +
      f" | goal 1.9x | same run on 1 and 2: {'ok' if ok else 'FAILED' if not a.no_same_run else 'not run'} |" +
      "".join(f" megatrain {k} / FSDP2 offload: {v / peer:.2f}x |" for k, v in rates.items()
              if (peer := rates.get("FSDP2 + CPU offload, two GPUs")) and k.startswith("two GPUs")))
sys.exit(0 if ok else 1)
