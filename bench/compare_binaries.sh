#!/usr/bin/env bash
# Does a change cost anything? Two builds' bench_train on the same shapes, alternated in one call
# (the machine's clocks and the host's page cache alike for both), then a table of each shape's
# tokens/s and the ratio NEW / OLD.
#   bench/compare_binaries.sh OLD_BENCH_TRAIN NEW_BENCH_TRAIN OUT [SHAPE...]
# SHAPE is one of 1.5b, 7b, 8b, moe6, 7b-131k (default: all, in that order). Each shape runs OLD,
# NEW, OLD, NEW where ROUNDS=2 (the default), with exact clipping and a 120 GiB host budget.
# The table gives each shape's mean tokens/s and its peak GPU memory (the last round's), old and new.
# Logs go to OUT/<shape>-<old|new>-<round>.log; the table to OUT/table.md and standard output.
set -uo pipefail
OLD=$1 NEW=$2 OUT=$(mkdir -p "$3" && cd "$3" && pwd); shift 3
shapes=${*:-1.5b 7b 8b moe6 7b-131k}
rounds=${ROUNDS:-2}
args_of() {
  case $1 in
    1.5b) echo "--preset qwen2.5-1.5b --batch 32 --seq 1024 --steps 8 --skip 3" ;;
    7b) echo "--preset qwen2.5-7b --batch 32 --seq 1024 --steps 6 --skip 2" ;;
    8b) echo "--preset qwen3-8b --batch 32 --seq 1024 --steps 6 --skip 2" ;;
    moe6) echo "--preset qwen3-30b-a3b --layers 6 --batch 64 --seq 1024 --steps 8 --skip 3" ;;
    7b-131k) echo "--preset qwen2.5-7b --batch 1 --seq 131072 --steps 3 --skip 1" ;;
    *) echo "unknown shape $1" >&2; exit 2 ;;
  esac
}
tps() { grep -oP '\| tokens/s \(mean of \d+ steps\) \| \K[0-9]+' "$1" | head -1; }
gpu_peak() { grep -oP '^\| peak GPU memory [^|]*\| \K[^|]*[^| ]' "$1" | head -1; }
table="| shape | old tok/s | new tok/s | new / old | old peak GPU | new peak GPU |\n| --- | --- | --- | --- | --- | --- |\n"
for shape in $shapes; do
  read -r -a args <<< "$(args_of "$shape")"
  declare -A sum=([old]=0 [new]=0) n=([old]=0 [new]=0)
  runs=()
  for ((r = 1; r <= rounds; r++)); do
    for which in old new; do
      bin=$OLD; [[ $which == new ]] && bin=$NEW
      log="$OUT/$shape-$which-$r.log"
      MEGATRAIN_HOST_MEMORY=120G timeout 900 "$bin" "${args[@]}" --clip-mode exact > "$log" 2>&1
      t=$(tps "$log")
      echo "$shape $which round $r: ${t:-failed (see $log)} tok/s"
      runs+=("$which:${t:-0}")
      if [[ -n $t ]]; then sum[$which]=$((sum[$which] + t)); n[$which]=$((n[$which] + 1)); fi
    done
  done
  old=$(( n[old] ? sum[old] / n[old] : 0 )); new=$(( n[new] ? sum[new] / n[new] : 0 ))
  ratio=$(python3 -c "print(f'{$new/max($old,1):.3f}')")
  table+="| $shape ($(args_of "$shape")) | $old | $new | $ratio (${runs[*]}) | $(gpu_peak "$OUT/$shape-old-$rounds.log") | $(gpu_peak "$OUT/$shape-new-$rounds.log") |\n"
  unset sum n
done
printf "%b" "$table" | tee "$OUT/table.md"
