#pragma once

// A row-invariant GEMM for prefill: y[rows, out] = x[rows, in] * W^T with every output element
// defined as one FMA chain in a fixed order,
//   y[r, o] = fma(x[r, in-1], W[o, in-1], ... fma(x[r, 1], W[o, 1], fma(x[r, 0], W[o, 0], 0))),
// so a row's result depends only on that row and W: not on how many rows share the call, where
// a prefill started, how the work is split across threads, or which kernel ran (AVX-512, AVX2
// and the portable loop give the same bits). That is what lets a prefill issue one call over all
// its rows and still be bit-exact against a prefill resumed from cached prefix blocks, instead of
// cutting OpenBLAS calls into block-sized row tiles (each of which re-packs W).
//
// W is packed once, at model load: panels of kPanelColumns output columns, each stored
// [in][kPanelColumns] (zero-padded past `out`), so the kernel streams weights contiguously.
//
// Thread safety: PackedWeights is immutable after Pack; PackedLinear may run concurrently on
// the same weights.

#include <cstdint>
#include <vector>

namespace kvrelay::model {

class PackedWeights {
 public:
  static constexpr int64_t kPanelColumns = 32;

  PackedWeights() = default;
  // w: [out, in] row-major (a Hugging Face Linear weight), row stride ldw (0: in).
  static PackedWeights Pack(const float* w, int64_t out, int64_t in, int64_t ldw = 0);

  bool empty() const { return out_ == 0; }
  int64_t out() const { return out_; }
  int64_t in() const { return in_; }
  int64_t panels() const { return (out_ + kPanelColumns - 1) / kPanelColumns; }
  // Panel p: [in][kPanelColumns], columns p * kPanelColumns + j.
  const float* panel(int64_t p) const { return data_.data() + p * in_ * kPanelColumns; }
  int64_t bytes() const { return static_cast<int64_t>(data_.size() * sizeof(float)); }

 private:
  int64_t out_ = 0;
  int64_t in_ = 0;
  std::vector<float> data_;
};

// y[rows, w.out()] = x[rows, w.in()] * W^T as defined above. ldx/ldy: row strides (0: in, out).
// `threads` workers (the caller's thread is one of them).
void PackedLinear(const float* x, int64_t rows, const PackedWeights& w, float* y, int threads,
                  int64_t ldx = 0, int64_t ldy = 0);

// Which kernel PackedLinear runs: kAuto picks AVX-512 where the CPU has it, else the portable
// loop compiled for AVX2+FMA where the CPU has those, else the plain portable loop. Tests force
// the others to check all give the same bits (kAvx2 runs the plain loop without AVX2+FMA).
enum class PackedKernel { kAuto, kAvx2, kPortable };
void PackedLinearForTest(PackedKernel kernel, const float* x, int64_t rows, const PackedWeights& w,
                         float* y, int threads, int64_t ldx = 0, int64_t ldy = 0);
// The kernel kAuto runs on this CPU: "AVX-512", "AVX2+FMA" or "portable".
const char* PackedGemmKernelName();

}  // namespace kvrelay::model
