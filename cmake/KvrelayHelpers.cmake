# kvrelay_cc_library / kvrelay_cc_binary / kvrelay_cc_test / kvrelay_cuda_library.
# Modelled on absl_cc_library: one target per folder, named kvrelay_<path> with alias
# kvrelay::<path>; warnings are errors on our own targets only.
include_guard(GLOBAL)

set(KVRELAY_WARNING_FLAGS -Wall -Wextra -Werror -Wno-missing-field-initializers)

function(_kvrelay_apply_common target)
  target_compile_features(${target} PUBLIC cxx_std_20)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KVRELAY_WARNING_FLAGS}>)
endfunction()

# kvrelay_cc_library(NAME n SRCS ... HDRS ... PUBLIC_DEPS ... PRIVATE_DEPS ... DEPS ...)
# DEPS is a synonym for PUBLIC_DEPS. A library with no SRCS becomes INTERFACE.
function(kvrelay_cc_library)
  cmake_parse_arguments(K "" "NAME" "SRCS;HDRS;DEPS;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  set(target kvrelay_${K_NAME})
  if(K_SRCS)
    add_library(${target} STATIC ${K_SRCS} ${K_HDRS})
    target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
    target_link_libraries(${target} PUBLIC ${K_DEPS} ${K_PUBLIC_DEPS} PRIVATE ${K_PRIVATE_DEPS})
    _kvrelay_apply_common(${target})
  else()
    add_library(${target} INTERFACE)
    target_include_directories(${target} INTERFACE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
    target_link_libraries(${target} INTERFACE ${K_DEPS} ${K_PUBLIC_DEPS})
    target_compile_features(${target} INTERFACE cxx_std_20)
  endif()
  add_library(kvrelay::${K_NAME} ALIAS ${target})
endfunction()

# kvrelay_cc_binary(NAME n SRCS ... DEPS ...) -> build/bin/<n>
function(kvrelay_cc_binary)
  cmake_parse_arguments(K "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${K_NAME} ${K_SRCS})
  target_link_libraries(${K_NAME} PRIVATE ${K_DEPS})
  _kvrelay_apply_common(${K_NAME})
  # Every binary is in the plain CI build (scripts/test.sh builds target plain_ci).
  set_property(GLOBAL APPEND PROPERTY KVRELAY_PLAIN_CI_TARGETS ${K_NAME})
  set_target_properties(${K_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
endfunction()

# kvrelay_cc_test(NAME n SRCS ... DEPS ... [LABELS ...] [TIMEOUT s] [RUN_SERIAL])
# Links GTest::gmock_main unless NO_MAIN is given.
function(kvrelay_cc_test)
  if(NOT KVRELAY_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(K "NO_MAIN;RUN_SERIAL" "NAME;TIMEOUT" "SRCS;DEPS;LABELS;ENV" ${ARGN})
  set(target ${K_NAME})
  add_executable(${target} ${K_SRCS})
  if(K_NO_MAIN)
    target_link_libraries(${target} PRIVATE ${K_DEPS} GTest::gmock)
  else()
    target_link_libraries(${target} PRIVATE ${K_DEPS} GTest::gmock GTest::gmock_main)
  endif()
  _kvrelay_apply_common(${target})
  if(KVRELAY_SANITIZE)
    # Test bodies at -O0 in sanitized trees: their gmock/gRPC-heavy sources compile ~2.5x
    # faster (e2e serving_test.cc: 15 s instead of 37 s of CPU under clang ASan), which is
    # most of the CI budget; the code under test keeps the tree's -O1.
    target_compile_options(${target} PRIVATE -O0)
  endif()
  set_target_properties(${target} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin/tests)
  add_test(NAME ${target} COMMAND ${target})
  if(NOT K_TIMEOUT)
    set(K_TIMEOUT 300)
  endif()
  if(KVRELAY_SANITIZE)
    # ASan + UBSan at -O1 runs the CPU model kernels 10-30x slower (model_runner_test: 5 s
    # plain, over 120 s sanitized); the bound stays a bound.
    math(EXPR K_TIMEOUT "${K_TIMEOUT} * 4")
  endif()
  set(env "KVRELAY_BIN_DIR=${PROJECT_BINARY_DIR}/bin" "KVRELAY_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
  if(KVRELAY_SANITIZE)
    list(APPEND env
      "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1"
      "LSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/tests/sanitizer/lsan.supp:print_suppressions=0"
      "TSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/tests/sanitizer/tsan.supp:halt_on_error=1"
      "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
  endif()
  list(APPEND env ${K_ENV})
  set_tests_properties(${target} PROPERTIES TIMEOUT ${K_TIMEOUT} ENVIRONMENT "${env}")
  if(K_LABELS)
    set_tests_properties(${target} PROPERTIES LABELS "${K_LABELS}")
  endif()
  # Tests about speed run on the plain build in CI (scripts/test.sh), not under ASan.
  if("timing" IN_LIST K_LABELS)
    set_property(GLOBAL APPEND PROPERTY KVRELAY_PLAIN_CI_TARGETS ${target})
  endif()
  if(K_RUN_SERIAL)
    set_tests_properties(${target} PROPERTIES RUN_SERIAL TRUE)
  endif()
endfunction()

# kvrelay_cuda_library(NAME n SRCS ... DEPS ...): only called from */cuda/ folders, which the
# top level adds only when CUDA is enabled.
function(kvrelay_cuda_library)
  cmake_parse_arguments(K "" "NAME" "SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target kvrelay_${K_NAME})
  add_library(${target} STATIC ${K_SRCS})
  target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(${target} PUBLIC ${K_DEPS} CUDA::cudart PRIVATE ${K_PRIVATE_DEPS})
  target_compile_features(${target} PUBLIC cxx_std_20)
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
                                             POSITION_INDEPENDENT_CODE ON)
  target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:${KVRELAY_WARNING_FLAGS}>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall>)
  add_library(kvrelay::${K_NAME} ALIAS ${target})
endfunction()
