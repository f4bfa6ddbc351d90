#!/usr/bin/env bash
# Builds megatrain's libFuzzer targets (clang++, libFuzzer, ASan, UBSan) and runs them.
#
#   tests/fuzz/run_fuzz.sh WORK_DIR SECONDS [TARGET...]
#       A developer's run: builds (incrementally) in WORK_DIR, then fuzzes each TARGET (default:
#       every target, one after the other) for SECONDS seconds and runs its regression inputs.
#       E.g. `tests/fuzz/run_fuzz.sh build/fuzz 600 records` for a 10-minute run.
#   tests/fuzz/run_fuzz.sh --build WORK_DIR [extra cmake configure arguments...]
#   tests/fuzz/run_fuzz.sh --fuzz WORK_DIR SECONDS TARGET
#   tests/fuzz/run_fuzz.sh --regressions WORK_DIR TARGET
#       The three steps on their own (the CTest tests fuzz_build, fuzz_<target> and
#       fuzz_<target>_regressions run these).
#
# Targets: safetensors_header model_config cli_config token_file train_manifest records
# tokenizer_json chat_template (README.md says what each covers).
#
# WORK_DIR holds the nested build (WORK_DIR/build), the generated seeds (WORK_DIR/seeds/TARGET,
# regenerated each run), the growing corpus (WORK_DIR/corpus/TARGET, kept between runs) and crash
# artifacts (WORK_DIR/artifacts/TARGET-*). Each fuzzing run reads the corpus, the generated seeds
# and the committed ones (tests/fuzz/seeds/TARGET). A finding stops the run and is saved as an
# artifact: reproduce it with `WORK_DIR/build/fuzz_TARGET ARTIFACT`, fix it, and keep the input in
# tests/fuzz/regressions/TARGET/ (the regression step runs every file there once).
#
# Environment: CMAKE (cmake binary), MEGATRAIN_FUZZ_CXX (default clang++), MEGATRAIN_FUZZ_FLAGS
# (more libFuzzer flags, e.g. -jobs=2 or -only_ascii=1), MEGATRAIN_FUZZ_THREADS (oneTBB threads
# per process, default 1). Exits 77 (CTest: skipped) when
# clang++ or libFuzzer is missing (Debian: apt-get install clang libclang-rt-14-dev, or the -dev
# package of your clang's version), 0 when every run ended without a finding, 1 otherwise.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cmake="${CMAKE:-cmake}"
cxx="${MEGATRAIN_FUZZ_CXX:-clang++}"
all_targets=(safetensors_header model_config cli_config token_file train_manifest records tokenizer_json chat_template)

usage() {
  sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# clang++ and libFuzzer present, or exit 77.
probe() {
  local work=$1
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
}

build() {
  local work=$1
  shift
  probe "$work"
  "$cmake" -S "$here" -B "$work/build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE= "$@" > "$work/configure.log" \
    || { cat "$work/configure.log"; exit 1; }
  "$cmake" --build "$work/build"
}

known_target() {
  local t
  for t in "${all_targets[@]}"; do [[ $t == "$1" ]] && return 0; done
  echo "fuzz: unknown target '$1' (targets: ${all_targets[*]})" >&2
  exit 2
}

# The target's libFuzzer options: the longest input, its dictionary.
target_flags() {
  local max_len
  case $1 in
    tokenizer_json) max_len=65536 ;;
    chat_template) max_len=16384 ;;
    model_config | train_manifest | records) max_len=8192 ;;
    *) max_len=4096 ;;
  esac
  local flags=(-max_len=$max_len -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 -error_exitcode=1
               -timeout_exitcode=1)
  local dict="$here/$1.dict"
  [[ $1 == safetensors_header ]] && dict="$here/safetensors.dict"
  [[ -f $dict ]] && flags+=(-dict="$dict")
  echo "${flags[@]}"
}

# libFuzzer's default error exit code is 77, which CTest would read as "skipped": findings exit 1.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

binary() {
  local exe="$1/build/fuzz_$2"
  if [[ ! -x $exe ]]; then
    echo "fuzz: $exe is missing: build first (run_fuzz.sh --build $1)" >&2
    exit 1
  fi
  echo "$exe"
}

fuzz() {
  local work=$1 seconds=$2 target=$3
  known_target "$target"
  probe "$work"
  local exe
  exe=$(binary "$work" "$target")
  rm -rf "$work/seeds/$target"
  mkdir -p "$work/seeds/$target" "$work/corpus/$target" "$work/artifacts"
  if [[ $target == safetensors_header ]]; then
    "$work/build/make_safetensors_seeds" "$work/seeds/$target"
  else
    "$work/build/make_fuzz_seeds" "$target" "$work/seeds/$target" "$root"
  fi
  local corpora=("$work/corpus/$target" "$work/seeds/$target")
  [[ -d $here/seeds/$target ]] && corpora+=("$here/seeds/$target")
  # shellcheck disable=SC2046,SC2086
  "$exe" $(target_flags "$target") -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/$target-" ${MEGATRAIN_FUZZ_FLAGS:-} "${corpora[@]}"
}

regressions() {
  local work=$1 target=$2
  known_target "$target"
  probe "$work"
  local exe
  exe=$(binary "$work" "$target")
  local inputs=()
  if [[ -d $here/regressions/$target ]]; then
    while IFS= read -r -d '' f; do inputs+=("$f"); done \
      < <(find "$here/regressions/$target" -type f ! -name '*.md' -print0 | sort -z)
  fi
  if (( ${#inputs[@]} == 0 )); then
    echo "fuzz: no regression inputs for $target (tests/fuzz/regressions/$target/)"
    return 0
  fi
  echo "fuzz: $target: ${#inputs[@]} regression inputs"
  # shellcheck disable=SC2046
  "$exe" $(target_flags "$target") "${inputs[@]}"
}

case ${1:-} in
  --build)
    (( $# >= 2 )) || usage
    work=$2
    shift 2
    mkdir -p "$work"
    build "$work" "$@"
    ;;
  --fuzz)
    (( $# == 4 )) || usage
    fuzz "$2" "$3" "$4"
    ;;
  --regressions)
    (( $# == 3 )) || usage
    regressions "$2" "$3"
    ;;
  "" | -*) usage ;;
  *)
    (( $# >= 2 )) || usage
    work=$1 seconds=$2
    shift 2
    targets=("$@")
    (( ${#targets[@]} > 0 )) || targets=("${all_targets[@]}")
    for t in "${targets[@]}"; do known_target "$t"; done
    mkdir -p "$work"
    build "$work"
    for t in "${targets[@]}"; do
      echo "==== fuzz_$t: $seconds s"
      fuzz "$work" "$seconds" "$t"
      regressions "$work" "$t"
    done
    ;;
esac
