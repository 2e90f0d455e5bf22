#pragma once

// For the CUDA tests: skip when no CUDA device is usable, or fail instead when
// KVRELAY_REQUIRE_GPU=1 (bench/gpu_check.sh sets it, so a GPU machine never passes by skipping).

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "model/cuda/cuda_ops.h"

namespace kvrelay::model::cuda {

inline bool RequireGpu() {
  const char* v = std::getenv("KVRELAY_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace kvrelay::model::cuda

#define KV_SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                     \
    if (!::kvrelay::model::cuda::HaveDevice()) {                                           \
      if (::kvrelay::model::cuda::RequireGpu()) {                                          \
        FAIL() << "KVRELAY_REQUIRE_GPU=1 but no usable CUDA device";                       \
      }                                                                                    \
      GTEST_SKIP() << "no usable CUDA device (set KVRELAY_REQUIRE_GPU=1 to fail instead)"; \
    }                                                                                      \
  } while (false)
