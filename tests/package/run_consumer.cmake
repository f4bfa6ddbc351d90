# cmake -DMODE=find_package|subdirectory -DSOURCE_DIR=... -DBUILD_DIR=... -DWORK_DIR=... -DGENERATOR=...
#       -P run_consumer.cmake
# Installs megatrain from BUILD_DIR into WORK_DIR/prefix (find_package mode; with -DPROGRAM=name
# the installed program must be there and train), then configures, builds and runs
# tests/package/consumer against it.
file(REMOVE_RECURSE "${WORK_DIR}")
set(consumer_args)
if(MODE STREQUAL "find_package")
  execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix"
                  RESULT_VARIABLE rc OUTPUT_QUIET)
  if(rc)
    message(FATAL_ERROR "cmake --install failed (${rc})")
  endif()
  list(APPEND consumer_args "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
  if(DEFINED PROGRAM)
    # The installed program, run from the prefix as a user would: two steps of a tiny model.
    set(exe "${WORK_DIR}/prefix/bin/${PROGRAM}")
    foreach(installed "${exe}" "${WORK_DIR}/prefix/bin/megatrain-tokenize" "${WORK_DIR}/prefix/bin/megatrain-report")
      if(NOT EXISTS "${installed}")
        message(FATAL_ERROR "cmake --install did not install ${installed}")
      endif()
    endforeach()
    execute_process(COMMAND "${exe}" --hidden 32 --layers 1 --heads 2 --kv-heads 1 --intermediate 64 --batch 2 --seq 16
                            --steps 2 --backend cpu --out "${WORK_DIR}/run"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(rc OR NOT EXISTS "${WORK_DIR}/run/metrics.jsonl")
      message(FATAL_ERROR "the installed ${PROGRAM} failed (${rc}):\n${out}")
    endif()
    # The installed megatrain-report on that run folder (its own report.html, if any, removed first).
    file(REMOVE "${WORK_DIR}/run/report.html")
    execute_process(COMMAND "${WORK_DIR}/prefix/bin/megatrain-report" "${WORK_DIR}/run"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(rc OR NOT EXISTS "${WORK_DIR}/run/report.html")
      message(FATAL_ERROR "the installed megatrain-report failed (${rc}):\n${out}")
    endif()
  endif()
else()
  # The CUDA part is covered by the main build; keep this one quick. The FetchContent fallback is
  # on: every dependency is installed, so it must find them all and download nothing.
  list(APPEND consumer_args "-DMEGATRAIN_SOURCE_DIR=${SOURCE_DIR}" -DMEGATRAIN_CUDA=OFF
       -DMEGATRAIN_FETCH_DEPENDENCIES=ON)
endif()
# The subdirectory mode compiles the library again: without optimisation (a third of -O3's time;
# the consumer's few AdamW steps need no speed). The installed one was built as the main build.
set(build_type Release)
if(MODE STREQUAL "subdirectory")
  set(build_type None)
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/package/consumer" -B "${WORK_DIR}/build"
                        -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=${build_type} -DMEGATRAIN_CONSUMER_MODE=${MODE} ${consumer_args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(rc)
  message(FATAL_ERROR "configuring the consumer failed (${rc})")
endif()
if(out MATCHES "megatrain: [^ ]+ not found; fetching")
  message(FATAL_ERROR "the consumer's configure downloaded a dependency that is installed")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed (${rc})")
endif()
execute_process(COMMAND "${WORK_DIR}/build/consumer" RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer program failed (${rc})")
endif()
