# Warnings for megatrain's own targets (never forced on consumers). Errors only at top level.
function(megatrain_warnings target)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${MEGATRAIN_WERROR}>>:-Werror>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${MEGATRAIN_WERROR}>>:-Werror=all-warnings>)
endfunction()
