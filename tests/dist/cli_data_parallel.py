#!/usr/bin/env python3
"""megatrain-train launched as several processes by mpirun, on the CPU backend (issue 19;
docs/distributed.md).

    cli_data_parallel.py MPIRUN TRAIN_BINARY WORK_DIR SCENARIO

Scenarios (each a CTest test):
  same_run    one process, 2 and 3 processes (and 2 with micro-batches, and 2 without ZeRO-1) train
              the same global batch: every loss, gradient norm and validation loss equal to
              rounding (rel 1e-5);
              the first process alone writes the run folder (one metrics line a step).
  other_n     a checkpoint saved by 2 processes resumed by 1, and one saved by 1 resumed by 3: the
              steps after it equal the uninterrupted run's to rounding; the --export of 2
              processes equals one process's to rounding.
  signal      SIGTERM to mpirun mid-run: every process stops after the same step and the first
              saves it; resumed by 2 processes, the run ends with the metrics of an uninterrupted
              2-process run, bit for bit.
  threads     --gpus N on the cpu backend: the ranks as threads of one process, the same run as N
              processes and as one; resumed on 1, 2 and 3 ranks; SIGTERM; killed in a save.
  refusals    a global batch the processes do not divide, no whole gradient to sum (--clip 0),
              --share-weights where nothing can be shared, --gather-weights where nothing is gathered,
              evaluation only; one process failing its checks stops the
              others, which name it; torchrun's variables on the CPU backend (no MPI there).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

MPIRUN, TRAIN, WORK, SCENARIO = sys.argv[1:5]
SHAPE = ["--backend", "cpu", "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1",
         "--intermediate", "64", "--seq", "16", "--batch", "6", "--eval-every", "2", "--eval-batches", "1",
         "--lr", "3e-3"]
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)


def fail(msg):
    print("FAILED: " + msg)
    sys.exit(1)


def launch(n, args, env=None, check=True):
    cmd = ([TRAIN] if n == 1 else [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(n), TRAIN]) + args
    r = subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        fail(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def metrics(run):
    with open(os.path.join(WORK, run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def same(a, b, rel, what):
    """Every step's loss, gradient norm and validation loss of metrics a and b, within rel."""
    if [m["step"] for m in a] != [m["step"] for m in b]:
        fail(f"{what}: steps {[m['step'] for m in a]} vs {[m['step'] for m in b]}")
    worst = 0.0
    for x, y in zip(a, b):
        for k in ("loss", "grad_norm", "val_loss", "tokens"):
            if (k in x) != (k in y):
                fail(f"{what}: step {x['step']} has {k} in one run only")
            if k in x:
                d = abs(x[k] - y[k]) / abs(y[k])
                worst = max(worst, d)
                if d > rel:
                    fail(f"{what}: step {x['step']} {k} {x[k]!r} vs {y[k]!r} (rel {d:.2e} > {rel})")
    print(f"{what}: {len(a)} steps, largest relative difference {worst:.2e}")


def tensors(folder):
    """The float32 tensors of an exported folder's model.safetensors, as {name: [values]}."""
    import struct
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            fail(f"exported tensor {name} is {t['dtype']}, not F32")
        a, b = t["data_offsets"]
        out[name] = struct.unpack(f"<{(b - a) // 4}f", data[a:b])
    return out


def without(option):
    """SHAPE less `option` and its value (an option may be given once)."""
    i = SHAPE.index(option)
    return SHAPE[:i] + SHAPE[i + 2:]


def run_dir(name):
    p = os.path.join(WORK, name)
    shutil.rmtree(p, ignore_errors=True)
    return p


os.makedirs(WORK, exist_ok=True)

if SCENARIO == "same_run":
    launch(1, SHAPE + ["--steps", "4", "--out", run_dir("one")])
    one = metrics("one")
    for n, extra in ((2, []), (3, []), (2, ["--micro-batches", "2"]), (2, ["--micro-batches", "6"]),
                     (2, ["--shard-optimizer", "false"]), (2, ["--gradients", "host"]),
                     (3, ["--micro-batches", "3", "--gradients", "host"])):
        name = f"n{n}" + "".join(extra).replace("--micro-batches", "_m").replace("--", "_")
        r = launch(n, SHAPE + ["--steps", "4", "--out", run_dir(name)] + extra)
        if f"data parallel: {n} processes (openmpi)" not in r.stdout:
            fail(f"{name}: the plan does not say how the processes share the batch:\n{r.stdout}")
        m = metrics(name)
        if len(m) != 4:
            fail(f"{name}: {len(m)} metrics lines for 4 steps (only the first process writes them)")
        same(m, one, 1e-5, f"{n} processes {' '.join(extra)} vs one")
    # A warning says which process it comes from (pinning refused in every process: a test hook).
    r = launch(2, SHAPE + ["--steps", "1", "--out", run_dir("warned")], env=dict(ENV, MEGATRAIN_FAULTS="fail@pin"))
    for rank in (0, 1):
        if f"megatrain-train (process {rank} of 2): warning: pinning" not in r.stderr:
            fail(f"process {rank}'s warning does not name it:\n{r.stderr}")
elif SCENARIO == "other_n":
    export = ["--export-dtype", "f32"]
    launch(1, SHAPE + ["--steps", "4", "--save-every", "2", "--out", run_dir("one"), "--export", run_dir("one_hf")] + export)
    one = metrics("one")
    launch(2, SHAPE + ["--steps", "4", "--save-every", "2", "--out", run_dir("two"), "--export", run_dir("two_hf")] + export)
    # (ZeRO-1: the whole state gathered on the first process, which exports it)
    a, b = tensors(os.path.join(WORK, "two_hf")), tensors(os.path.join(WORK, "one_hf"))
    if a.keys() != b.keys():
        fail(f"the two exports hold other tensors: {sorted(a)} vs {sorted(b)}")
    worst = max(max(abs(x - y) for x, y in zip(a[k], b[k])) / max(1e-30, max(abs(y) for y in b[k])) for k in a)
    if worst > 1e-4:
        fail(f"exported by 2 processes and by 1: the weights differ by {worst:.2e} of their largest")
    print(f"exported by 2 processes and by 1: {len(a)} tensors within {worst:.2e} of their largest")
    ckpt = os.path.join(WORK, "two", "checkpoints", "step-00000002")
    # (every process wrote its part: a tensor the two parts divide is there in pieces)
    with open(os.path.join(ckpt, "train-state.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    if not any("@" in n for n in names):
        fail(f"the checkpoint of 2 processes holds no piece of a tensor that their parts divide: {sorted(names)}")
    r = launch(1, ["--resume", ckpt, "--out", run_dir("two_then_one"), "--steps", "4"])
    if "1 process(es) (checkpoint: 2)" not in r.stdout:
        fail(f"the resume does not say that the number of processes changed:\n{r.stdout}")
    same([m for m in metrics("two_then_one") if m["step"] > 2], one[2:], 1e-5, "saved by 2, resumed by 1")
    launch(3, ["--resume", ckpt, "--out", run_dir("two_then_three"), "--steps", "4"])
    same([m for m in metrics("two_then_three") if m["step"] > 2], one[2:], 1e-5, "saved by 2, resumed by 3")
    ckpt = os.path.join(WORK, "one", "checkpoints", "step-00000002")
    launch(3, ["--resume", ckpt, "--out", run_dir("one_then_three"), "--steps", "4"])
    same([m for m in metrics("one_then_three") if m["step"] > 2], one[2:], 1e-5, "saved by 1, resumed by 3")
elif SCENARIO == "signal":
    args = without("--eval-every") + ["--steps", "40", "--eval-every", "0"]
    launch(2, args + ["--out", run_dir("whole")])
    env = dict(ENV, MEGATRAIN_FAULTS="delay@train:step=100000")
    cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2", TRAIN] + args + ["--out", run_dir("cut")]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    saved = sorted(d for d in os.listdir(os.path.join(WORK, "cut", "checkpoints")) if d.startswith("step-"))
    if len(saved) != 1:
        fail(f"expected the one checkpoint the signal asked for, found {saved}:\n{out}\n{err}")
    step = int(saved[0][5:])
    if not 0 < step < 40 or "stopped by SIGTERM after step %d of 40" % step not in err:
        fail(f"the run did not stop after step {step} saying so:\n{out}\n{err}")
    if len(metrics("cut")) != step:
        fail(f"metrics.jsonl has {len(metrics('cut'))} lines, the checkpoint is step {step}")
    launch(2, ["--resume", "--out", os.path.join(WORK, "cut")] + ["--steps", "40"])
    same(metrics("cut"), metrics("whole"), 0.0, f"stopped after step {step} by SIGTERM and resumed")
elif SCENARIO == "crash_in_save":
    # Every process writes its part of a checkpoint; process 1 is killed once it has written its
    # part of the second one (step 4): the run stops, step 2 stays the newest complete checkpoint,
    # and the run resumed from it ends as the run that was never interrupted, bit for bit.
    args = SHAPE + ["--steps", "6", "--save-every", "2"]
    launch(2, args + ["--out", run_dir("whole")])
    env = dict(ENV, MEGATRAIN_FAULTS="crash@checkpoint:part:1#2")
    r = launch(2, args + ["--out", run_dir("cut")], env=env, check=False)
    ckpts = os.path.join(WORK, "cut", "checkpoints")
    saved = sorted(d for d in os.listdir(ckpts) if d.startswith("step-") and "." not in d)
    if r.returncode == 0 or "killed at checkpoint:part:1" not in r.stderr or saved != ["step-00000002"]:
        fail(f"process 1 killed in the save of step 4: status {r.returncode}, checkpoints {saved}:\n{r.stdout}\n{r.stderr}")
    if open(os.path.join(ckpts, "latest")).read().strip() != "step-00000002":
        fail("`latest` does not name step 2, the newest complete checkpoint")
    print(f"killed in a save: {saved} complete, left behind {sorted(os.listdir(ckpts))}")
    launch(2, ["--resume", "--out", os.path.join(WORK, "cut")])
    same(metrics("cut"), metrics("whole"), 0.0, "process 1 killed in a save, resumed from the step before")
    left = [d for d in os.listdir(ckpts) if ".partial-" in d]
    if left:
        fail(f"the resumed run left what the killed save wrote: {left}")
    # Without --out, every process writes its part into the first process's default folder.
    home = run_dir("default_out")
    os.makedirs(home)
    cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2", TRAIN] + SHAPE + ["--steps", "2", "--save-every", "2"]
    r = subprocess.run(cmd, env=ENV, cwd=home, capture_output=True, text=True, timeout=300)
    runs = os.listdir(os.path.join(home, "runs")) if os.path.isdir(os.path.join(home, "runs")) else []
    if r.returncode != 0 or len(runs) != 1 or \
            not os.path.isdir(os.path.join(home, "runs", runs[0], "checkpoints", "step-00000002")):
        fail(f"2 processes without --out: status {r.returncode}, run folders {runs}:\n{r.stdout}\n{r.stderr}")
    print(f"without --out: one run folder, runs/{runs[0]}, with the checkpoint of both processes")
    # An export killed halfway: the first process (which writes it, the state gathered from both)
    # dies before the new folder takes the old one's place. The run stops, the export that was
    # there is intact; the next export replaces it whole and leaves nothing behind.
    exp = os.path.join(WORK, "exported")
    shutil.rmtree(exp, ignore_errors=True)
    f32 = ["--export", exp, "--export-dtype", "f32"]
    launch(2, SHAPE + ["--steps", "2", "--save-every", "2", "--out", run_dir("exp")] + f32)
    before = tensors(exp)
    resume = ["--resume", "--out", os.path.join(WORK, "exp"), "--steps", "4"] + f32
    r = launch(2, resume, env=dict(ENV, MEGATRAIN_FAULTS="crash@export:before-rename"), check=False)
    if r.returncode == 0 or "killed at export:before-rename" not in r.stderr:
        fail(f"process 0 killed in the export: status {r.returncode}:\n{r.stdout}\n{r.stderr}")
    if tensors(exp) != before:
        fail("an export killed halfway changed the export that was there")
    # (the step-4 checkpoint was saved before the export began: the next run trains on from it)
    launch(2, resume[:-len(f32) - 1] + ["6"] + f32)
    after = tensors(exp)
    if sorted(after) != sorted(before) or after == before:
        fail("the export after the interrupted one did not replace it with the trained weights")
    left = [d for d in os.listdir(WORK) if d.startswith("exported") and d != "exported"]
    if left:
        fail(f"the exports left behind {left}")
    print("an export killed halfway: the previous export intact, the next one whole, nothing left behind")
elif SCENARIO == "refusals":
    def refused(n, args, expect, env=None):
        r = launch(n, args, env=env, check=False)
        if r.returncode == 0 or expect not in r.stderr:
            fail(f"expected a refusal saying '{expect}', got status {r.returncode}:\n{r.stdout}\n{r.stderr}")
        print(f"refused: {expect}")
        return r
    refused(2, without("--batch") + ["--batch", "5", "--out", run_dir("r")],
            "--batch 5 (the global batch) must be a multiple of the 2 processes")
    refused(2, SHAPE + ["--clip", "0", "--out", run_dir("r")], "2 processes sum the whole gradient of each step")
    refused(2, SHAPE + ["--micro-batches", "3", "--out", run_dir("r")], "--micro-batches 3 (the passes of the global batch)")
    refused(2, SHAPE + ["--steps", "0"], "--steps 0 (evaluate or export) runs in one process")
    refused(1, SHAPE + ["--shard-optimizer", "false", "--out", run_dir("r")], "--shard-optimizer applies to several processes")
    refused(1, SHAPE + ["--gpus", "all", "--out", run_dir("r")], "--gpus all with the cpu backend: it runs N ranks")
    refused(1, SHAPE + ["--gpus", "2", "--gpu-ranks", "processes", "--out", run_dir("r")],
            "--gpus 2 --gpu-ranks processes with the cpu backend")
    refused(1, SHAPE + ["--gpus", "2", "--steps", "0"], "--steps 0 (evaluate or export) runs on one GPU: drop --gpus 2")
    refused(1, SHAPE + ["--gpu-ranks", "threads", "--out", run_dir("r")], "--gpu-ranks applies with --gpus N")
    r = refused(1, without("--batch") + ["--batch", "5", "--gpus", "2", "--out", run_dir("r")],
                "--batch 5 (the global batch) must be a multiple of the 2 GPUs (--gpus)")
    if r.stderr.count("must be a multiple") != 1:
        fail(f"the ranks of one process printed the same error more than once:\n{r.stderr}")
    refused(2, SHAPE + ["--gpus", "2", "--out", run_dir("r")], "--gpus 2: this is process")
    refused(1, SHAPE + ["--share-weights", "true", "--out", run_dir("r")], "--share-weights applies to several processes")
    refused(2, SHAPE + ["--share-weights", "true", "--out", run_dir("r")],
            "--share-weights true shares the bf16 weights of GPU processes; the cpu backend streams none")
    refused(2, SHAPE + ["--share-weights", "true", "--shard-optimizer", "false", "--out", run_dir("r")],
            "--share-weights true shares the weights of processes that each step 1/N of them: it needs --shard-optimizer")
    refused(1, SHAPE + ["--gather-weights", "host", "--out", run_dir("r")], "--gather-weights applies to several processes")
    refused(2, SHAPE + ["--gather-weights", "host", "--out", run_dir("r")],
            "--gather-weights applies where GPU processes with --shard-optimizer each keep their own bf16 copy "
            "(--share-weights false, or processes on several hosts); the cpu backend streams no bf16 weights: drop it")
    # One process fails its checks (too little host memory for it alone): the other stops too, naming it.
    cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "1", TRAIN] + SHAPE + ["--out", run_dir("r"), ":",
           "-np", "1", "-x", "MEGATRAIN_HOST_MEMORY=100K", TRAIN] + SHAPE + ["--out", run_dir("r")]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    if r.returncode == 0 or "(process 1 of 2): error: this configuration does not fit" not in r.stderr or \
            "(process 0 of 2): error: process(es) 1 of 2 stopped before training" not in r.stderr:
        fail(f"a process failing its checks did not stop the run, named:\n{r.stdout}\n{r.stderr}")
    if os.path.exists(os.path.join(WORK, "r", "metrics.jsonl")):
        fail("the run folder was written although a process had failed")
    print("refused: a process that failed its checks stops every process, named")
    # torchrun's variables on the CPU backend: no MPI to train over.
    env = dict(ENV, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    refused(1, SHAPE + ["--out", run_dir("r")], "on the cpu backend, which trains several processes over MPI", env=env)
    env = dict(ENV, RANK="one", WORLD_SIZE="2")
    refused(1, SHAPE + ["--out", run_dir("r")], "environment variable RANK is 'one'", env=env)
elif SCENARIO == "threads":
    # --gpus N: the ranks as threads of one process (on the cpu backend, as on GPUs): the same run
    # as N processes under mpirun, and as one process, to rounding; its checkpoints resume on any
    # number of ranks; a stop signal stops every rank after the same step; a kill in a save leaves
    # the previous checkpoint complete.
    launch(1, SHAPE + ["--steps", "4", "--save-every", "2", "--out", run_dir("one")])
    one = metrics("one")
    launch(2, SHAPE + ["--steps", "4", "--out", run_dir("mpi2")])
    for n, extra in ((2, []), (3, []), (2, ["--micro-batches", "2"]), (2, ["--shard-optimizer", "false"]),
                     (3, ["--gradients", "host"])):
        name = f"t{n}" + "".join(extra).replace("--", "_")
        r = launch(1, SHAPE + ["--steps", "4", "--save-every", "2", "--gpus", str(n), "--out", run_dir(name)] + extra)
        if f"data parallel: {n} GPUs driven by this process, a rank each (--gpus)" not in r.stdout:
            fail(f"{name}: the plan does not say how the ranks share the batch:\n{r.stdout}")
        if r.stdout.count("megatrain-train: ") != 1:
            fail(f"{name}: more than the first rank printed:\n{r.stdout}")
        if len(metrics(name)) != 4:
            fail(f"{name}: {len(metrics(name))} metrics lines for 4 steps (only the first rank writes them)")
        same(metrics(name), one, 1e-5, f"{n} ranks in one process {' '.join(extra)} vs one")
    same(metrics("t2"), metrics("mpi2"), 0.0, "2 ranks in one process vs 2 processes under mpirun")
    ckpt = os.path.join(WORK, "t2", "checkpoints", "step-00000002")
    launch(1, ["--resume", ckpt, "--out", run_dir("t2_then_one"), "--steps", "4"])
    same([m for m in metrics("t2_then_one") if m["step"] > 2], one[2:], 1e-5, "saved by 2 ranks, resumed by 1")
    launch(1, ["--resume", ckpt, "--out", run_dir("t2_then_t3"), "--steps", "4", "--gpus", "3"])
    same([m for m in metrics("t2_then_t3") if m["step"] > 2], one[2:], 1e-5, "saved by 2 ranks, resumed by 3")
    launch(1, ["--resume", ckpt, "--out", run_dir("t2_again"), "--steps", "4", "--gpus", "2"])
    same([m for m in metrics("t2_again") if m["step"] > 2], metrics("t2")[2:], 0.0, "saved by 2 ranks, resumed by 2")
    ckpt = os.path.join(WORK, "one", "checkpoints", "step-00000002")
    launch(1, ["--resume", ckpt, "--out", run_dir("one_then_t2"), "--steps", "4", "--gpus", "2"])
    same([m for m in metrics("one_then_t2") if m["step"] > 2], one[2:], 1e-5, "saved by 1, resumed by 2 ranks")
    # SIGTERM mid-run: every rank stops after the same step, the first saves it, status 143.
    args = without("--eval-every") + ["--steps", "40", "--eval-every", "0", "--gpus", "2"]
    launch(1, args + ["--out", run_dir("whole")])
    env = dict(ENV, MEGATRAIN_FAULTS="delay@train:step=100000")
    p = subprocess.Popen([TRAIN] + args + ["--out", run_dir("cut")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    saved = sorted(d for d in os.listdir(os.path.join(WORK, "cut", "checkpoints")) if d.startswith("step-"))
    if p.returncode != 143 or len(saved) != 1:
        fail(f"status {p.returncode} (143 expected), checkpoints {saved} (the one the signal asked for):\n{out}\n{err}")
    step = int(saved[0][5:])
    if not 0 < step < 40 or "stopped by SIGTERM after step %d of 40" % step not in err:
        fail(f"the run did not stop after step {step} saying so:\n{out}\n{err}")
    launch(1, ["--resume", "--out", os.path.join(WORK, "cut"), "--steps", "40", "--gpus", "2"])
    same(metrics("cut"), metrics("whole"), 0.0, f"2 ranks stopped after step {step} by SIGTERM and resumed")
    # The process killed once rank 1 has written its part of the second checkpoint: step 2 stays
    # the newest complete one, and the run resumed from it ends as the uninterrupted run, bit for bit.
    args = SHAPE + ["--steps", "6", "--save-every", "2", "--gpus", "2"]
    launch(1, args + ["--out", run_dir("whole6")])
    r = launch(1, args + ["--out", run_dir("killed")], env=dict(ENV, MEGATRAIN_FAULTS="crash@checkpoint:part:1#2"),
               check=False)
    ckpts = os.path.join(WORK, "killed", "checkpoints")
    saved = sorted(d for d in os.listdir(ckpts) if d.startswith("step-") and "." not in d)
    if r.returncode == 0 or saved != ["step-00000002"]:
        fail(f"killed in the save of step 4: status {r.returncode}, checkpoints {saved}:\n{r.stdout}\n{r.stderr}")
    launch(1, ["--resume", "--out", os.path.join(WORK, "killed"), "--gpus", "2"])
    same(metrics("killed"), metrics("whole6"), 0.0, "killed in a save, resumed from the step before")
else:
    fail(f"unknown scenario {SCENARIO}")
print("passed")
