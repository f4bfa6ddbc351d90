#!/usr/bin/env python3
"""Sampling throughput: megatrain-generate against transformers' generate on the same random model,
the same prompts and the same GPU, greedy, every completion --new-tokens long where the model does
not end it (issue 58's item: the Qwen2.5-7B shape, 64 prompts x 512 new tokens).

    python3 bench/generate_peer.py --generate BIN/megatrain-generate --tokenizer DIR --work /tmp/gen \\
        [--preset qwen2.5-7b] [--layers N] [--prompts 64] [--new-tokens 512]

The model: the preset's shape (bench/peer_pytorch.py's PRESETS), random weights (seed 0), saved in
bf16 with --tokenizer's tokenizer.json. The peer, as strong as transformers makes it: the whole model
on the GPU in bf16, its static cache (with which generate compiles the forward itself, CUDA graphs
included), SDPA attention, the prompts left-padded in one batch; a warm-up generation
first (the compilation), then the timed one. megatrain-generate: the same folder and prompts, one
slot a prompt, its own progress figure (tokens over the seconds of generation, loading excluded).
Prints tokens/s of each and the ratio.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_pytorch import PRESETS  # noqa: E402


def make_model(args, folder):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(PRESETS[args.preset])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(args.tokenizer, f)):
            shutil.copy(os.path.join(args.tokenizer, f), folder)
    del model
    torch.cuda.empty_cache()


def peer(args, folder, prompts):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    # (a static cache: generate compiles the forward itself, with CUDA graphs: its compile_config)
    model.generation_config.cache_implementation = "static"
    batch = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    kw = dict(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        t0 = time.time()
        model.generate(**batch, **{**kw, "max_new_tokens": 16, "min_new_tokens": 16})  # (the compilation)
        warm = time.time() - t0
        torch.cuda.synchronize()
        t0 = time.time()
        out = model.generate(**batch, **kw)
        torch.cuda.synchronize()
        secs = time.time() - t0
    new = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return new / secs, secs, warm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--generate", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--peer-only", action="store_true")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    folder = os.path.join(args.work, "model")
    if not os.path.exists(os.path.join(folder, "config.json")):
        t0 = time.time()
        make_model(args, folder)
        print(f"model: {args.preset}{f' cut to {args.layers} layers' if args.layers else ''}, saved in {time.time() - t0:.0f} s",
              flush=True)
    topics = ["the sea", "a mountain", "an old clock", "the first winter", "a quiet town", "a lost key", "the river", "a small boat"]
    prompts = [f"Story {i}: write a long story about {topics[i % len(topics)]} and what happened next." for i in range(args.prompts)]
    pfile = os.path.join(args.work, "prompts.jsonl")
    with open(pfile, "w") as f:
        for t in prompts:
            f.write(json.dumps({"prompt": t}) + "\n")
    if args.peer_only:
        rate, secs, warm = peer(args, folder, prompts)
        print(f"transformers generate (static cache, compiled by generate, sdpa): {rate:.1f} tokens/s "
              f"({secs:.1f} s; warm-up {warm:.1f} s)")
        return
    # megatrain-generate first (the peer's compiled graphs would hold GPU memory)
    out = os.path.join(args.work, "completions.jsonl")
    cmd = [args.generate, "--model", folder, "--prompts", pfile, "--output", out, "--overwrite", "--max-new-tokens",
           str(args.new_tokens), "--temperature", "0", "--batch", str(args.prompts), "--backend", "cuda"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    sys.stderr.write(r.stderr[-3000:])
    if r.returncode != 0:
        print(f"megatrain-generate failed ({r.returncode})")
        sys.exit(1)
    rates = re.findall(r"([0-9.]+) tokens/s", r.stderr)
    tokens = sum(json.loads(line)["completion_tokens"] for line in open(out) if line.strip())
    mt = float(rates[-1]) if rates else float("nan")
    print(f"megatrain-generate: {tokens} tokens, {mt:.1f} tokens/s (generation), {wall:.1f} s with loading", flush=True)
    if args.skip_peer:
        return
    rate, secs, warm = peer(args, folder, prompts)
    print(f"transformers generate (static cache, compiled by generate, sdpa): {rate:.1f} tokens/s "
          f"({secs:.1f} s; warm-up {warm:.1f} s)")
    print(f"ratio megatrain / transformers: {mt / rate:.2f}")


if __name__ == "__main__":
    main()
