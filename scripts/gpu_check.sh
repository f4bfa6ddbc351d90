#!/usr/bin/env bash
# Runs the GPU tests and the GPU measurements on a machine with an NVIDIA GPU, from binaries
# built elsewhere and copied to BIN (with libtbb/libfmt in BIN/../lib). Logs go to OUT.
#   scripts/gpu_check.sh BIN OUT [tests|hf|numerics|train|bench|bench7b|checkpoint|checkpoint7b|kernels|kernelclocks|packing|plan|probe|longctx|moe|qwen35|gptoss|nccl|dp|all]...
set -uo pipefail
BIN=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
what=${*:-all}
NV=$(python3 -c "import os,torch;print(os.path.dirname(torch.__path__[0]))" 2>/dev/null)/nvidia
export LD_LIBRARY_PATH=$BIN/../lib:$NV/cudnn/lib:$NV/nccl/lib:$NV/cu13/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
summary=()
has() { [[ " $what " == *" $1 "* || " $what " == *" all "* ]]; }
if has tests; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  for t in test_cuda_kernels test_cudnn_attention test_cuda_backend test_cuda_linear_attention test_cuda_trainer test_cuda_resume test_core; do
    start=$(date +%s)
    timeout 400 "$BIN/$t" > "$OUT/$t.log" 2>&1; rc=$?
    summary+=("$t rc=$rc $(( $(date +%s) - start ))s $(grep -E 'test cases:' "$OUT/$t.log" | tail -1)")
  done
fi
if has hf; then
  timeout 400 python3 tests/hf/hf_interop.py --megatrain "$BIN/megatrain-train" > "$OUT/hf_interop.log" 2>&1
  summary+=("hf_interop (transformers) rc=$? $(tail -1 "$OUT/hf_interop.log")")
fi
# bf16 numerics against PyTorch's autocast, both measured from an fp32 PyTorch run (docs/numerics.md).
if has numerics; then
  timeout 900 python3 tests/hf/numerics.py --megatrain "$BIN/megatrain-train" --work /tmp/mt-numerics \
    --report "$OUT/numerics.json" ${NUMERICS_ARGS:-} > "$OUT/numerics.log" 2>&1
  summary+=("numerics (bf16 vs autocast) rc=$? $(tail -1 "$OUT/numerics.log")")
fi
if has train; then
  (cd /tmp && timeout 300 "$BIN/megatrain-train" --out /tmp/mt-run --overwrite true > "$OUT/train_default.log" 2>&1)
  summary+=("megatrain-train (no arguments) rc=$? $(tail -1 "$OUT/train_default.log")")
  # tuned matrix products: a resumed run takes the checkpoint's algorithms, bit for bit
  timeout 300 python3 tests/cuda/gemm_resume.py --megatrain "$BIN/megatrain-train" > "$OUT/gemm_resume.log" 2>&1
  summary+=("megatrain-train resumed with its checkpoint's matrix-product algorithms rc=$? $(tail -1 "$OUT/gemm_resume.log")")
  # where gradients wait (--gradients auto): host memory on a small GPU, kept there when resumed
  timeout 300 python3 tests/cuda/gradient_home.py --megatrain "$BIN/megatrain-train" > "$OUT/gradient_home.log" 2>&1
  summary+=("megatrain-train --gradients auto on a capped GPU rc=$? $(tail -1 "$OUT/gradient_home.log")")
fi
# A shape at 32k tokens per step: megatrain without clipping and with exact clipping (placement:
# auto, as many units' AdamW state on the GPU as fit), then the PyTorch peer likewise (whole batch
# in one pass where it fits, its fastest attention, fused AdamW, and clip_grad_norm_ for the exact
# run), and the ratios. bench: the 1.5B shape; bench7b: the 7B shape (MEGATRAIN_HOST_MEMORY=120G).
tps() { grep -oP '\| tokens/s \(mean of \d+ steps\) \| \K[0-9]+' "$1"; }
peer_tps() { python3 -c "import json,sys;print(round(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['peer_tokens_per_s']))" "$1" 2>/dev/null; }
ratio() { python3 -c "print(f'{${1:-0}/max(${2:-0},1):.2f}')"; }
bench_shape() {  # preset tag steps skip peer_steps
  local preset=$1 tag=$2 steps=$3 skip=$4 psteps=$5
  for mode in none exact; do
    MEGATRAIN_HOST_MEMORY=120G timeout 590 "$BIN/bench_train" --preset "$preset" --batch 32 --seq 1024 --steps "$steps" \
      --skip "$skip" --clip-mode $mode > "$OUT/bench_${tag}_$mode.log" 2>&1
    summary+=("bench_train $preset clip $mode rc=$?: $(grep -E '^AdamW on the device' "$OUT/bench_${tag}_$mode.log")")
  done
  if [[ -z ${NO_PEER:-} ]]; then
    timeout 590 python3 bench/peer_pytorch.py --preset "$preset" --batch 32 --seq 1024 --steps "$psteps" --skip 2 > "$OUT/peer_${tag}_none.log" 2>&1
    timeout 590 python3 bench/peer_pytorch.py --preset "$preset" --batch 32 --seq 1024 --steps "$psteps" --skip 2 --clip 1.0 > "$OUT/peer_${tag}_exact.log" 2>&1
  fi
  local mt_n mt_e pe_n pe_e
  mt_n=$(tps "$OUT/bench_${tag}_none.log"); mt_e=$(tps "$OUT/bench_${tag}_exact.log")
  pe_n=$(peer_tps "$OUT/peer_${tag}_none.log"); pe_e=$(peer_tps "$OUT/peer_${tag}_exact.log")
  summary+=("$preset 32k tokens/step, no clipping: megatrain ${mt_n:-?} tok/s, PyTorch peer ${pe_n:-?} tok/s, ratio $(ratio "$mt_n" "$pe_n")")
  summary+=("$preset 32k tokens/step, exact clipping: megatrain ${mt_e:-?} tok/s ($(ratio "$mt_e" "$mt_n")x its unclipped), PyTorch peer ${pe_e:-?} tok/s, ratio $(ratio "$mt_e" "$pe_e")")
  summary+=("peer: $(grep -E '^peer: PyTorch' "$OUT/peer_${tag}_exact.log" | head -1)")
  for mode in none exact; do
    summary+=("$preset clip $mode: peak GPU memory $(grep -oP '^\| peak GPU memory [^|]*\| \K[^|]*[^| ]' "$OUT/bench_${tag}_$mode.log" || echo '?'), peak host memory $(grep -oP '^\| peak host memory [^|]*\| \K[^|]*[^| ]' "$OUT/bench_${tag}_$mode.log" || echo '?'), $(grep -oP '^\| plan: [^|]*\| \Kpredicted.*measured / predicted [0-9.]+' "$OUT/bench_${tag}_$mode.log" || echo '?'); $(grep -oP '^\| plan: GPU memory[^|]*\| \K[^|]*[^| ]' "$OUT/bench_${tag}_$mode.log" || echo '?'); host $(grep -oP '^\| plan: host memory[^|]*\| \K[^|]*[^| ]' "$OUT/bench_${tag}_$mode.log" || echo '?')")
  done
}
has bench && bench_shape qwen2.5-1.5b 1p5b 8 3 6
has bench7b && bench_shape qwen2.5-7b 7b 5 2 5
# The probe against the step (docs/planner.md): for each of PROBE_PRESETS, megatrain-plan --probe
# keeps this GPU's rates in a file of its own, then bench_train (exact clipping) plans and predicts
# with them and prints measured / predicted.
if [[ " $what " == *" probe "* ]]; then
  for preset in ${PROBE_PRESETS:-qwen2.5-0.5b qwen2.5-1.5b}; do
    export MEGATRAIN_MACHINE=$OUT/machine_$preset.json
    timeout 300 "$BIN/megatrain-plan" --preset "$preset" --batch 32 --seq 1024 --probe > "$OUT/probe_$preset.log" 2>&1
    summary+=("probe $preset rc=$?: $(tr -d '\n' < "$MEGATRAIN_MACHINE" 2>/dev/null | cut -c1-400)")
    MEGATRAIN_HOST_MEMORY=120G timeout 400 "$BIN/bench_train" --preset "$preset" --batch 32 --seq 1024 --steps 8 --skip 3 \
      --clip-mode exact --timeline > "$OUT/bench_probe_$preset.log" 2>&1
    summary+=("bench_train $preset exact (probed figures) rc=$?: $(tps "$OUT/bench_probe_$preset.log") tok/s; $(grep -oP '^\| plan: [^|]*\| \Kpredicted.*measured / predicted [0-9.]+' "$OUT/bench_probe_$preset.log" || echo '?')")
    unset MEGATRAIN_MACHINE
  done
fi
# The planner on this GPU (docs/planner.md): megatrain-plan for the shapes measured here, then its
# prediction against bench_train (which prints both) at long context: the 7B shape at LONG_SEQ
# (default 262144; no clipping: exact clipping's waiting gradients do not fit beside the
# checkpoints on a 128 GiB host), and the 1.5B shape at 1,048,576 tokens cut to LONG_LAYERS
# (default 4) layers, as a whole step of all 28 outlasts a command's 10 minutes.
if [[ " $what " == *" plan "* ]]; then
  for args in "--preset qwen2.5-7b --batch 32 --seq 1024" "--preset qwen2.5-1.5b --batch 32 --seq 1024" \
              "--preset qwen2.5-7b --batch 1 --seq 262144 --clip 0" "--preset qwen2.5-7b --batch 1 --seq 262144" \
              "--preset qwen2.5-1.5b --batch 1 --seq 1048576 --clip 0"; do
    MEGATRAIN_HOST_MEMORY=120G timeout 120 "$BIN/megatrain-plan" $args >> "$OUT/plan.log" 2>&1
    summary+=("megatrain-plan $args rc=$?: $(grep -E '^(fits|plan:)' "$OUT/plan.log" | tail -1 | cut -c1-200)")
  done
fi
if [[ " $what " == *" longctx "* ]]; then
  MEGATRAIN_HOST_MEMORY=120G timeout 590 "$BIN/bench_train" --preset qwen2.5-7b --batch 1 --seq "${LONG_SEQ:-262144}" \
    --steps "${LONG_STEPS:-2}" --skip 1 > "$OUT/long_7b.log" 2>&1
  summary+=("bench_train 7b seq ${LONG_SEQ:-262144} rc=$?" "$(grep -E '^(plan:|host store)|^\| (tokens/s|step time|model TFLOP|MFU|plan|peak)' "$OUT/long_7b.log")")
fi
if [[ " $what " == *" longctx1m "* ]]; then
  MEGATRAIN_HOST_MEMORY=120G timeout 590 "$BIN/bench_train" --preset qwen2.5-1.5b --layers "${LONG_LAYERS:-4}" --batch 1 \
    --seq 1048576 --steps 1 --skip 0 > "$OUT/long_1p5b_1m.log" 2>&1
  summary+=("bench_train 1.5b 1M tokens ${LONG_LAYERS:-4} layers rc=$?" "$(grep -E '^(plan:|host store|step)|^\| (tokens/s|step time|model TFLOP|MFU|plan|peak)' "$OUT/long_1p5b_1m.log")")
fi
# Train-state checkpoints (docs/checkpointing.md): the disk's own sequential write rate (dd, 4 GiB,
# fsync'd), then a checkpoint saved while training goes on and loaded back (bench_train
# --save-dir). They are written beside the working tree (not /tmp, which may be memory).
# checkpoint7b: the 7B shape cut to --layers 8 (35 GB), as the whole 7B state (91 GB) does not
# fit on a 64 GiB disk.
if has checkpoint || [[ " $what " == *" checkpoint7b "* ]]; then
  CK=$PWD/.ckpt-bench; rm -rf "$CK"; mkdir -p "$CK"
  df -hT "$CK" > "$OUT/disk.txt"
  dd if=/dev/zero of="$CK/raw" bs=64M count=64 conv=fsync 2> "$OUT/dd.txt"; rm -f "$CK/raw"
  summary+=("disk: $(tail -1 "$OUT/dd.txt"); $(tail -1 "$OUT/disk.txt")")
fi
if has checkpoint; then
  timeout 500 "$BIN/bench_train" --preset qwen2.5-1.5b --batch 32 --seq 1024 --steps 14 --skip 3 --save-dir "$CK/1p5b" \
    --save-at 5 > "$OUT/checkpoint_1p5b.log" 2>&1
  summary+=("checkpoint qwen2.5-1.5b rc=$?" "$(grep -E '^\| (tokens/s|checkpoint|steps while|load)' "$OUT/checkpoint_1p5b.log")")
  rm -rf "$CK/1p5b"
fi
if [[ " $what " == *" checkpoint7b "* ]]; then
  MEGATRAIN_HOST_MEMORY=120G timeout 590 "$BIN/bench_train" --preset qwen2.5-7b --layers 8 --batch 32 --seq 1024 --steps 10 \
    --skip 2 --save-dir "$CK/7b" --save-at 3 > "$OUT/checkpoint_7b_8layers.log" 2>&1
  summary+=("checkpoint qwen2.5-7b, 8 of 28 layers rc=$?" "$(grep -E '^(qwen|host store)|^\| (tokens/s|checkpoint|steps while|load)' "$OUT/checkpoint_7b_8layers.log")")
  rm -rf "$CK/7b"
fi
# Mixtures of experts (docs/models.md): the Qwen3-30B-A3B shape cut to each of MOE_LAYERS layers
# (default 6; e.g. "6 12") at 64k tokens per step with exact clipping, and for the first of them
# the PyTorch peer (the model on the GPU, transformers' grouped_mm experts, fused AdamW, the fewest
# passes that fit) in the same call.
if [[ " $what " == *" moe "* ]]; then
  for ml in ${MOE_LAYERS:-6}; do
  MEGATRAIN_HOST_MEMORY=120G timeout 500 "$BIN/bench_train" --preset qwen3-30b-a3b --layers "$ml" --batch 64 --seq 1024 \
    --steps 6 --skip 2 --clip-mode exact > "$OUT/bench_moe_${ml}layers.log" 2>&1
  summary+=("bench_train qwen3-30b-a3b, $ml layers, 64k tokens, exact rc=$?: $(grep -E '^\| tokens/s' "$OUT/bench_moe_${ml}layers.log")")
  summary+=("  $(grep -oP '^\| plan: [^|]*\| \Kpredicted.*measured / predicted [0-9.]+' "$OUT/bench_moe_${ml}layers.log" || echo 'plan ?')")
  if [[ -z ${NO_PEER:-} && $ml == "${MOE_LAYERS%% *}" ]]; then
    timeout 500 python3 bench/peer_pytorch.py --preset qwen3-30b-a3b --layers "$ml" --batch 64 --seq 1024 --steps 5 --skip 2 \
      --clip 1.0 > "$OUT/peer_moe_${ml}layers.log" 2>&1
    mt=$(tps "$OUT/bench_moe_${ml}layers.log"); pe=$(peer_tps "$OUT/peer_moe_${ml}layers.log")
    summary+=("qwen3-30b-a3b $ml layers 64k exact: megatrain ${mt:-?} tok/s, PyTorch peer ${pe:-?} tok/s, ratio $(ratio "$mt" "$pe")")
    summary+=("peer: $(grep -E '^peer: PyTorch' "$OUT/peer_moe_${ml}layers.log" | head -1)")
  fi
  done
fi
# Qwen3.5 (docs/models.md, issue 57): the Qwen3.5-27B shape cut to Q35_LAYERS layers (default 20,
# the most a 120 GiB host holds: three Gated DeltaNet layers to one gated attention layer) at 32k
# tokens per step, exact clipping, against the PyTorch peer with transformers' Qwen3.5 in the same
# call (dense); the Qwen3.5-35B-A3B shape cut to Q35_MOE_LAYERS (default 8) at 64k tokens likewise
# (moe); and the dense Qwen3-8B shape, whose model TFLOP/s the hybrid's are compared with (8b).
# Q35_PARTS picks among dense, moe and 8b (default all three); Q35_PEER_ARGS adds options to the peer.
if [[ " $what " == *" qwen35 "* ]]; then
  ql=${Q35_LAYERS:-20} qm=${Q35_MOE_LAYERS:-8} parts=${Q35_PARTS:-dense moe 8b}
  for args in "dense qwen3.5-27b $ql 32" "moe qwen3.5-35b-a3b $qm 64"; do
    read -r part preset nl batch <<< "$args"
    [[ " $parts " == *" $part "* ]] || continue
    tag=${preset//./}_${nl}
    MEGATRAIN_HOST_MEMORY=120G timeout 500 "$BIN/bench_train" --preset "$preset" --layers "$nl" --batch "$batch" --seq 1024 \
      --steps 5 --skip 2 --clip-mode exact > "$OUT/bench_$tag.log" 2>&1
    summary+=("bench_train $preset, $nl layers, ${batch}k tokens, exact rc=$?: $(grep -E '^\| (tokens/s|model TFLOP)' "$OUT/bench_$tag.log" | tr '\n' ' ')")
    summary+=("  $(grep -oP '^\| plan: [^|]*\| \Kpredicted.*measured / predicted [0-9.]+' "$OUT/bench_$tag.log" || echo 'plan ?')")
    if [[ -z ${NO_PEER:-} ]]; then
      # (Q35_PEER_ARGS: the peer's configuration where it is known, e.g. "--micro 4 --checkpoint-layers 4
      # --attention flash" for the 8-layer cut on an H100: its search compiles each candidate, 400 s and more)
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 timeout 500 python3 bench/peer_pytorch.py --preset "$preset" --layers "$nl" --batch "$batch" --seq 1024 \
        --steps 4 --skip 2 --clip 1.0 ${Q35_PEER_ARGS:-} > "$OUT/peer_$tag.log" 2>&1
      mt=$(tps "$OUT/bench_$tag.log"); pe=$(peer_tps "$OUT/peer_$tag.log")
      summary+=("$preset $nl layers ${batch}k exact: megatrain ${mt:-?} tok/s, PyTorch peer ${pe:-?} tok/s, ratio $(ratio "$mt" "$pe")")
      summary+=("peer: $(grep -E '^peer: PyTorch' "$OUT/peer_$tag.log" | head -1)")
    fi
  done
  if [[ " $parts " == *" 8b "* ]]; then
    MEGATRAIN_HOST_MEMORY=120G timeout 300 "$BIN/bench_train" --preset qwen3-8b --batch 32 --seq 1024 --steps 5 --skip 2 \
      --clip-mode exact > "$OUT/bench_qwen3_8b.log" 2>&1
    summary+=("bench_train qwen3-8b 32k exact rc=$?: $(grep -E '^\| (tokens/s|model TFLOP)' "$OUT/bench_qwen3_8b.log" | tr '\n' ' ')")
  fi
fi
# GPT-OSS (docs/models.md): the gpt-oss-20b shape cut to GPTOSS_LAYERS layers (default 4; half of
# them sliding, every attention with sinks) at 64k tokens per step, exact clipping, against its plan.
if [[ " $what " == *" gptoss "* ]]; then
  gl=${GPTOSS_LAYERS:-4}
  MEGATRAIN_HOST_MEMORY=120G timeout 500 "$BIN/bench_train" --preset gpt-oss-20b --layers "$gl" --batch 64 --seq 1024 \
    --steps 6 --skip 2 --clip-mode exact > "$OUT/bench_gptoss_${gl}layers.log" 2>&1
  summary+=("bench_train gpt-oss-20b, $gl layers, 64k tokens, exact rc=$?: $(grep -E '^\| tokens/s' "$OUT/bench_gptoss_${gl}layers.log")")
  summary+=("  $(grep -oP '^\| plan: [^|]*\| \Kpredicted.*measured / predicted [0-9.]+' "$OUT/bench_gptoss_${gl}layers.log" || echo 'plan ?')")
fi
# Several GPUs (docs/distributed.md): NCCL across NCCL_RANKS processes (default 2), the unique id
# through the rendezvous; needs as many GPUs (kind nvidia-h100-x2 / nvidia-h200-x2).
if [[ " $what " == *" nccl "* ]]; then
  NCCL_NVLS_ENABLE=0 timeout 300 bash tests/cuda/run_ranks.sh "${NCCL_RANKS:-2}" "$BIN/test_dist_nccl" > "$OUT/nccl.log" 2>&1
  summary+=("test_dist_nccl ${NCCL_RANKS:-2} ranks rc=$?: $(grep -c 'exact' "$OUT/nccl.log") ranks exact")
fi
# megatrain-train on 2 GPUs (docs/distributed.md): the trainer's test over NCCL (replicated and
# ZeRO-1) as 2 processes and as 2 threads of one, then the program on one GPU and two (2
# processes, and one process: --gpus 2): the same run, and the speed.
if [[ " $what " == *" dp "* ]]; then
  NCCL_NVLS_ENABLE=0 timeout 300 bash tests/cuda/run_ranks.sh 2 "$BIN/test_dist_train_cuda" > "$OUT/dist_train_cuda.log" 2>&1
  summary+=("test_dist_train_cuda 2 ranks rc=$?: $(grep -c 'within' "$OUT/dist_train_cuda.log") runs compared")
  # (the same test with its 2 ranks as threads of one process: megatrain-train --gpus 2's way)
  MEGATRAIN_TEST_THREADS=2 NCCL_NVLS_ENABLE=0 MEGATRAIN_COLLECTIVE_TIMEOUT=120 timeout 300 "$BIN/test_dist_train_cuda" \
    > "$OUT/dist_train_cuda_threads.log" 2>&1
  summary+=("test_dist_train_cuda 2 ranks as threads rc=$?: $(grep -c 'within' "$OUT/dist_train_cuda_threads.log") runs compared")
  timeout 240 bash tests/cuda/killed_rank_nccl.sh "$BIN/test_dist_train_cuda" > "$OUT/killed_rank_nccl.log" 2>&1
  summary+=("killed_rank_nccl rc=$?: $(tail -1 "$OUT/killed_rank_nccl.log")")
  timeout 900 python3 bench/data_parallel.py --megatrain "$BIN/megatrain-train" --work /tmp/mt-dp ${DP_ARGS:-} \
    > "$OUT/data_parallel.log" 2>&1
  summary+=("data_parallel rc=$? $(tail -1 "$OUT/data_parallel.log")")
fi
# Packing (docs/data.md): examples/s with one example per sequence and with --pack true, the
# 1.5B shape on synthetic instruction data of mixed lengths.
if [[ " $what " == *" packing "* ]]; then
  timeout 500 python3 bench/packing.py --megatrain "$BIN/megatrain-train" --seq 2048 --batch 16 --steps 12 \
    --work /tmp/mt-packing > "$OUT/packing.log" 2>&1
  summary+=("packing rc=$? $(tail -1 "$OUT/packing.log")")
fi
# Where the GPU time goes: every kernel of one step of the 1.5B shape cut to 2 layers (the head
# and two blocks), timed by Nsight Compute (ncu, from the CUDA toolkit), summarised by kind.
if [[ " $what " == *" kernels "* ]]; then
  timeout 400 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv --print-units base \
    "$BIN/bench_train" --preset qwen2.5-1.5b --layers 2 --batch 32 --seq 1024 --steps 1 --skip 0 \
    > "$OUT/ncu_1p5b_2layers.csv" 2> "$OUT/ncu.err"
  summary+=("ncu qwen2.5-1.5b 2 layers rc=$?")
  python3 "$(dirname "$0")/kernel_table.py" "$OUT/ncu_1p5b_2layers.csv" | tee "$OUT/kernels.md"
fi
# The same at the GPU's own clocks (ncu locks them to base by default), the second step of the
# 1.5B shape cut to one layer (after the first step's tuning of the products), and PyTorch's
# matmul at a block's shapes on the same GPU.
if [[ " $what " == *" kernelclocks "* ]]; then
  timeout 400 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    "$BIN/bench_train" --preset qwen2.5-1.5b --layers 1 --batch 32 --seq 1024 --steps 2 --skip 0 \
    > "$OUT/ncu_clocks_1p5b_1layer.csv" 2> "$OUT/ncu_clocks.err"
  summary+=("ncu (own clocks) qwen2.5-1.5b 1 layer rc=$?")
  python3 "$(dirname "$0")/kernel_table.py" "$OUT/ncu_clocks_1p5b_1layer.csv" --last-step | tee "$OUT/kernels_clocks.md"
  timeout 200 python3 "$(dirname "$0")/../bench/gemm_shapes.py" > "$OUT/gemm_shapes.log" 2>&1
  summary+=("bench/gemm_shapes.py rc=$? $(grep -m1 "a block's products" "$OUT/gemm_shapes.log")")
fi
echo "===== summary"
printf '%s\n' "${summary[@]}"
