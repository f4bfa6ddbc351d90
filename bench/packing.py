#!/usr/bin/env python3
"""The throughput gain of packing (megatrain-train --pack) on fine-tuning data of mixed lengths.

Writes a token file of examples (FILE.bin with FILE.mask and FILE.idx, as megatrain-tokenize
writes them) whose lengths follow a log-normal spread like instruction data (median ~256
tokens, 16 to 2048; the first 40% of each example is prompt), then trains the same model on
it with one example per sequence (padded) and with packing, and prints examples/s and trained
tokens/s of both and their ratio. Both runs see the same examples and the same loss per example
(attention stays within each); packing only removes the padding.

  python3 bench/packing.py --megatrain build/release/examples/megatrain-train \
      [--preset qwen2.5-1.5b] [--seq 2048] [--batch 16] [--steps 12] [--work /tmp/mt-packing]
"""
import argparse, json, math, os, random, re, struct, subprocess, sys, time


def write_examples(path, n, vocab, seed):
    rng = random.Random(seed)
    wide = vocab > 65536
    idx, tokens, masks = [0], bytearray(), bytearray()
    for _ in range(n):
        length = int(min(2048, max(16, rng.lognormvariate(math.log(256), 0.9))))
        prompt = max(1, int(0.4 * length))
        ids = [rng.randrange(vocab) for _ in range(length)]
        tokens += struct.pack(f"<{length}{'I' if wide else 'H'}", *ids)
        masks += bytes([0] * prompt + [1] * (length - prompt))
        idx.append(idx[-1] + length)
    with open(path, "wb") as f:
        f.write(tokens)
    with open(path + ".mask", "wb") as f:
        f.write(masks)
    with open(path + ".idx", "wb") as f:
        f.write(struct.pack(f"<{len(idx)}q", *idx))
    return idx


def run(args, pack, data, out):
    cmd = [args.megatrain] + (["--preset", args.preset] if args.preset else []) + ["--data", data, "--seq", str(args.seq), "--batch", str(args.batch),
           "--steps", str(args.steps), "--pack", "true" if pack else "false", "--eval-every", "0", "--eval-batches", "1",
           "--lr", "1e-5", "--out", out, "--overwrite", "true"] + args.extra
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(f"--- {' '.join(cmd)} ({time.time() - t0:.0f} s, rc {p.returncode})\n")
    if p.returncode != 0:
        sys.stdout.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise SystemExit(f"megatrain-train failed (pack={pack})")
    m = re.search(r"examples: (\d+) for training.*?(\d+) trained tokens of (\d+).*?(packed into (\d+) sequences|one example per sequence)",
                  p.stdout)
    kept, labels, rows = int(m.group(1)), int(m.group(2)), int(m.group(5)) if m.group(5) else int(m.group(1))
    steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    timed = [s["step_time_s"] for s in steps[args.skip:]]
    step_s = sum(timed) / len(timed)
    examples_per_step = args.batch * kept / rows
    return {"pack": pack, "rows": rows, "kept": kept, "step_s": step_s,
            "examples_per_s": examples_per_step / step_s,
            "trained_tokens_per_s": labels / kept * examples_per_step / step_s,
            "tokens_per_s": args.batch * args.seq / step_s, "last_loss": steps[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatrain", required=True)
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--vocab", type=int, default=151936, help="the preset's vocabulary (ids are drawn below it)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the timing")
    ap.add_argument("--examples", type=int, default=6000)
    ap.add_argument("--work", default="/tmp/mt-packing")
    ap.add_argument("extra", nargs="*", help="more megatrain-train options (after --)")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    data = os.path.join(args.work, "sft.bin")
    idx = write_examples(data, args.examples, args.vocab, 1)
    lengths = sorted(b - a for a, b in zip(idx, idx[1:]))
    print(f"data: {args.examples} examples, lengths {lengths[0]}..{lengths[-1]}, median {lengths[len(lengths) // 2]}, "
          f"mean {sum(lengths) / len(lengths):.0f} tokens")
    r = [run(args, False, data, os.path.join(args.work, "padded")), run(args, True, data, os.path.join(args.work, "packed"))]
    print(f"| {args.preset}, --seq {args.seq} --batch {args.batch} | one example per sequence | packed (--pack true) | ratio |")
    print("| --- | --- | --- | --- |")
    for key, label in [("rows", "sequences per epoch"), ("step_s", "seconds per step"),
                       ("examples_per_s", "examples/s"), ("trained_tokens_per_s", "trained tokens/s"),
                       ("tokens_per_s", "tokens/s (padding included)")]:
        a, b = r[0][key], r[1][key]
        fmt = (lambda v: f"{v:,.0f}") if key in ("rows", "trained_tokens_per_s", "tokens_per_s") else (lambda v: f"{v:,.3f}")
        print(f"| {label} | {fmt(a)} | {fmt(b)} | {b / a:.2f} |")
    print(f"packing: {r[1]['examples_per_s'] / r[0]['examples_per_s']:.2f}x the examples per second")


if __name__ == "__main__":
    main()
