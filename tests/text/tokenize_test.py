#!/usr/bin/env python3
"""megatrain-tokenize end to end, with a hand-made byte-level tokenizer.json (ids worked out by
hand): JSONL, JSON and text inputs, the end-of-text token, the output width, bad lines refused
with file and line or skipped and counted, nothing left behind by a refused run, and a
megatrain-train run on the output.

    tokenize_test.py TOKENIZE_BIN TRAIN_BIN WORK_DIR
"""
import json
import os
import struct
import subprocess
import sys

from checks import check, finish, start

tokenize, train, work = sys.argv[1:4]
work = start(work)


def byte_char(b):
    n = 0
    for x in range(256):
        own = 33 <= x <= 126 or 161 <= x <= 172 or 174 <= x <= 255
        cp = x if own else 256 + n
        n += 0 if own else 1
        if x == b:
            return chr(cp)


def write_tokenizer(folder, vocab_size=None):
    """Byte ids 0-255, "he" 256, "ll" 257, <|endoftext|> 258 (special)."""
    os.makedirs(folder, exist_ok=True)
    vocab = {byte_char(b): b for b in range(256)}
    vocab["he"], vocab["ll"] = 256, 257
    tok = {
        "added_tokens": [{"id": 258, "content": "<|endoftext|>", "special": True, "normalized": False,
                          "lstrip": False, "rstrip": False, "single_word": False}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": ["h e", "l l"]},
    }
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    if vocab_size is not None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"vocab_size": vocab_size}, f)


def run(prog, args, rc=0):
    p = subprocess.run([prog] + args, cwd=work, capture_output=True, text=True)
    check(p.returncode == rc, f"{os.path.basename(prog)} {' '.join(args)}: exit {p.returncode}, expected {rc}\n{p.stderr}")
    return p.stdout + p.stderr


def ids(path, width):
    data = open(os.path.join(work, path), "rb").read()
    return list(struct.unpack(f"<{len(data) // width}{'H' if width == 2 else 'I'}", data))


tok = os.path.join(work, "tok")
write_tokenizer(tok)
O = ord("o")
hello = [256, 257, O]  # "hello" -> he ll o

# JSONL: one document per line, blank lines ignored, <|endoftext|> after each
with open(os.path.join(work, "a.jsonl"), "w") as f:
    f.write('{"text": "hello"}\n\n{"text": "hell", "id": 7}\n')
out = run(tokenize, ["--tokenizer", tok, "--input", "a.jsonl", "--output", "a.bin"])
check("2 documents, 7 tokens (uint16" in out, f"summary: {out}")
check(ids("a.bin", 2) == hello + [258, 256, 257, 258], f"a.bin: {ids('a.bin', 2)}")

# another field, no end-of-text, uint32
with open(os.path.join(work, "b.jsonl"), "w") as f:
    f.write('{"body": "hello"}\n')
run(tokenize, ["--tokenizer", tok, "--input", "b.jsonl", "--output", "b.bin", "--field", "body", "--eos", "none",
               "--width", "u32"])
check(ids("b.bin", 4) == hello, f"b.bin: {ids('b.bin', 4)}")

# JSON array and a text file (one document)
with open(os.path.join(work, "c.json"), "w") as f:
    json.dump([{"text": "hello"}, {"text": "o"}], f)
run(tokenize, ["--tokenizer", os.path.join(tok, "tokenizer.json"), "--input", "c.json", "--output", "c.bin"])
check(ids("c.bin", 2) == hello + [258, O, 258], f"c.bin: {ids('c.bin', 2)}")
# a JSON array is read element by element (streamed): brackets, braces, commas and escaped
# quotes inside strings, nested values, a byte order mark and white space are its elements' own
tricky = '\ufeff [ {"text": "he]l,l}o", "meta": {"a": [1, {"b": "\\"]"}]}} ,\n\t{"text": "o\\"o"}\n]\n'
with open(os.path.join(work, "t.json"), "w", encoding="utf-8") as f:
    f.write(tricky)
out = run(tokenize, ["--tokenizer", tok, "--input", "t.json", "--output", "t.bin", "--eos", "none"])
want_t = [256, ord("]"), ord("l"), ord(","), ord("l"), ord("}"), O] + [O, ord('"'), O]
check(ids("t.bin", 2) == want_t, f"t.bin: {ids('t.bin', 2)} vs {want_t}\n{out}")
for name, text, why in [("e.json", "[]", "holds no document"),
                        ("u.json", '[{"text": "hello"}, {"text": "o"', "ends before its array closes"),
                        ("x.json", '[{"text": "hello"}] {"text": "o"}', "more after the array's closing bracket"),
                        ("o.json", '{"text": "hello"}', "must be an array of records")]:
    with open(os.path.join(work, name), "w") as f:
        f.write(text)
    err = run(tokenize, ["--tokenizer", tok, "--input", name, "--output", name + ".bin"], rc=1)
    check(why in err, f"{name}: {err}")
    check(not os.path.exists(os.path.join(work, name + ".bin")), f"{name}: a refused run left its output")
with open(os.path.join(work, "badel.json"), "w") as f:
    f.write('[{"text": "hello"}, {"text": }, {"text": "o"}]')
err = run(tokenize, ["--tokenizer", tok, "--input", "badel.json", "--output", "badel.bin"], rc=1)
check("badel.json: element 1: not JSON" in err, f"a malformed element: {err}")

with open(os.path.join(work, "d.txt"), "w") as f:
    f.write("hello hello")
run(tokenize, ["--tokenizer", tok, "--input", "d.txt", "--output", "d.bin", "--eos", "258"])
check(ids("d.bin", 2) == hello + [32, 256, 257, O, 258], f"d.bin: {ids('d.bin', 2)}")  # " hello": a space byte, he, ll, o

# bad lines: refused with file and line, nothing written; or skipped and counted
with open(os.path.join(work, "bad.jsonl"), "w") as f:
    f.write('{"text": "hello"}\n{"text": "hel\n["list"]\n{"text": ""}\n{"text": 3}\n{"text": "o"}\n')
err = run(tokenize, ["--tokenizer", tok, "--input", "bad.jsonl", "--output", "bad.bin"], rc=1)
check("bad.jsonl:2: not JSON" in err and "--skip-bad-lines" in err, f"bad line 2: {err}")
check(not any(n.startswith("bad.bin") for n in os.listdir(work)), f"a refused run left files: {os.listdir(work)}")
out = run(tokenize, ["--tokenizer", tok, "--input", "bad.jsonl", "--output", "bad.bin", "--skip-bad-lines"])
check("bad lines skipped: 4" in out, f"skipped count: {out}")

# Not UTF-8: the first bad byte named, a sequence cut short by the line's end included.
with open(os.path.join(work, "latin1.jsonl"), "wb") as f:
    f.write(b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": "ok"} \xef\n')
err = run(tokenize, ["--tokenizer", tok, "--input", "latin1.jsonl", "--output", "latin1.bin"], rc=1)
check("latin1.jsonl:2: not UTF-8 (byte 0xe9 at column 14" in err, f"a Latin-1 byte: {err}")
out = run(tokenize, ["--tokenizer", tok, "--input", "latin1.jsonl", "--output", "latin1.bin", "--skip-bad-lines"])
check("bad lines skipped: 2" in out, f"two lines not UTF-8 skipped: {out}")
with open(os.path.join(work, "cut.jsonl"), "wb") as f:
    f.write(b'{"text": "ok"}\n{"text": "ok"} \xef\n')
err = run(tokenize, ["--tokenizer", tok, "--input", "cut.jsonl", "--output", "cut.bin"], rc=1)
check("cut.jsonl:2: not UTF-8 (byte 0xef at column 16" in err, f"a sequence cut short by the line's end: {err}")
check(ids("bad.bin", 2) == hello + [258, O, 258], f"bad.bin: {ids('bad.bin', 2)}")
with open(os.path.join(work, "empty.jsonl"), "w") as f:
    f.write('{"text": ""}\n')
err = run(tokenize, ["--tokenizer", tok, "--input", "empty.jsonl", "--output", "e.bin"], rc=1)
check("empty.jsonl:1: the field 'text' is empty" in err, f"empty field: {err}")

# an existing output is kept unless --overwrite
err = run(tokenize, ["--tokenizer", tok, "--input", "a.jsonl", "--output", "a.bin"], rc=1)
check("--output 'a.bin' exists; pass --overwrite" in err, f"existing output: {err}")
run(tokenize, ["--tokenizer", tok, "--input", "b.jsonl", "--output", "a.bin", "--field", "body", "--overwrite"])
check(ids("a.bin", 2) == hello + [258], f"overwritten a.bin: {ids('a.bin', 2)}")

# the model's vocabulary: smaller than the tokenizer's is refused; larger than 65,536 makes uint32
small = os.path.join(work, "small")
write_tokenizer(small, vocab_size=200)
err = run(tokenize, ["--tokenizer", small, "--input", "a.jsonl", "--output", "s.bin"], rc=1)
check("has 259 ids but the model's vocabulary is 200" in err, f"vocab check: {err}")
big = os.path.join(work, "big")
write_tokenizer(big, vocab_size=70000)
out = run(tokenize, ["--tokenizer", big, "--input", "a.jsonl", "--output", "w.bin"])
check("uint32" in out and ids("w.bin", 4) == hello + [258, 256, 257, 258], f"uint32 by the model's vocabulary: {out}")
err = run(tokenize, ["--tokenizer", tok, "--input", "a.jsonl", "--output", "x.bin", "--eos", "<nope>"], rc=1)
check("--eos '<nope>' is neither a token" in err, f"bad --eos: {err}")

# megatrain-train trains on the output
with open(os.path.join(work, "train.jsonl"), "w") as f:
    for i in range(300):
        f.write(json.dumps({"text": f"hello {i} hell {i * i} oh hello"}) + "\n")
run(tokenize, ["--tokenizer", tok, "--input", "train.jsonl", "--output", "train.bin"])
out = run(train, ["--data", "train.bin", "--vocab", "259", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                  "--intermediate", "64", "--batch", "2", "--seq", "16", "--steps", "2", "--backend", "cpu", "--out", "run"])
check(os.path.exists(os.path.join(work, "run", "metrics.jsonl")), f"training on the token file: {out}")

finish("megatrain-tokenize")
