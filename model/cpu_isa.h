#pragma once

// Which of the CPU kernels' instruction sets this machine runs (model/packed_gemm.cc,
// model/attention_cpu.cc). Every kernel gives the same bits, so the choice is speed only.

namespace kvrelay::model {

enum class CpuIsa { kPortable, kAvx2, kAvx512 };

inline CpuIsa BestCpuIsa() {
  static const CpuIsa isa = __builtin_cpu_supports("avx512f") ? CpuIsa::kAvx512
                            : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                                ? CpuIsa::kAvx2
                                : CpuIsa::kPortable;
  return isa;
}

}  // namespace kvrelay::model
