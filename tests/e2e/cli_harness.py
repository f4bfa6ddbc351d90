"""What the end-to-end tests of megatrain-train share: running it, reading a run folder, comparing
two runs bit for bit. A test script calls configure(TRAIN, WORK) first; every path is WORK's.
"""
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

TRAIN = WORK = None


def configure(train, work):
    global TRAIN, WORK
    TRAIN, WORK = train, work
SHAPE = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
         "--batch", "4", "--seq", "16", "--backend", "cpu"]
# Fields of metrics.jsonl that depend on the computation only (not on the clock).
EXACT_FIELDS = ("step", "loss", "lr", "grad_norm", "clip_coef", "tokens", "val_loss")


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def path(*parts):
    return os.path.join(WORK, *parts)


def env_with(**extra):
    env = dict(os.environ)
    env.pop("MEGATRAIN_FAULTS", None)
    env.update(extra)
    return env


def run(args, env=None, fsize=None, expect_rc=0, what="", program=None):
    """Runs megatrain-train (or `program`) to its end; returns (rc, stdout, stderr)."""
    def limit():
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    p = subprocess.run([program or TRAIN] + args, cwd=WORK, env=env or env_with(), capture_output=True, text=True,
                       errors="replace", preexec_fn=limit, timeout=600)
    if expect_rc is not None and p.returncode != expect_rc:
        fail(f"{what or ' '.join(args)}: exit status {p.returncode}, expected {expect_rc}\n"
             f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    return p.returncode, p.stdout, p.stderr


def start(args, env=None):
    return subprocess.Popen([TRAIN] + args, cwd=WORK, env=env or env_with(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def metrics(run_dir):
    rows = []
    with open(path(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            rows.append({k: m[k] for k in EXACT_FIELDS if k in m})
    return rows


def same_metrics(a, b, what):
    ma, mb = metrics(a), metrics(b)
    check([m["step"] for m in mb] == list(range(1, len(mb) + 1)),
          f"{what}: {b}/metrics.jsonl steps are not 1..{len(mb)} once each: {[m['step'] for m in mb]}")
    for x, y in zip(ma, mb):
        check(x == y, f"{what}: step {x['step']} differs:\n  {a}: {x}\n  {b}: {y}")
    check(len(ma) == len(mb), f"{what}: {a} has {len(ma)} steps, {b} has {len(mb)}")


def checkpoints(run_dir):
    d = path(run_dir, "checkpoints")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def tensor_digests(ckpt_dir):
    """The XXH3-128 digests of a checkpoint's safetensors shards (masters and both moments)."""
    out = {}
    with open(os.path.join(ckpt_dir, "checksums.xxh128")) as f:
        for line in f:
            digest, name = line.split(None, 1)
            name = name.strip()
            if name.endswith(".safetensors"):
                out[name] = digest
    check(out, f"{ckpt_dir}/checksums.xxh128 lists no safetensors file")
    return out


def same_state(a, b, step, what):
    da, db = (tensor_digests(path(r, "checkpoints", f"step-{step:08d}")) for r in (a, b))
    check(da == db, f"{what}: the train states of step {step} differ:\n  {a}: {da}\n  {b}: {db}")
    sa, sb = (json.load(open(path(r, "checkpoints", f"step-{step:08d}", "train_state.json"))) for r in (a, b))
    for k in ("step", "last_grad_norm", "data", "options"):
        check(sa.get(k) == sb.get(k), f"{what}: train_state.json '{k}' differs: {sa.get(k)} vs {sb.get(k)}")


def no_debris(run_dir):
    names = checkpoints(run_dir)
    bad = [n for n in names if re.search(r"\.(partial|old|trash)-[0-9a-f]{8}$", n) or ".partial-" in n]
    check(not bad, f"{run_dir}/checkpoints holds debris: {bad}")
    return names


def wait_for_lines(p, run_dir, n, what):
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with open(path(run_dir, "metrics.jsonl")) as f:
                if sum(1 for _ in f) >= n:
                    return
        except FileNotFoundError:
            pass
        if p.poll() is not None:
            fail(f"{what}: the run ended (status {p.returncode}) before step {n}:\n{p.stderr.read()[-3000:]}")
        time.sleep(0.01)
    fail(f"{what}: no step {n} within 120 s")


def fresh():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)


def main(scenarios, scenario):
    """Runs one scenario (a function) by name in a fresh WORK."""
    table = {f.__name__: f for f in scenarios}
    if scenario not in table:
        fail(f"unknown scenario '{scenario}' (one of {', '.join(table)})")
    fresh()
    table[scenario]()
    print(f"{scenario}: ok")
