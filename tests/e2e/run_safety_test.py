#!/usr/bin/env python3
"""A run's work is never lost or mixed: megatrain-train under ordinary accidents and mistakes
(docs/reliability.md, docs/checkpointing.md).

    run_safety_test.py TRAIN_BINARY WORK_DIR SCENARIO [REPORT_BINARY]

Scenarios (each a CTest test):
  lock            one process a run folder: a second run, and a second resume, are refused at
                  once naming the holder; a lock left by a killed process is taken over, saying so.
  overwrite       --overwrite replaces the whole previous run (its checkpoints too): a resume
                  after it continues the new run; the previous run is put back where the new one
                  fails before its first step; replacements that could lose inputs are refused.
  metrics_full    writes of metrics.jsonl fail (a full disk, by the fault hook): the run stops
                  with the step's train state saved, the lines not written kept with it; resumed,
                  the metrics equal an uninterrupted run's, every step once; with
                  --on-metrics-error continue the lines wait until there is room again.
  tmpfs_full      the same on a real full disk (a small tmpfs; skipped where mounting is not
                  allowed): exit 1, no torn line, the report made.
  export_failure  a failed final export (--save-every 0) leaves the train state saved and says
                  how to export again; that command writes the export an uninterrupted run would.
  branch_export   a run resumed into another folder does not export over the original's export,
                  which nobody else may replace either.
  damaged_newest  a damaged newest checkpoint is named and the newest intact one taken; asked
                  for by name, it is refused, naming the intact ones.
  small_ones      the smaller items: the save's stall, bare boolean flags, --out naming a file or
                  nothing, --resume of a missing folder, --help and --version, one host-memory
                  figure, invalid UTF-8 in JSON records, an export of a --model-config and
                  --tokenizer run (tokenizer files, token ids).
  early_signal    SIGTERM before training starts: exit 143 saying so, nothing left behind.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import (SHAPE, check, checkpoints, configure, env_with, fail, main, metrics, no_debris, path, run,  # noqa: E402
                         same_metrics, start, wait_for_lines)

TRAIN, WORK, SCENARIO = sys.argv[1], sys.argv[2], sys.argv[3]
REPORT = sys.argv[4] if len(sys.argv) > 4 else None
configure(TRAIN, WORK)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def listing(d):
    return sorted(os.listdir(path(d))) if os.path.isdir(path(d)) else []


def md5(p):
    import hashlib
    return hashlib.md5(open(path(p), "rb").read()).hexdigest()


def steps_of(run_dir):
    return [m["step"] for m in metrics(run_dir)]


# ---- scenarios --------------------------------------------------------------------------------------


def lock():
    slow = env_with(MEGATRAIN_FAULTS="delay@train:step=100000")
    p = start(SHAPE + ["--steps", "200", "--save-every", "2", "--out", "dup"], slow)
    wait_for_lines(p, "dup", 3, "the first run")
    holder = json.load(open(path("dup", "run.lock")))
    check(holder["pid"] == p.pid and holder["program"] == "megatrain-train", f"run.lock names {holder}, not process {p.pid}")
    for args, what in ((SHAPE + ["--steps", "300", "--seed", "2", "--out", "dup"], "a second run"),
                       (["--resume", "--out", "dup", "--steps", "300"], "a resume while it runs")):
        t0 = time.time()
        _, out, err = run(args, expect_rc=1, what=what)
        check(f"the run folder 'dup' is in use by process {p.pid} on host" in err and "megatrain-train" in err,
              f"{what}: not refused naming the holder:\n{err}")
        check(time.time() - t0 < 30, f"{what}: refused only after {time.time() - t0:.0f} s")
    # Nothing of the refused runs went in: the metrics are the first run's, every step once.
    p.send_signal(signal.SIGKILL)
    p.wait()
    got = steps_of("dup")
    check(got == list(range(1, len(got) + 1)), f"metrics.jsonl of the first run holds steps {got}")
    # The killed process's lock is taken over, with a word; the run continues.
    _, out, err = run(["--resume", "--out", "dup", "--steps", str(len(got) + 4)], what="the resume after the kill")
    check(re.search(rf"took over the run folder's lock from process {p.pid} on host \S+ \(megatrain-train, since ", out + err),
          f"the resume did not say it took over the dead process's lock:\n{out}\n{err}")
    check(open(path("dup", "run.lock")).read() == "", "run.lock still names a holder after a clean end")


def overwrite():
    # A run with checkpoints at 6 and 7 and an export; then a fresh run over it with a bare --overwrite.
    run(SHAPE + ["--steps", "7", "--save-every", "1", "--keep", "2", "--out", "run", "--export", "exp"], what="the first run")
    old_export = md5("exp/model.safetensors")
    _, out, _ = run(SHAPE + ["--steps", "3", "--save-every", "3", "--schedule", "constant", "--eval-every", "3", "--out", "run",
                             "--overwrite"],
                    what="--overwrite")
    check("--overwrite: removed the previous run" in out, f"--overwrite did not say it removed the previous run:\n{out}")
    check(checkpoints("run") == ["latest", "step-00000003"], f"checkpoints after --overwrite: {checkpoints('run')}")
    check(not any(".replaced-" in n for n in os.listdir(WORK)), f"the previous run is still beside it: {os.listdir(WORK)}")
    # A resume continues the new run (steps 1..5), not the old one (603/604 in the report of the bug).
    run(["--resume", "--out", "run", "--steps", "5"], what="the resume after --overwrite")
    check(steps_of("run") == [1, 2, 3, 4, 5], f"metrics after --overwrite and a resume: {steps_of('run')}")
    check(md5("exp/model.safetensors") == old_export, "the new run wrote into the old run's export")
    run(SHAPE + ["--steps", "5", "--schedule", "constant", "--eval-every", "3", "--out", "straight"],
        what="the uninterrupted run")
    same_metrics("straight", "run", "--overwrite then a resume vs a fresh run")
    # A new run that fails before its first step puts the previous run back, whole.
    before = sorted(os.listdir(path("run"))), open(path("run", "metrics.jsonl")).read()
    _, _, err = run(SHAPE + ["--steps", "3", "--out", "run", "--overwrite", "true", "--data", "missing.bin", "--vocab", "300"],
                    expect_rc=1, what="a failing --overwrite")
    check("missing.bin" in err, f"the failing run's error does not name its data:\n{err}")
    check((sorted(os.listdir(path("run"))), open(path("run", "metrics.jsonl")).read()) == before,
          "a run that failed before its first step did not put the previous run back as it was")
    check(not any(".replaced-" in n for n in os.listdir(WORK)), f"debris of the failed --overwrite: {os.listdir(WORK)}")
    # Replacements that could lose what the user has are refused before anything moves.
    with open(path("run", "data.txt"), "w") as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 200)
    before = sorted(os.listdir(path("run"))), open(path("run", "metrics.jsonl")).read()
    _, _, err = run(SHAPE + ["--steps", "2", "--out", "run", "--overwrite", "--data", "run/data.txt"], expect_rc=1,
                    what="--overwrite of the folder holding the data")
    check("--overwrite would move aside" in err and "data.txt" in err, f"not refused for its data:\n{err}")
    os.symlink("run", path("link"))
    _, _, err = run(SHAPE + ["--steps", "2", "--out", "link", "--overwrite"], expect_rc=1, what="--overwrite of a link")
    check("is a symbolic link" in err, f"--overwrite of a symbolic link not refused:\n{err}")
    os.makedirs(path("notarun"))
    with open(path("notarun", "mine.txt"), "w") as f:
        f.write("keep me")
    run(SHAPE + ["--steps", "1", "--out", "notarun", "--overwrite"], what="--overwrite of a folder that holds no run")
    check(open(path("notarun", "mine.txt")).read() == "keep me", "--overwrite of a folder without a run removed its files")
    check((sorted(os.listdir(path("run"))), open(path("run", "metrics.jsonl")).read()) == before,
          "a refused --overwrite changed the run")


def metrics_full():
    base = SHAPE + ["--steps", "8", "--eval-every", "4"]
    run(base + ["--out", "straight"], what="the uninterrupted run")
    # The 5th line cannot be written: the run stops there, its train state saved with that line.
    _, out, err = run(base + ["--out", "run"], env=env_with(MEGATRAIN_FAULTS="fail@write:metrics#5=ENOSPC"), expect_rc=1,
                      what="metrics on a full disk")
    check(re.search(r"the metrics of step 5 could not be written: cannot write '[^']*metrics.jsonl': No space left on device\. "
                    r"The run stops \(--on-metrics-error stop\)\. The train state of step 5 is saved in \S+step-00000005\. "
                    r"The metrics not written are kept with it: make room, then resume with: megatrain-train --resume --out run",
                    err), f"no clear stop for the metrics:\n{err}")
    check(steps_of("run") == [1, 2, 3, 4], f"metrics.jsonl after the failure holds {steps_of('run')} (a torn line?)")
    check(open(path("run", "metrics.jsonl")).read().endswith("\n"), "metrics.jsonl ends in a torn line")
    run(["--resume", "--out", "run"], what="the resume once there is room")
    same_metrics("straight", "run", "a metrics failure, then a resume vs uninterrupted")
    # --on-metrics-error continue: lines 3 to 5 wait in memory, and are written (in order) once
    # there is room again; the run ends 0.
    _, out, err = run(base + ["--out", "cont", "--on-metrics-error", "continue"],
                      env=env_with(MEGATRAIN_FAULTS="fail@write:metrics#3..5=ENOSPC"), what="--on-metrics-error continue")
    check("the metrics of step 3 could not be written" in err and "--on-metrics-error continue" in err,
          f"no warning for the lines kept:\n{err}")
    same_metrics("straight", "cont", "--on-metrics-error continue vs uninterrupted")
    # Never room again: the lines are saved with the train state, the run ends 1 saying so, and a
    # resume writes them.
    _, out, err = run(base + ["--out", "never", "--on-metrics-error", "continue"],
                      env=env_with(MEGATRAIN_FAULTS="fail@write:metrics#7=ENOSPC"), expect_rc=1, what="no room again")
    check(re.search(r"2 lines of metrics.jsonl could not be written .*The train state of step 8 is saved in", err),
          f"the lines not written are not said to be saved:\n{err}")
    run(["--resume", "--out", "never", "--steps", "9"], what="resume: the lines written")
    check(steps_of("never") == list(range(1, 10)), f"metrics after the resume: {steps_of('never')}")


def tmpfs_full():
    mnt = path("disk")
    os.makedirs(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt], capture_output=True).returncode != 0:
        print("SKIP: mounting a tmpfs is not allowed here")
        sys.exit(77)
    try:
        rc, out, err = run(SHAPE + ["--steps", "3000", "--eval-every", "0", "--out", "disk/run"], expect_rc=None,
                           what="a run on a full disk")
        check(rc == 1, f"a run whose disk filled ended with status {rc}\n{out[-2000:]}\n{err[-2000:]}")
        check("No space left on device" in err and "The run stops" in err, f"no clear message for the full disk:\n{err}")
        text = open(path("disk", "run", "metrics.jsonl")).read()
        check(text.endswith("\n") and all(json.loads(l)["step"] == i + 1 for i, l in enumerate(text.splitlines())),
              "metrics.jsonl on the full disk holds a torn or repeated line")
        if REPORT:
            r = subprocess.run([REPORT, path("disk", "run"), "--output", path("report.html")], capture_output=True, text=True)
            check(r.returncode == 0 and "incomplete" not in r.stderr, f"megatrain-report on the full disk's run:\n{r.stderr}")
    finally:
        subprocess.run(["umount", mnt])


def export_failure():
    base = SHAPE + ["--steps", "4"]
    run(base + ["--out", "straight", "--export", "exp-straight"], what="the uninterrupted run")
    _, out, err = run(base + ["--out", "run", "--export", "exp"], env=env_with(MEGATRAIN_FAULTS="fail@write:export=ENOSPC"),
                      expect_rc=1, what="a failed final export")
    m = re.search(r"the export of step 4 to 'exp' failed: cannot write [^:]*: No space left on device\. The train state of "
                  r"step 4 is saved in (\S+)\. Export it again with: (megatrain-train --resume \S+ --steps 0 --eval-batches 0 "
                  r"--export exp)", err)
    check(m, f"the failed export does not say where the state is and how to export it:\n{err}")
    check(not os.path.exists(path("exp")) and not [n for n in os.listdir(WORK) if ".partial-" in n],
          f"the failed export left files: {os.listdir(WORK)}")
    run(m.group(2).split()[1:], what="the export from the saved state")
    check(md5("exp/model.safetensors") == md5("exp-straight/model.safetensors"),
          "the export from the saved state differs from the uninterrupted run's")
    check(json.load(open(path("exp", "megatrain_export.json")))["step"] == 4, "the export's marker does not say step 4")


def branch_export():
    run(SHAPE + ["--steps", "6", "--save-every", "2", "--keep", "3", "--out", "k9", "--export", path("out", "k9")],
        what="the original run")
    before = md5("out/k9/model.safetensors")
    _, out, err = run(["--resume", "k9/checkpoints/step-00000004", "--out", "branch", "--steps", "6"], what="the branch")
    check("branches from" in out + err and "is not taken over" in out + err, f"the branch does not say it does not export:\n{out}")
    check(md5("out/k9/model.safetensors") == before, "the branch replaced the original run's export")
    # An export folder belongs to the run that wrote it: another run is refused before it trains.
    _, out, err = run(["--resume", "k9/checkpoints/step-00000004", "--out", "branch2", "--steps", "6", "--export",
                       path("out", "k9")], expect_rc=1, what="a branch exporting over the original's export")
    check("another run exported to it" in err and "plan:" not in out, f"not refused before training:\n{out}\n{err}")
    _, _, err = run(SHAPE + ["--steps", "1", "--out", "other", "--export", "branch"], expect_rc=1,
                    what="an export over a folder of other files")
    check("no megatrain_export.json" in err or "not a regular file" in err, f"an export over a run folder not refused:\n{err}")
    # The run itself, resumed in place, still exports to its own folder.
    run(["--resume", "--out", "k9", "--steps", "8"], what="the original run, resumed")
    check(md5("out/k9/model.safetensors") != before, "the original run, resumed, did not export to its folder")
    check(json.load(open(path("out", "k9", "megatrain_export.json")))["step"] == 8, "the export's marker is not step 8's")


def damaged_newest():
    run(SHAPE + ["--steps", "6", "--save-every", "2", "--keep", "2", "--schedule", "constant", "--eval-every", "2", "--out", "run"],
        what="the run")
    run(SHAPE + ["--steps", "8", "--schedule", "constant", "--eval-every", "2", "--out", "straight"],
        what="the uninterrupted run")
    newest = path("run", "checkpoints", "step-00000006")
    shard = [n for n in os.listdir(newest) if n.endswith(".safetensors")][0]
    with open(os.path.join(newest, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(newest, shard)) // 2)
    # Asked for by name: refused, naming the intact one.
    _, _, err = run(["--resume", "run/checkpoints/step-00000006", "--steps", "8"], expect_rc=2, what="the damaged one by name")
    check("does not match its checksum" in err and "intact checkpoints of this run: run/checkpoints/step-00000004" in err,
          f"the damaged checkpoint asked for by name: not refused naming the intact one:\n{err}")
    # The run's latest: the damaged one named, the intact one taken.
    _, out, err = run(["--resume", "--out", "run", "--steps", "8"], what="resuming the run")
    check(re.search(r"warning: the checkpoint 'run/checkpoints/step-00000006' cannot be resumed from: .*does not match its "
                    r"checksum.*; resuming from the newest intact checkpoint, 'run/checkpoints/step-00000004' \(step 4\)", err),
          f"the damaged newest checkpoint not named, or the intact one not taken:\n{err}")
    same_metrics("straight", "run", "resumed past a damaged checkpoint vs uninterrupted")
    check(no_debris("run") == ["latest", "step-00000006", "step-00000008"], f"checkpoints: {checkpoints('run')}")


def small_ones():
    # The save's stall: with a slow disk, the steps wait for the saves, and the lines say so.
    _, out, _ = run(SHAPE + ["--steps", "6", "--save-every", "1", "--out", "slow"],
                    env=env_with(MEGATRAIN_FAULTS="delay@write:tensor=20000"), what="saves slower than the steps")
    waited = [float(x) for x in re.findall(r"training waited ([0-9.]+) s for it", out)]
    check(len(waited) == 6 and max(waited) >= 0.05, f"the saves' stalls are not counted: {waited}\n{out}")
    # Boolean options as bare flags, and with a value.
    run(SHAPE + ["--steps", "1", "--out", "flags", "--tie-embeddings", "--gemm-tuning", "false"], what="bare flags")
    opts = json.load(open(path("flags", "options.json")))
    check(opts["tie-embeddings"] == "true" and opts["gemm-tuning"] == "false", f"options.json: {opts}")
    # --out naming a file, or nothing; a resume of a folder that does not exist.
    open(path("afile"), "w").close()
    _, out, err = run(SHAPE + ["--steps", "1", "--out", "afile"], expect_rc=1, what="--out naming a file")
    check("--out 'afile' is a file, not a folder" in err and "plan:" not in out, f"--out a file:\n{out}\n{err}")
    _, _, err = run(SHAPE + ["--steps", "1", "--out", ""], expect_rc=1, what="--out ''")
    check("--out is empty" in err, f"--out '' not refused:\n{err}")
    check(not os.path.isdir(path("runs")), "--out '' wrote a run under runs/")
    _, _, err = run(["--resume", "--out", "runs/nope"], expect_rc=2, what="--resume of a missing run")
    check("the run folder 'runs/nope' does not exist" in err, f"--resume of a missing folder:\n{err}")
    # --help and --version name the program.
    _, out, _ = run(["--help"], what="--help")
    check(out.startswith("megatrain-train: train a decoder-only language model far larger than the GPU")
          and "Usage: megatrain-train [OPTIONS]" in out and "Qwen2 family" not in out, f"--help:\n{out[:400]}")
    _, out, _ = run(["--version"], what="--version")
    check(re.fullmatch(r"megatrain-train \d+\.\d+\.\d+\n", out), f"--version: {out!r}")
    # One host-memory figure: the start line says the plan's.
    _, out, _ = run(SHAPE + ["--steps", "1", "--out", "mem"], what="the host-memory figures")
    planned = re.search(r"host memory ([0-9.]+ [KMG]iB) of ", out)
    said = re.search(r"host memory ([0-9.]+ [KMG]iB) as planned \(([0-9.]+ [KMG]iB) of it the parameter store\)", out)
    check(planned and said and planned.group(1) == said.group(1), f"two different host-memory figures:\n{out}")
    # JSON records must be UTF-8 (as JSON is): invalid bytes refused naming the line.
    tok = os.path.join(REPO, "tests", "fuzz", "tokenizers", "qwen2_5")
    tiny = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--vocab", "1024",
            "--batch", "2", "--seq", "32", "--backend", "cpu", "--tokenizer", tok]
    with open(path("bad.jsonl"), "wb") as f:
        f.write(b'{"text": "a good line"}\n{"text": "a bad \xff byte"}\n')
    _, _, err = run(tiny + ["--data", "bad.jsonl", "--steps", "1", "--out", "utf8"], expect_rc=1, what="invalid UTF-8")
    check("bad.jsonl:2:" in err and "UTF-8" in err, f"invalid UTF-8 in a record not refused naming the line:\n{err}")
    # A --model-config + --tokenizer run's export: the tokenizer's files, the config's token ids.
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 1024,
              "tie_word_embeddings": True, "bos_token_id": 1010, "eos_token_id": 1011}
    json.dump(config, open(path("config.json"), "w"))
    with open(path("docs.jsonl"), "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}"}) + "\n")
    run(["--model-config", "config.json", "--tokenizer", tok, "--data", "docs.jsonl", "--batch", "2", "--seq", "32",
         "--backend", "cpu", "--steps", "2", "--out", "mc", "--export", "mc-export"], what="--model-config + --tokenizer")
    names = listing("mc-export")
    check("tokenizer.json" in names and "tokenizer_config.json" in names, f"the export holds no tokenizer files: {names}")
    exported = json.load(open(path("mc-export", "config.json")))
    check(exported.get("bos_token_id") == 1010 and exported.get("eos_token_id") == 1011,
          f"the export lost the config's token ids: {exported}")


def early_signal():
    # SIGTERM while the run starts (held there 3 s by the fault hook): it stops at once, saying so.
    p = start(SHAPE + ["--steps", "5", "--out", "early"], env_with(MEGATRAIN_FAULTS="delay@train:setup=3000000"))
    time.sleep(0.5)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    check(p.returncode == 143, f"SIGTERM before training: exit status {p.returncode}, expected 143\n{err}")
    check("stopped by SIGTERM while starting: nothing was trained" in err, f"no word of the stop:\n{err}")
    check(time.time() - t0 < 4, f"the stop took {time.time() - t0:.1f} s")
    check(not os.path.exists(path("early")), f"the stopped run left its folder: {listing('early')}")


main((lock, overwrite, metrics_full, tmpfs_full, export_failure, branch_export, damaged_newest, small_ones, early_signal),
     SCENARIO)
