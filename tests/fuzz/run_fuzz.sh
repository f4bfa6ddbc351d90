#!/usr/bin/env bash
# Builds the safetensors header fuzzer (clang++, libFuzzer, ASan, UBSan) and runs it.
#
#   tests/fuzz/run_fuzz.sh [WORK_DIR [SECONDS [extra cmake configure arguments...]]]
#
# WORK_DIR (default build/fuzz) holds the nested build, the seed corpus (regenerated each run),
# the growing corpus (kept between runs) and any crash artifacts. Environment: CMAKE (cmake
# binary), MEGATRAIN_FUZZ_CXX (default clang++). Exits 77 (CTest: skipped) when clang++ or
# libFuzzer is missing (Debian: apt-get install clang libclang-rt-14-dev, or the -dev package of
# your clang's version), 0 when the fuzzer ran its time without a finding, 1 otherwise.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${1:-$here/../../build/fuzz}"
seconds="${2:-20}"
shift $(( $# < 2 ? $# : 2 ))
cmake="${CMAKE:-cmake}"
cxx="${MEGATRAIN_FUZZ_CXX:-clang++}"

if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz: skipped: $cxx not found (apt-get install clang libclang-rt-14-dev)"
  exit 77
fi
mkdir -p "$work/probe"
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
  > "$work/probe/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$work/probe/probe.cpp" -o "$work/probe/probe" \
     > "$work/probe/log" 2>&1; then
  cat "$work/probe/log"
  echo "fuzz: skipped: $cxx cannot link libFuzzer (apt-get install libclang-rt-14-dev, for clang 14)"
  exit 77
fi

"$cmake" -S "$here" -B "$work/build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" > "$work/configure.log" \
  || { cat "$work/configure.log"; exit 1; }
"$cmake" --build "$work/build"

rm -rf "$work/seeds"
mkdir -p "$work/seeds" "$work/corpus" "$work/artifacts"
"$work/build/make_safetensors_seeds" "$work/seeds"

# libFuzzer's default error exit code is 77, which CTest would read as "skipped": make findings 1.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
exec "$work/build/fuzz_safetensors_header" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -error_exitcode=1 -timeout_exitcode=1 -print_final_stats=1 \
  -dict="$here/safetensors.dict" -artifact_prefix="$work/artifacts/" \
  "$work/corpus" "$work/seeds"
