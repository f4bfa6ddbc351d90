#!/usr/bin/env python3
"""megatrain-train's train-state checkpoints, end to end (docs/checkpointing.md).

    resume_test.py TRAIN_BINARY WORK_DIR SCENARIO

Scenarios (each a CTest test):
  signals        SIGINT, then SIGTERM, stop a run mid-way: each finishes its step, saves, exits
                 130 / 143 with a resume line; two resumes finish the run with the metrics (every
                 loss and gradient norm, bit for bit) and final train state of an uninterrupted run.
                 A signal during the last step: the run completes and is saved.
  second_signal  a second SIGINT during a save stops at once, removing the save's staging folder and
                 saying which checkpoint is the newest complete one; it still loads and the run goes on.
  kill9          SIGKILL at 20 random moments of a run that saves every step (slowed so that the
                 kills land in steps, saves, renames and clean-ups alike); resumed after each,
                 the run ends equal to an uninterrupted one, with no debris left.
  crash_points   SIGKILL at each named point of the save (tensors, manifest, renames, `latest`,
                 clean-up of old checkpoints), then resume: equal to an uninterrupted run.
  refusals       what --resume refuses (other options, data or model; no checkpoint; a damaged
                 file), each before anything changes; what it lets change; --keep; and the
                 export of a checkpoint without training.
  full_disk      a file-size limit makes saves fail: a warning, training goes on exactly as
                 without the limit, the previous checkpoint stays complete, exit status 1.
  gradient_home  a run whose micro-batches add up in host memory (--gradients host, which the
                 checkpoint records), resumed without the option (the default is auto): it keeps
                 host memory, bit for bit the uninterrupted run, saying nothing of a change; given
                 --gradients device on resume, it says that the sums come in another order. (Where
                 auto itself chose, a resumed run's auto keeps the checkpoint's home where it fits:
                 plan::choose_gradient_home's `prefer`, tested in test_memory_plan.)
  hybrid         Qwen3.5's hybrid layers (Gated DeltaNet, gated attention), and Qwen3-Next's (fused
                 projections, experts with a shared expert), from a config.json on the CPU backend, fine-tuning examples unpacked and packed: each run, crashed after its
                 third step's checkpoint and resumed, ends as the uninterrupted one, bit for bit;
                 the packed run's loss differs from the unpacked one's (its rows hold several
                 examples) while both learn.
  multimodal     a Qwen3_5ForConditionalGeneration folder (fixture qwen3_5_mm): the export is the whole
                 model, its vision tower and mtp.* tensors byte for byte; crashed and resumed from the
                 folder moved elsewhere, the same export; a checkpoint exported without training from
                 the recorded folder, refused once it is gone unless --model names it again or
                 --export-language-model asks for the language model alone; a folder whose carried
                 tensors changed refused at the start, before any step.
  tensorboard    --tensorboard DIR: the metrics as TensorBoard event files, read back by a decoder of
                 this test's own (record framing with CRC-32C, protobuf's wire format): each step's
                 scalars equal metrics.jsonl's; crashed at step 3's checkpoint and resumed, a
                 second file holds the steps from 4 on.
  nonfinite      a learning rate that makes step 2's loss overflow: the run stops there, saving
                 step 1's train state; resumed with --on-nonfinite skip, steps are skipped (in the
                 metrics) until the limit, and the state saved then is step 1's, bit for bit.
"""
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import *  # noqa: E402,F401,F403  (run, start, metrics, same_metrics, ...)
import cli_harness  # noqa: E402

TRAIN, WORK, SCENARIO = sys.argv[1], sys.argv[2], sys.argv[3]
configure(TRAIN, WORK)


# ---- scenarios --------------------------------------------------------------------------------------


def signals():
    base = SHAPE + ["--steps", "12", "--eval-every", "4", "--clip-mode", "exact", "--micro-batches", "2"]
    run(base + ["--out", "straight", "--save-every", "100"], what="the uninterrupted run")
    slow = env_with(MEGATRAIN_FAULTS="delay@train:step=150000")
    for sig, rc, name, lines in ((signal.SIGINT, 130, "SIGINT", 3), (signal.SIGTERM, 143, "SIGTERM", 7)):
        args = (base + ["--out", "run"]) if sig == signal.SIGINT else ["--resume", "--out", "run"]
        p = start(args, slow)
        wait_for_lines(p, "run", lines, name)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
        check(p.returncode == rc, f"{name}: exit status {p.returncode}, expected {rc}\n{err}")
        m = re.search(r"stopped by " + name + r" after step (\d+) of 12; checkpoint (\S+)\. "
                      r"Resume with: megatrain-train --resume --out run", err)
        check(m, f"{name}: no stop line with a checkpoint and how to resume in:\n{err}")
        step = int(m.group(1))
        check(step >= lines and os.path.isdir(path(m.group(2))), f"{name}: stopped after step {step}, checkpoint {m.group(2)}")
        check(len(metrics("run")) == step, f"{name}: metrics.jsonl has {len(metrics('run'))} lines after step {step}")
        check(open(path("run", "checkpoints", "latest")).read().strip() == f"step-{step:08d}",
              f"{name}: 'latest' does not name step {step}")
    # The first run gave no --save-every; the last leg adds one, so that its end is saved too.
    _, out, _ = run(["--resume", "--out", "run", "--save-every", "100"], what="the last resume")
    check("resumed from" in out, f"the last resume did not say where it resumed from:\n{out}")
    same_metrics("straight", "run", "SIGINT + SIGTERM + 2 resumes vs uninterrupted")
    same_state("straight", "run", 12, "SIGINT + SIGTERM + 2 resumes vs uninterrupted")
    # A signal during the last step: the run completes (status 0) and is saved, as the stop line
    # promised, although it saves no checkpoint otherwise.
    p = start(SHAPE + ["--steps", "3", "--out", "last"], env_with(MEGATRAIN_FAULTS="delay@train:step=400000"))
    wait_for_lines(p, "last", 2, "SIGTERM in the last step")
    time.sleep(0.1)  # well inside step 3 (its 0.4 s delay), which has begun
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    check(p.returncode == 0, f"SIGTERM in the last step: exit status {p.returncode}, expected 0\n{err}")
    check(checkpoints("last") == ["latest", "step-00000003"], f"SIGTERM in the last step: checkpoints {checkpoints('last')}")


def second_signal():
    base = SHAPE + ["--steps", "40", "--save-every", "1", "--keep", "2", "--out", "run"]
    # Steps of 50 ms, saves of >= 0.5 s (a slow disk): the second SIGINT lands during a save.
    p = start(base, env_with(MEGATRAIN_FAULTS="delay@train:step=50000,delay@write:tensor=100000"))
    wait_for_lines(p, "run", 3, "second SIGINT")
    deadline = time.time() + 60
    while not os.path.exists(path("run", "checkpoints", "latest")) and time.time() < deadline:
        time.sleep(0.01)
    check(os.path.exists(path("run", "checkpoints", "latest")), "no checkpoint was completed within 60 s")
    before = open(path("run", "checkpoints", "latest")).read().strip()
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    check(p.returncode == 130, f"second SIGINT: exit status {p.returncode}, expected 130\n{err}")
    check(time.time() - t0 < 1.5, f"second SIGINT: the process took {time.time() - t0:.2f} s to stop (a save takes > 3 s here)")
    latest = open(path("run", "checkpoints", "latest")).read().strip()
    check(latest >= before, f"'latest' went back from {before} to {latest}")
    # Nothing half-written is left, and the closing line says what there is and how to go on.
    no_debris("run")
    check(re.search(r"stopped at once by a second SIGINT; removed what was being written \(step-\d+\.partial-[0-9a-f]{8}\); "
                    r"the newest complete checkpoint is step " + str(int(latest[5:])) + r" .*resume with: megatrain-train "
                    r"--resume --out run", err), f"second SIGINT: no closing line naming the checkpoint in:\n{err}")
    # The newest complete checkpoint loads (evaluated without training) ...
    _, out, err = run(["--resume", "--out", "run", "--steps", "0", "--eval-batches", "1"], what="evaluating the checkpoint")
    check('"val_loss"' in out and f"resumed from run/checkpoints/{latest}" in err,
          f"evaluating {latest}: unexpected output\n{out}\n{err}")
    # ... and the run goes on from it.
    run(["--resume", "--out", "run", "--steps", str(int(latest[5:]) + 2)], what="resuming after the second SIGINT")
    names = no_debris("run")
    check(names == sorted([f"step-{int(latest[5:]) + 1:08d}", f"step-{int(latest[5:]) + 2:08d}", "latest"]),
          f"checkpoints after the resume: {names}")


def kill9():
    steps = 400
    base = SHAPE + ["--steps", str(steps), "--save-every", "1", "--keep", "2", "--eval-every", "50"]
    run(base + ["--out", "straight"], what="the uninterrupted run")
    rnd = random.Random(int(os.environ.get("MEGATRAIN_KILL_SEED", str(time.time_ns()))))
    slow = env_with(MEGATRAIN_FAULTS="delay@train:step=20000,delay@write:tensor=2000")
    kills = fresh_starts = 0
    while kills < 20:
        # (a complete checkpoint: a kill during the first save leaves step-00000001.partial-*)
        have = any(re.fullmatch(r"step-\d{8}", n) for n in checkpoints("run"))
        args = ["--resume", "--out", "run"] if have else base + ["--out", "run", "--overwrite", "true"]
        fresh_starts += 0 if have else 1
        p = start(args, slow)
        if kills % 4 == 3:
            # Every fourth kill waits for a new complete checkpoint first, so that the run makes
            # progress however slowly the machine starts it (a loaded CI machine can take longer
            # than the random delays below to reach the first save).
            done = sorted(n for n in checkpoints("run") if re.fullmatch(r"step-\d{8}", n))
            deadline = time.time() + 60
            while time.time() < deadline and p.poll() is None:
                now = sorted(n for n in checkpoints("run") if re.fullmatch(r"step-\d{8}", n))
                if now and (not done or now[-1] > done[-1]):
                    break
                time.sleep(0.01)
        time.sleep(rnd.uniform(0.02, 0.7))
        if p.poll() is not None:
            out, err = p.communicate()
            fail(f"the run ended by itself (status {p.returncode}) before the 20th kill; raise its --steps\n{err[-2000:]}")
        p.kill()
        p.communicate()
        kills += 1
        print(f"kill {kills}: {len(metrics('run')) if os.path.exists(path('run', 'metrics.jsonl')) else 0} metrics lines, "
              f"checkpoints {checkpoints('run')}", flush=True)
    check(fresh_starts < 20, "no checkpoint was ever completed between kills")
    run(["--resume", "--out", "run"], what="the final resume")
    same_metrics("straight", "run", f"{kills} kills + resumes vs uninterrupted")
    same_state("straight", "run", steps, f"{kills} kills + resumes vs uninterrupted")
    names = no_debris("run")
    check(names == ["latest", f"step-{steps - 1:08d}", f"step-{steps:08d}"], f"checkpoints at the end: {names}")


def crash_points():
    base = SHAPE + ["--steps", "6", "--save-every", "1", "--keep", "1"]
    run(base + ["--out", "straight"], what="the uninterrupted run")
    for point in ("write:tensor#80", "write:files#3", "write:before-rename#3", "write:after-rename#3",
                  "checkpoint:checksums#3", "checkpoint:latest#3", "retire#2"):
        name = "run-" + point.replace(":", "-").replace("#", "-")
        rc, _, err = run(base + ["--out", name], env=env_with(MEGATRAIN_FAULTS="crash@" + point), expect_rc=None)
        check(rc == -signal.SIGKILL, f"crash at {point}: exit status {rc}, expected SIGKILL (the point was not reached?)\n{err}")
        check(any(n.startswith("step-") for n in checkpoints(name)), f"crash at {point}: it came before the first checkpoint")
        run(["--resume", "--out", name], what=f"resume after a crash at {point}")
        same_metrics("straight", name, f"crash at {point} + resume vs uninterrupted")
        same_state("straight", name, 6, f"crash at {point} + resume vs uninterrupted")
        check(no_debris(name) == ["latest", "step-00000006"], f"crash at {point}: checkpoints {checkpoints(name)}")


def hybrid():
    tok = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "tokenizers", "qwen2_5")
    dense = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 32,
             "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 8, "vocab_size": 1024, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
             "linear_key_head_dim": 8, "linear_value_head_dim": 6, "tie_word_embeddings": False,
             "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
    # Qwen3-Next: the fused projections, a sparse layer with a shared expert beside a dense one
    nxt = dict(dense, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=12, mlp_only_layers=[1])
    with open(path("sft.jsonl"), "w") as f:
        for i in range(60):
            f.write(json.dumps({"prompt": f"question {i}: " + "how far " * (i % 5), "completion": f" answer {i * 7}" * (1 + i % 3)})
                    + "\n")
    for family, config in (("qwen3_5", dense), ("qwen3_next", nxt)):
        json.dump(config, open(path(f"{family}.json"), "w"))
        losses = {}
        for pack in ("unpacked", "packed"):
            base = ["--model-config", f"{family}.json", "--tokenizer", tok, "--data", "sft.jsonl", "--batch", "2", "--seq",
                    "48", "--backend", "cpu", "--steps", "6", "--save-every", "3", "--lr", "0.003"] + \
                   (["--pack"] if pack == "packed" else [])
            what = f"{family} {pack}"
            run(base + ["--out", f"straight-{family}-{pack}"], what=f"the uninterrupted {what} run")
            name = f"resumed-{family}-{pack}"
            rc, _, err = run(base + ["--out", name], env=env_with(MEGATRAIN_FAULTS="crash@checkpoint:latest#1"), expect_rc=None)
            check(rc == -signal.SIGKILL, f"{what}: exit status {rc}, expected SIGKILL at the first checkpoint\n{err}")
            run(["--resume", "--out", name], what=f"the {what} run resumed")
            same_metrics(f"straight-{family}-{pack}", name, f"{what}: crashed + resumed vs uninterrupted")
            same_state(f"straight-{family}-{pack}", name, 6, f"{what}: crashed + resumed vs uninterrupted")
            m = metrics(f"straight-{family}-{pack}")
            losses[pack] = [r["loss"] for r in m if "loss" in r]
            check(len(losses[pack]) == 6 and all(math.isfinite(x) for x in losses[pack]), f"{what}: losses {losses[pack]}")
            check(losses[pack][-1] < losses[pack][0], f"{what}: the loss did not fall: {losses[pack]}")
        check(losses["packed"] != losses["unpacked"], f"{family}: packing changed nothing: the rows were not packed")


def safetensors_tensors(file):
    """name -> (dtype, shape, bytes) of one safetensors file."""
    with open(file, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], blob[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def multimodal():
    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "qwen3_5_mm")
    shutil.copytree(fixture, path("mm"))
    rng = random.Random(7)
    with open(path("tokens.bin"), "wb") as f:  # (u16 ids below the fixture's vocabulary of 97)
        f.write(b"".join(rng.randrange(97).to_bytes(2, "little") for _ in range(4000)))
    original = safetensors_tensors(path("mm", "model.safetensors"))
    carried = sorted(k for k in original if k.startswith("model.visual.") or k.startswith("mtp."))
    check(len(carried) >= 5, f"the fixture holds {len(carried)} vision / mtp tensors")
    base = ["--model", "mm", "--data", "tokens.bin", "--data-format", "u16", "--batch", "2", "--seq", "16", "--backend",
            "cpu", "--steps", "4", "--save-every", "2", "--lr", "0.003", "--export-dtype", "f32"]

    def whole_export(d, what):
        cfg = json.load(open(path(d, "config.json")))
        check(cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in cfg and "vision_config" in cfg,
              f"{what}: config.json is not the whole model's: {cfg.get('architectures')}")
        got = safetensors_tensors(path(d, "model.safetensors"))
        check(sorted(got) == sorted(original), f"{what}: tensor names differ from the folder's: "
              f"{sorted(set(got) ^ set(original))[:6]}")
        for k in carried:
            check(got[k] == original[k], f"{what}: {k} is not the folder's, byte for byte")
        changed = [k for k in got if k not in carried and got[k][2] != original[k][2]]
        check(changed, f"{what}: no language-model tensor changed: the export holds the folder's weights, not the trained ones")
        return got

    run(base + ["--out", "straight", "--export", "exp-straight"], what="the uninterrupted run")
    straight = whole_export("exp-straight", "the uninterrupted run's export")
    rc, _, err = run(base + ["--out", "resumed", "--export", "exp-resumed"],
                     env=env_with(MEGATRAIN_FAULTS="crash@checkpoint:latest#1"), expect_rc=None)
    check(rc == -signal.SIGKILL, f"exit status {rc}, expected SIGKILL at the first checkpoint\n{err}")
    os.rename(path("mm"), path("mm-moved"))
    run(["--resume", "--out", "resumed", "--model", "mm-moved"], what="resumed with the folder moved")
    check(whole_export("exp-resumed", "the resumed run's export") == straight,
          "the resumed run's export differs from the uninterrupted run's")
    # A checkpoint exported without training: the folder it records is gone.
    ckpt = path("straight", "checkpoints", checkpoints("straight")[-1])
    _, _, err = run(["--resume", ckpt, "--steps", "0", "--eval-batches", "0", "--export", "exp-gone"], expect_rc=1,
                    what="an export whose recorded folder is gone")
    check("it is gone" in err and "--export-language-model" in err, f"the refusal does not say why or what to do:\n{err}")
    check(not os.path.exists(path("exp-gone")), "the refused export left a folder")
    run(["--resume", ckpt, "--steps", "0", "--eval-batches", "0", "--export", "exp-text", "--export-language-model"],
        what="the language model alone")
    cfg = json.load(open(path("exp-text", "config.json")))
    check(cfg["architectures"] == ["Qwen3_5ForCausalLM"], f"--export-language-model wrote {cfg['architectures']}")
    text = safetensors_tensors(path("exp-text", "model.safetensors"))
    check(not any(k.startswith(("model.visual.", "mtp.", "model.language_model.")) for k in text),
          "--export-language-model wrote the folder's names or its vision tower")
    run(["--resume", ckpt, "--steps", "0", "--eval-batches", "0", "--export", "exp-again", "--model", "mm-moved",
         "--export-dtype", "f32"],
        what="the export with --model naming the moved folder")
    check(whole_export("exp-again", "the checkpoint's export") == straight, "the checkpoint's export differs from the run's")
    # The folder's carried tensors changed: refused before any step.
    with open(path("mm-moved", "model.safetensors"), "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        at = 8 + n + json.loads(f.read(n))["mtp.fc.weight"]["data_offsets"][0]
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    _, _, err = run(["--resume", "--out", "resumed", "--model", "mm-moved", "--steps", "6"], expect_rc=1,
                    what="resumed from a folder whose carried tensors changed")
    check("changed since the run read them" in err, f"the refusal does not say what changed:\n{err}")
    check(checkpoints("resumed")[-1].endswith("4"), f"a step ran after the refusal: {checkpoints('resumed')}")


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
    return c ^ 0xFFFFFFFF


def masked(c):
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def proto_fields(m):
    """field number -> list of values (int for varints, bytes otherwise)."""
    out, at = {}, 0

    def varint():
        nonlocal at
        v, shift = 0, 0
        while True:
            b = m[at]
            at += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v
    while at < len(m):
        key = varint()
        wire = key & 7
        if wire == 0:
            val = varint()
        elif wire == 1:
            val, at = m[at:at + 8], at + 8
        elif wire == 5:
            val, at = m[at:at + 4], at + 4
        elif wire == 2:
            n = varint()
            val, at = m[at:at + n], at + n
        else:
            fail(f"wire type {wire}")
        out.setdefault(key >> 3, []).append(val)
    return out


def tensorboard_events(file):
    """[(step, {tag: value})] of an events file, its framing and CRCs checked; the first event
    must be the file version."""
    import struct
    blob = open(file, "rb").read()
    events, at = [], 0
    while at < len(blob):
        (n,) = struct.unpack_from("<Q", blob, at)
        check(struct.unpack_from("<I", blob, at + 8)[0] == masked(crc32c(blob[at:at + 8])), f"{file}: a length's CRC")
        data = blob[at + 12:at + 12 + n]
        check(struct.unpack_from("<I", blob, at + 12 + n)[0] == masked(crc32c(data)), f"{file}: a record's CRC")
        events.append(proto_fields(data))
        at += 16 + n
    check(events and events[0].get(3) == [b"brain.Event:2"], f"{file}: the first event is not the file version")
    out = []
    for e in events[1:]:
        values = {}
        for v in proto_fields(e[5][0]).get(1, []):
            f = proto_fields(v)
            values[f[1][0].decode()] = struct.unpack("<f", f[2][0])[0]
        out.append((e.get(2, [0])[0], values))
    return out


def tensorboard():
    import struct
    base = SHAPE + ["--steps", "6", "--save-every", "3", "--lr", "0.002", "--eval-every", "2", "--tensorboard", "tb"]
    rc, _, err = run(base + ["--out", "run"], env=env_with(MEGATRAIN_FAULTS="crash@checkpoint:latest#1"), expect_rc=None)
    check(rc == -signal.SIGKILL, f"exit status {rc}, expected SIGKILL at the first checkpoint\n{err}")
    run(["--resume", "--out", "run"], what="resumed")
    files = sorted(f for f in os.listdir(path("tb")) if ".tfevents." in f)
    check(len(files) == 2, f"tb holds {files}: expected a file for the run and one for its resumption")
    first, second = (tensorboard_events(path("tb", f)) for f in files)
    # (the save runs beside the next step: the crash may come after step 4 was written; TensorBoard
    # drops the steps past the one a later event goes back to)
    steps = [s for s, _ in first]
    check(steps[:3] == [1, 2, 3] and steps == list(range(1, len(steps) + 1)), f"the first file's steps: {steps}")
    check([s for s, _ in second] == [4, 5, 6], f"the resumed file's steps: {[s for s, _ in second]}")
    rows = {m["step"]: m for m in (json.loads(l) for l in open(path("run", "metrics.jsonl")))}
    for step, values in first[:3] + second:
        m = rows[step]
        for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                         ("tokens_per_s", "train/tokens_per_s"), ("val_loss", "val/loss")):
            if key not in m:
                check(tag not in values, f"step {step}: {tag} without {key} in metrics.jsonl")
                continue
            want = struct.unpack("<f", struct.pack("<f", m[key]))[0]
            check(values.get(tag) == want, f"step {step}: {tag} {values.get(tag)} vs metrics.jsonl's {m[key]}")
    check("val/loss" in dict(first)[2], "no val/loss at step 2 (--eval-every 2)")


def refusals():
    base = SHAPE + ["--steps", "6", "--save-every", "2", "--keep", "2", "--lr", "0.002"]
    # --resume with nothing to resume.
    _, _, err = run(["--resume", "--out", "nothing"], expect_rc=2)
    check("the run folder 'nothing' does not exist" in err, f"--resume of a run folder that does not exist:\n{err}")
    os.makedirs(path("nothing"))
    _, _, err = run(["--resume", "--out", "nothing"], expect_rc=2)
    check("has no checkpoint in 'nothing/checkpoints'" in err, f"--resume without a checkpoint:\n{err}")
    _, _, err = run(["--resume", "absent"], expect_rc=2)
    check("--resume 'absent': no such folder" in err, f"--resume of a missing folder:\n{err}")
    # --keep 2 leaves the two newest; the checkpoints hold the model's config.json.
    run(base + ["--out", "run"])
    check(checkpoints("run") == ["latest", "step-00000004", "step-00000006"], f"--keep 2: {checkpoints('run')}")
    check(os.path.exists(path("run", "checkpoints", "step-00000006", "config.json")), "no config.json in the checkpoint")
    # Other optimizer, batch, sequence, model or data: refused, naming each option; nothing changes.
    metrics_before = open(path("run", "metrics.jsonl")).read()
    for extra, wants in ((["--lr", "0.01", "--batch", "2"], ["--lr (checkpoint: 0.002, now: 0.01)", "--batch (checkpoint: 4, now: 2)"]),
                         (["--seq", "8", "--clip", "0.5"], ["--seq (checkpoint: 16, now: 8)", "--clip (checkpoint: 1.0, now: 0.5)"]),
                         (["--weight-decay", "0.5", "--beta2", "0.9"], ["--weight-decay", "--beta2"]),
                         (["--hidden", "48"], ["another model than the checkpoint's", "hidden_size"]),
                         (["--data", "other.txt"], ["--data 'other.txt' (its tokens differ"]),
                         (["--seed", "5"], ["--seed (checkpoint: 1, now: 5)"])):
        if "--data" in extra:
            with open(path("other.txt"), "w") as f:
                f.write("another text, other tokens. " * 400)
        _, _, err = run(["--resume", "--out", "run", "--steps", "8"] + extra, expect_rc=1, what=f"resume with {extra}")
        for w in wants:
            check(w in err, f"resume with {extra}: the error does not name '{w}':\n{err}")
        check(open(path("run", "metrics.jsonl")).read() == metrics_before, f"resume with {extra} changed metrics.jsonl")
        check(checkpoints("run") == ["latest", "step-00000004", "step-00000006"], f"resume with {extra} changed checkpoints")
    _, _, err = run(["--resume", "--out", "run", "--steps", "8", "--schedule", "constant"], expect_rc=1)
    check('--schedule (checkpoint: "warmup_cosine", now: "constant")' in err and "--min-lr" not in err,
          f"a change of schedule kind names the kind only:\n{err}")
    # Options left at their defaults are recorded too (a later megatrain may change a default).
    given = json.load(open(path("run", "checkpoints", "step-00000006", "train_state.json")))["user"]["given"]
    for name in ("--beta2", "--eps", "--clip", "--clip-mode", "--schedule", "--min-lr", "--seed", "--batch", "--seq"):
        check(name in given, f"the checkpoint does not record {name}: {sorted(given)}")
    # An export never replaces, or lands in, the checkpoints.
    for target in ("run/checkpoints/step-00000006", "run/checkpoints/other", "run"):
        _, _, err = run(["--resume", "--out", "run", "--steps", "0", "--eval-batches", "0", "--export", target], expect_rc=1)
        check(any(x in err for x in ("export elsewhere", "choose another directory", "choose another folder")),
              f"--export {target}: not refused:\n{err}")
    check(checkpoints("run") == ["latest", "step-00000004", "step-00000006"], "a refused export changed the checkpoints")
    _, _, err = run(["--resume", "--out", "run", "--steps", "6"], expect_rc=1)
    check("is at step 6 already; give --steps > 6" in err, f"--steps not beyond the checkpoint:\n{err}")
    # What may change: the run's length, its saving, logging, evaluation and export.
    _, out, _ = run(["--resume", "--out", "run", "--steps", "8", "--save-every", "1", "--keep", "3", "--eval-every", "1",
                     "--log-every", "1", "--export", "exp", "--micro-batches", "2"])
    check("resumed from" in out and "exported step 8 to exp" in out, f"an allowed resume:\n{out}")
    check(checkpoints("run") == ["latest", "step-00000006", "step-00000007", "step-00000008"], f"--keep 3: {checkpoints('run')}")
    check([m["step"] for m in metrics("run")] == list(range(1, 9)), "metrics.jsonl after the resume")
    # A damaged checkpoint asked for by name is refused naming the file, before anything changes
    # (the run's newest, when damaged, is passed over for the newest intact one: run_safety_test.py).
    ck = path("run", "checkpoints", "step-00000008")
    shard = sorted(n for n in os.listdir(ck) if n.endswith(".safetensors"))[0]
    data = bytearray(open(os.path.join(ck, shard), "rb").read())
    metrics_before = open(path("run", "metrics.jsonl")).read()
    for damage in ("flip", "truncate"):
        bad = bytearray(data)
        if damage == "flip":
            bad[len(bad) // 2] ^= 0x10
        else:
            bad = bad[: len(bad) - 100]
        open(os.path.join(ck, shard), "wb").write(bad)
        _, _, err = run(["--resume", "run/checkpoints/step-00000008", "--steps", "10"], expect_rc=2,
                        what=f"resume from a {damage}ped shard")
        check(shard in err and ("checksum" in err or "size" in err), f"{damage}: the error does not name {shard}:\n{err}")
        check(open(path("run", "metrics.jsonl")).read() == metrics_before, f"{damage}: metrics.jsonl changed")
    open(os.path.join(ck, shard), "wb").write(data)
    # Export without training: a Hugging Face folder that loads and evaluates.
    _, out, err = run(["--resume", "--out", "run", "--steps", "0", "--eval-batches", "0", "--export", "exp2",
                       "--export-dtype", "f32"])
    check("exported step 8 to exp2 (float32)" in err + out, f"export from the checkpoint:\n{out}\n{err}")
    check(os.path.exists(path("exp2", "model.safetensors")) and os.path.exists(path("exp2", "config.json")),
          f"exp2 holds {os.listdir(path('exp2'))}")
    _, out, _ = run(["--model", "exp2", "--steps", "0", "--seq", "16", "--batch", "4", "--eval-batches", "1", "--backend", "cpu"])
    check('"val_loss"' in out, f"evaluating the export:\n{out}")
    # The export equals the checkpoint's masters: evaluating either gives the same loss.
    _, out2, _ = run(["--resume", "--out", "run", "--steps", "0", "--eval-batches", "1"])
    l1, l2 = json.loads(out.strip().splitlines()[-1])["val_loss"], json.loads(out2.strip().splitlines()[-1])["val_loss"]
    check(l1 == l2, f"the f32 export evaluates to {l1}, the checkpoint to {l2}")


def full_disk():
    base = SHAPE + ["--save-every", "2", "--keep", "3", "--schedule", "constant"]
    run(base + ["--steps", "2", "--out", "free"], what="the first two steps")
    shutil.copytree(path("free"), path("limited"))
    ckpt_bytes = sum(os.path.getsize(path("free", "checkpoints", "step-00000002", n))
                     for n in os.listdir(path("free", "checkpoints", "step-00000002")))
    check(ckpt_bytes > 200_000, f"the checkpoint is {ckpt_bytes} bytes: too small for the 64 KiB limit to bite")
    rc, out, err = run(["--resume", "--out", "limited", "--steps", "8"], fsize=64 * 1024, expect_rc=1,
                       what="the run under a 64 KiB file-size limit")
    for s in (4, 6, 8):
        check(f"warning: the checkpoint of step {s} could not be written" in err, f"no warning for step {s}:\n{err}")
    check("File too large" in err or "file too large" in err.lower() or "limit" in err, f"the cause is not named:\n{err}")
    check("The newest complete checkpoint is step 2" in err and "training goes on" in err, f"warning text:\n{err}")
    check("error: the run finished, but its last checkpoint could not be written (the newest complete one is step 2)" in err,
          f"final error:\n{err}")
    check(no_debris("limited") == ["latest", "step-00000002"], f"checkpoints under the limit: {checkpoints('limited')}")
    # Training went on exactly as it does with room to save.
    run(["--resume", "--out", "free", "--steps", "8"], what="the same run with room")
    same_metrics("free", "limited", "saves failing vs saves succeeding")
    # The previous checkpoint is intact: the run resumes from it again and matches.
    run(["--resume", "--out", "limited", "--steps", "8"], what="resuming the limited run with room")
    same_metrics("free", "limited", "resumed after failed saves vs saves succeeding")
    same_state("free", "limited", 8, "resumed after failed saves vs saves succeeding")


def nonfinite():
    # (lr 1e30: step 1's update makes the weights ~1e30, and step 2's forward overflows)
    base = SHAPE + ["--steps", "6", "--schedule", "constant", "--lr", "1e30", "--out", "run"]
    rc, out, err = run(base, expect_rc=1, what="the diverging run")
    check(re.search(r"error: step 2: the loss (and the gradient are|is) not finite", err), f"the stop is not named:\n{err}")
    check("the model and the optimizer state were not updated: they are those of step 1" in err, f"stop text:\n{err}")
    check("The train state of step 1 (the last good one) is in" in err and "--on-nonfinite skip" in err,
          f"the saved state is not named:\n{err}")
    check(no_debris("run") == ["latest", "step-00000001"], f"checkpoints after the stop: {checkpoints('run')}")
    check([m["step"] for m in metrics("run")] == [1], f"metrics after the stop: {metrics('run')}")
    # Skipping: steps 2 and 3 are skipped, step 4 is the third in a row and stops the run.
    rc, out, err = run(["--resume", "--out", "run", "--on-nonfinite", "skip", "--max-nonfinite-skips", "2"], expect_rc=1,
                       what="the resumed run, skipping")
    check("(3 non-finite steps in a row, more than max_nonfinite_skips 2)" in err, f"the limit is not named:\n{err}")
    check("they are those of step 3" in err, f"stop text:\n{err}")
    lines = [json.loads(line) for line in open(path("run", "metrics.jsonl"))]
    check([m["step"] for m in lines] == [1, 2, 3], f"metrics steps: {[m['step'] for m in lines]}")
    check([m.get("skipped", False) for m in lines] == [False, True, True], f"skipped flags: {lines}")
    check([m.get("skipped_steps", 0) for m in lines] == [0, 1, 2], f"skipped counts: {lines}")
    check(no_debris("run") == ["latest", "step-00000001", "step-00000003"], f"checkpoints: {checkpoints('run')}")
    one = tensor_digests(path("run", "checkpoints", "step-00000001"))
    three = tensor_digests(path("run", "checkpoints", "step-00000003"))
    check(one == three, f"the skipped steps changed the state:\n  step 1: {one}\n  step 3: {three}")
    st = json.load(open(path("run", "checkpoints", "step-00000003", "train_state.json")))
    check(st["step"] == 3 and st["skipped_steps"] == 2 and st["skipped_in_a_row"] == 2, f"train_state.json: {st}")
    # Skipping needs the whole gradient before any update.
    rc, out, err = run(SHAPE + ["--clip", "0", "--on-nonfinite", "skip", "--out", "noclip"], expect_rc=1,
                       what="--on-nonfinite skip without clipping")
    check("--on-nonfinite skip needs the whole gradient before any update" in err and "--clip 0" in err,
          f"refusal text:\n{err}")
    check(not os.path.exists(path("noclip", "metrics.jsonl")), "the refused run trained")


def gradient_home():
    # (a constant schedule: a decaying one's length is the first run's --steps; evaluated where the
    # first leg ends, as it does)
    base = SHAPE + ["--clip-mode", "exact", "--micro-batches", "2", "--gradients", "host", "--schedule", "constant",
                    "--eval-every", "3"]
    run(base + ["--steps", "6", "--out", "straight", "--save-every", "100"], what="the uninterrupted run")
    run(base + ["--steps", "3", "--out", "run", "--save-every", "3"], what="the first leg")
    _, out, err = run(["--resume", "--out", "run", "--steps", "6", "--save-every", "3"], what="the resume")
    check("resumed from" in out, f"the resume did not say where it resumed from:\n{out}")
    check("not bit for bit" not in out + err, f"the resume changed where micro-batches add up:\n{out}\n{err}")
    same_metrics("straight", "run", "--gradients host resumed vs uninterrupted")
    same_state("straight", "run", 6, "--gradients host resumed vs uninterrupted")
    # Given again, another home is allowed, and said to change the order of the sums.
    _, out, err = run(["--resume", "--out", "run", "--steps", "7", "--gradients", "device"], what="the resume (--gradients device)")
    check("micro-batches added up in GPU memory (checkpoint: host)" in out + err and "not bit for bit" in out + err,
          f"a resume that changes where micro-batches add up does not say so:\n{out}\n{err}")


main((signals, second_signal, kill9, crash_points, refusals, full_disk, nonfinite, gradient_home, hybrid, multimodal,
      tensorboard),
     SCENARIO)
