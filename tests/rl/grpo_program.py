#!/usr/bin/env python3
"""megatrain-train --objective grpo end to end on the CPU backend (docs/rl.md).

A byte-level tokenizer (tokenizer.json: the 256 bytes, no merges, an end token) and sums of two
digits below 5 as text. The built-in model shape is trained a little on the sums (SFT) and
exported; GRPO then trains it on the 25 prompts "A plus B is" with the answer-match reward, and the
mean reward of greedy completions of those 25 prompts (val_reward) must rise by at least 0.3
between the first evaluation (step 20) and step 120 (seed 1). Then: a run resumed from its
checkpoint equals the uninterrupted one bit for bit; a reward program that exits non-zero, hangs or
prints garbage stops the run with the last checkpoint intact (and a resume from it runs); and what
is refused before anything is written.

    grpo_program.py TRAIN_BIN WORK_DIR [scenario]
"""
import json
import os
import random
import shutil
import sys

train, work = (os.path.abspath(a) for a in sys.argv[1:3])
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import cli_harness as h  # noqa: E402

h.configure(train, work)
check = h.check
BASE = work + "-base"  # (the tokenizer, the sums, the prompts and the SFT model: made once, shared by the scenarios)
REWARD = r"^\s*(\d+)"
GRPO = ["--objective", "grpo", "--model", f"{BASE}/sft", "--data", f"{BASE}/prompts.jsonl", "--reward-answer", REWARD,
        "--seq", "16", "--max-completion-tokens", "4", "--schedule", "constant", "--backend", "cpu"]


def byte_tokenizer(folder):
    """GPT-2's byte-to-character map as a BPE vocabulary without merges; <|end|> (256) ends text."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    tok = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
           "added_tokens": [{"id": 256, "content": "<|end|>", "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True}],
           "pre_tokenizer": level, "decoder": level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": []}}
    os.makedirs(folder, exist_ok=True)
    json.dump(tok, open(os.path.join(folder, "tokenizer.json"), "w"))
    json.dump({"eos_token": "<|end|>", "bos_token": None}, open(os.path.join(folder, "tokenizer_config.json"), "w"))


def write_jsonl(name, records):
    with open(h.path(name) if not os.path.isabs(name) else name, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def sft_model():
    """The sums as text, a little SFT of the default shape, exported to BASE/sft (float32); once."""
    if os.path.exists(os.path.join(BASE, "sft", "config.json")):
        return
    shutil.rmtree(BASE, ignore_errors=True)
    byte_tokenizer(os.path.join(BASE, "tok"))
    r = random.Random(1)
    with open(os.path.join(BASE, "sums.txt"), "w") as f:
        for _ in range(20000):
            a, b = r.randrange(5), r.randrange(5)
            f.write(f"{a} plus {b} is {a + b}.\n")
    write_jsonl(os.path.join(BASE, "prompts.jsonl"),
                [{"prompt": f"{a} plus {b} is", "answer": a + b} for a in range(5) for b in range(5)])
    h.run(["--data", f"{BASE}/sums.txt", "--tokenizer", f"{BASE}/tok", "--vocab", "257", "--seq", "64", "--batch", "16",
           "--steps", "100", "--eval-every", "0", "--out", f"{BASE}/sft-run", "--export", f"{BASE}/sft", "--export-dtype", "f32",
           "--backend", "cpu"])


def lines(run):
    return [json.loads(x) for x in open(h.path(run, "metrics.jsonl"))]


def learns():
    """GRPO raises the reward of greedy completions of the 25 prompts by 0.3 or more."""
    sft_model()
    _, out, _ = h.run(GRPO + ["--val-data", f"{BASE}/prompts.jsonl", "--generations", "16", "--batch", "128", "--steps", "120",
                              "--eval-every", "20", "--lr", "5e-4", "--out", "grpo"])
    check("25 training prompts, 25 validation; 16 completions each, of at most 4 tokens" in out, out[-2000:])
    m = lines("grpo")
    val = [x["val_reward"] for x in m if "val_reward" in x]
    print("val_reward every 20 steps:", val)
    check(len(val) == 6 and val[-1] - val[0] >= 0.3, f"the mean reward of the held prompts rose from {val[0]} to "
          f"{val[-1]} (at least 0.3 expected)")
    for k in ("reward", "reward_std", "rewards/answer/mean", "rewards/answer/std", "frac_reward_zero_std", "advantages/mean",
              "completions/mean_length", "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean",
              "sampling_tokens_per_s", "tokens_per_s"):
        check(all(k in x for x in m), f"metrics.jsonl lacks {k}: {m[0]}")
    check(all(0 <= x["reward"] <= 1 and x["completions/max_length"] <= 4 for x in m), f"rewards or lengths out of range: {m[-1]}")
    html = open(h.path("grpo", "report.html")).read()
    check("Mean reward" in html and "last val reward" in html, "report.html shows no reward")
    # (the first update of a batch: every ratio is 1, so no token is clipped)
    check(all(x["clip_ratio/region_mean"] == 0 for x in m), "a token was clipped on a first update")


def resumes():
    """Steps 1-4, then 5-8 resumed from the checkpoint of step 4: the uninterrupted run's bits."""
    sft_model()
    run = GRPO + ["--generations", "4", "--batch", "16", "--eval-every", "4", "--val-fraction", "0.2", "--lr", "1e-3",
                  "--save-every", "4"]
    h.run(run + ["--steps", "8", "--out", "whole"])
    h.run(run + ["--steps", "4", "--out", "parts"])
    # (a resume that would sample or weigh otherwise is refused, naming the option)
    for args, words in ((["--grpo-loss", "grpo"], "--grpo-loss (checkpoint: \"dapo\", now: \"grpo\")"),
                        (["--generations", "8"], "--generations (checkpoint: 4, now: 8)"),
                        (["--reward-format", "\\d"], "--reward-format (checkpoint: \"\", now: \"\\\\d\")")):
        _, _, err = h.run(["--resume", "--steps", "8", "--out", "parts"] + args, expect_rc=1)
        check(words in err, f"{args}: '{words}' is not in the message:\n{err[-2000:]}")
    h.run(["--resume", "--steps", "8", "--out", "parts"])
    h.same_metrics("whole", "parts", "a resumed GRPO run")
    h.same_state("whole", "parts", 8, "a resumed GRPO run")
    a, b = lines("whole"), lines("parts")
    for k in ("reward", "rewards/answer/mean", "completions/mean_length", "val_reward"):
        check([x.get(k) for x in a] == [x.get(k) for x in b], f"{k} differs after the resume: {a} vs {b}")
    # (its checkpoint exports; evaluating it is refused: its data is prompts)
    _, _, err = h.run(["--resume", "parts", "--steps", "0"], expect_rc=1)
    check("add --eval-batches 0 to export only" in err, err[-2000:])
    h.run(["--resume", "parts", "--steps", "0", "--eval-batches", "0", "--export", "parts-export"])
    check(os.path.isfile(h.path("parts-export", "model.safetensors")), "no export of the GRPO run")
    st = json.load(open(h.path("parts", "checkpoints", "step-00000008", "train_state.json")))
    # (20 training prompts, 4 a step: step 8 has drawn 32, epoch 1's 12th)
    check(st["data"]["windows_per_epoch"] == 20 and st["data"]["epoch"] == 1 and st["data"]["slot"] == 12, st["data"])


def bad_rewards():
    """A reward program that fails, hangs or prints garbage stops the run; its checkpoint stays."""
    sft_model()
    base = GRPO + ["--generations", "4", "--batch", "8", "--eval-every", "0", "--save-every", "2", "--steps", "4"]
    counter = h.path("calls")
    # (it scores steps 1 and 2, then does what each case says)
    for case, then, words in (("fails", "echo 'no reward today' >&2; exit 3", ["exit", "no reward today"]),
                              ("hangs", "sleep 60", ["--reward-timeout", "1"]),
                              ("garbage", "echo not-a-number; cat > /dev/null", ["not-a-number"])):
        with open(h.path(f"{case}.sh"), "w") as f:
            f.write(f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}\n'
                    f'if [ "$n" -ge 2 ]; then {then}; fi\n'
                    "sed 's/.*/0.5/'\n")
        if os.path.exists(counter):
            os.remove(counter)
        _, _, err = h.run(base + ["--reward-command", f"sh {case}.sh", "--reward-timeout", "1", "--out", case], expect_rc=1,
                          what=f"a reward program that {case}")
        for w in words:
            check(w in err, f"a reward program that {case}: '{w}' is not in the message:\n{err[-2000:]}")
        check([c for c in h.checkpoints(case) if c.startswith("step-")] == ["step-00000002"], f"{case}: checkpoints {h.checkpoints(case)}")
        check(len(lines(case)) == 2, f"{case}: metrics.jsonl holds {len(lines(case))} lines")
        # (the checkpoint is whole: the run resumes from it once the program behaves)
        h.run(["--resume", "--steps", "3", "--out", case, "--reward-command", "sed 's/.*/1/'"], what=f"{case}: the resume")


def equal_groups():
    """Groups whose rewards are all equal teach nothing: counted; with --skip-equal-groups left out."""
    sft_model()
    base = [x for k, v in zip(GRPO[::2], GRPO[1::2]) if k != "--reward-answer" for x in (k, v)]
    for skip in ("false", "true"):
        h.run(base + ["--reward-format", r"[\s\S]*", "--generations", "4", "--batch", "8", "--steps", "3", "--eval-every", "0",
                      "--skip-equal-groups", skip, "--out", f"all-{skip}"])
        m = lines(f"all-{skip}")
        check(all(x["frac_reward_zero_std"] == 1 and x["reward"] == 1 and x["grad_norm"] == 0 for x in m),
              f"every completion scores 1 (--skip-equal-groups {skip}): {m}")


def refusals():
    """Options that do not go together are refused before a run folder is made."""
    sft_model()
    write_jsonl("no_answer.jsonl", [{"prompt": "1 plus 1 is"}, {"prompt": "2 plus 2 is", "answer": 4}])
    write_jsonl("long.jsonl", [{"prompt": "1 plus 1 is", "answer": 2}, {"prompt": "1 plus 1 is" * 3, "answer": 2},
                               {"prompt": "2 plus 1 is", "answer": 3}])
    defaults = {"--generations": "4", "--batch": "8", "--data": f"{BASE}/prompts.jsonl", "--reward-answer": REWARD}
    for args, words in (
            (["--kl-beta", "0.1"], "--kl-beta"),
            (["--batch", "6"], "--batch 6 must hold whole groups"),
            (["--generations", "1"], "--generations must be >= 2"),
            (["--temperature", "0.7"], "--temperature"),
            (["--updates-per-batch", "2"], "--updates-per-batch"),
            (["--reward-answer", "(unclosed"], "--reward-answer '(unclosed'"),
            (["--reward-format", "[", "--reward-weights", "1,0.5"], "--reward-format '['"),
            (["--reward-weights", "1,2,3"], "--reward-weights gives 3 weights for 1 rewards"),
            (["--reward-weights", "one"], "'one' is not a number"),
            (["--data", "no_answer.jsonl"], "training prompt 1 has none"),
            (["--data", "long.jsonl"], "give a larger --seq"),
            (["--pack", "true"], "--pack applies to training data"),
            (["--max-completion-tokens", "9"], "--max-completion-tokens 9"),
            (["--val-fraction", "3"], "--val-fraction must be in [0, 1)"),
    ):
        given = dict(zip(args[::2], args[1::2]))
        base = [x for k, v in zip(GRPO[::2], GRPO[1::2]) if k not in given and k not in defaults for x in (k, v)]
        extra = [x for k, v in defaults.items() if k not in given for x in (k, v)]
        _, _, err = h.run(base + extra + args + ["--steps", "2", "--out", "refused"], expect_rc=None)
        check(words in err, f"{args}: '{words}' is not in the message:\n{err[-2000:]}")
        check(not os.path.exists(h.path("refused")), f"{args}: a run folder was made before the refusal")
    _, _, err = h.run(["--objective", "grpo", "--model", f"{BASE}/sft", "--data", f"{BASE}/prompts.jsonl", "--backend", "cpu"],
                      expect_rc=None)
    check("needs a reward" in err, err[-2000:])
    _, _, err = h.run(["--reward-answer", REWARD, "--data", f"{BASE}/sums.txt", "--tokenizer", f"{BASE}/tok", "--vocab", "257",
                       "--backend", "cpu", "--steps", "1"], expect_rc=None)
    check("--reward-answer applies to --objective grpo" in err, err[-2000:])


if __name__ == "__main__":
    scenarios = [learns, resumes, bad_rewards, equal_groups, refusals]
    names = sys.argv[3:] or [f.__name__ for f in scenarios]
    shutil.rmtree(BASE, ignore_errors=True)
    for name in names:
        h.fresh()
        print(f"== {name}", flush=True)
        {f.__name__: f for f in scenarios}[name]()
    print("ok")
