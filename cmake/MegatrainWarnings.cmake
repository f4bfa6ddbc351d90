# Warnings for megatrain's own targets (never forced on consumers). Errors only at top level.
function(megatrain_warnings target)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${MEGATRAIN_WERROR}>>:-Werror>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${MEGATRAIN_WERROR}>>:-Werror=all-warnings>)
endfunction()

# Tests and examples are compiled at -O1 in a Release build: a third faster to compile, as fast
# to run (their heavy work is the library's, compiled at the build type's level; measured:
# test_trainer 20 s at -O1, 22 s at -O3). Floating point is IEEE at every level (no fast-math, no
# contraction), so results do not change. The library, the programs and the benchmarks keep -O3.
function(megatrain_quick_build target)
  target_compile_options(${target} PRIVATE $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CONFIG:Release>>:-O1>)
endfunction()
