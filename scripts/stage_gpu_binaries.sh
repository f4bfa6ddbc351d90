#!/usr/bin/env bash
# Stages a CUDA build for scripts/gpu_check.sh on a GPU machine that has the NVIDIA driver, the
# CUDA libraries and PyTorch (whose wheel brings cuDNN) but not this project's other dependencies.
# Copies the GPU tests, the benchmarks, megatrain-train, megatrain-plan and test_core into DEST/bin, and the shared
# libraries they load (ldd) other than the C/C++ runtime and the CUDA/cuDNN libraries (libtbb,
# libfmt, libbenchmark) into DEST/lib, where gpu_check.sh puts them on LD_LIBRARY_PATH. Then
#   scripts/gpu_check.sh DEST/bin OUT [tests|hf|train|bench|bench7b|kernels|all]...
# works there. DEST/bin and DEST/lib are replaced.
#   scripts/stage_gpu_binaries.sh BUILD_DIR DEST      (e.g. build/release .devbuild)
set -euo pipefail
if [[ $# -ne 2 || -z $1 || -z $2 ]]; then
  echo "usage: $0 BUILD_DIR DEST" >&2
  exit 2
fi
BUILD=$1
DEST=$2
binaries=(tests/cuda/test_cuda_kernels tests/cuda/test_cudnn_attention tests/cuda/test_cuda_backend tests/cuda/test_cuda_linear_attention
          tests/cuda/test_cuda_trainer tests/cuda/test_cuda_resume bench/bench_train bench/bench_adamw examples/megatrain-train examples/megatrain-plan
          tests/unit/test_core tests/cuda/test_dist_nccl tests/cuda/test_dist_train_cuda tests/dist/test_dist_launch)
for b in "${binaries[@]}"; do
  if [[ ! -x $BUILD/$b ]]; then
    echo "$BUILD/$b is missing: build a CUDA configuration with cuDNN (cmake --preset release on a machine" \
         "with the CUDA toolkit and cuDNN), then 'cmake --build --preset release'" >&2
    exit 1
  fi
done
# Loaded from the system or the GPU machine's CUDA / PyTorch installation: not copied.
provided='^(linux-vdso|ld-linux[-a-z0-9_]*|libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|libcudart|libcublas|libcublasLt|libcudnn[a-z_]*|libcuda|libnvrtc|libnvJitLink|libnccl)\.so'
rm -rf "${DEST:?}/bin" "${DEST:?}/lib"
mkdir -p "$DEST/bin" "$DEST/lib"
declare -A libs=()
for b in "${binaries[@]}"; do
  cp "$BUILD/$b" "$DEST/bin/"
  while read -r name arrow path _; do
    name=${name##*/}  # the loader appears as a path
    [[ $name =~ $provided ]] && continue
    if [[ $arrow != "=>" || $path == "not" ]]; then
      echo "$b: ldd cannot resolve $name" >&2
      exit 1
    fi
    libs[$name]=$path
  done < <(ldd "$BUILD/$b" | sed 's/^[[:space:]]*//')
done
for name in "${!libs[@]}"; do
  cp -L "${libs[$name]}" "$DEST/lib/$name"  # under its soname, the name the binaries ask for
done
echo "staged ${#binaries[@]} binaries in $DEST/bin and ${#libs[@]} libraries in $DEST/lib:"
(cd "$DEST/lib" && ls)
