#!/usr/bin/env bash
# Trains with a megatrain-train binary on the CPU backend and keeps every step's exact figures
# (loss, gradient norm, learning rate, validation loss): the default run (no arguments), and
# --model on each fixture family of tests/fixtures (random token data of its vocabulary, every
# placement option left at its default). Run it with the binaries before and after a change and
# compare the two folders' figures: a change that must not alter the numerics gives the same
# file, byte for byte.
#   scripts/same_losses.sh MEGATRAIN_TRAIN OUT_DIR       (then: diff -r OUT_A/figures OUT_B/figures)
set -euo pipefail
T=$(realpath "$1"); OUT=$(mkdir -p "$2" && realpath "$2"); REPO=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$OUT/runs" "$OUT/figures"; mkdir -p "$OUT/runs" "$OUT/figures"
exact() {  # the fields that depend on the computation only
  python3 -c "
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print(json.dumps({k: m[k] for k in ('step', 'loss', 'grad_norm', 'lr', 'clip_coef', 'val_loss', 'aux_loss') if k in m}))
" "$1"
}
(cd "$OUT/runs" && "$T" --backend cpu --out default > default.log 2>&1)
exact "$OUT/runs/default/metrics.jsonl" > "$OUT/figures/default.jsonl"
python3 -c "
import random, struct
r = random.Random(7)
open('$OUT/runs/tokens.bin', 'wb').write(struct.pack('<%dH' % 40000, *[r.randrange(97) for _ in range(40000)]))"
for d in "$REPO"/tests/fixtures/*/; do
  name=$(basename "$d")
  (cd "$OUT/runs" && "$T" --model "$d" --backend cpu --data tokens.bin --batch 2 --seq 24 --steps 4 --eval-every 2 \
     --lr 1e-3 --out "$name" > "$name.log" 2>&1) || { echo "$name: failed (see $OUT/runs/$name.log)"; continue; }
  exact "$OUT/runs/$name/metrics.jsonl" > "$OUT/figures/$name.jsonl"
done
ls "$OUT/figures" | wc -l
