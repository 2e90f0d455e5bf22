#pragma once

// Attention of several query vectors over the same keys and values (one KV head), computed so
// that each query's result is defined by that query alone: for query q over context
// [first, last],
//   s_j  = (fma chain over d = 0..qk_dim-1 of q[d] * k_j[d], from 0) * scale, soft-capped,
//   e_j  = exp(s_j - max s) (our own FMA polynomial, ~1 ulp, the same in both kernels),
//   sum  = 16 partial sums over (j - first) % 16 in j order, added pairwise ((0+1)+(2+3))+...,
//   out  = (fma chain over j = first..last of e_j * v_j, from 0) * (1 / sum).
// Queries are processed four at a time (AVX-512: 16 keys or 16 output values per vector), but
// a query's bits do not depend on which queries share its block, how many rows a prefill has,
// where it started or the thread split; the AVX2 and portable loops give the same bits. This
// replaces one AttendOne per (row, head) in prefill and decode.

#include <cstdint>

namespace kvrelay::model {

struct AttentionQuery {
  const float* q;  // [qk_dim]
  float* out;      // [v_dim]
  int64_t first;   // context keys [first, last], positions in the key/value buffers
  int64_t last;
};

// Extra readable floats AttendQueries may load past `last` in each keys_t row.
inline constexpr int64_t kAttentionKeyPadding = 64;

// keys_t: the KV head's keys transposed, key j's value d at keys_t[d * keys_t_stride + j];
// values: value j at values + j * v_stride (v_dim floats). scratch: 4 * keys_t_stride floats.
// REQUIRES: count >= 1; last + kAttentionKeyPadding <= keys_t_stride for every query. Keys
// outside a query's context but inside its block's get weight 0 in the value chain, which
// leaves it unchanged for finite values (up to the sign of a result that is exactly zero).
void AttendQueries(const AttentionQuery* queries, int64_t count, int32_t qk_dim,
                   const float* keys_t, int64_t keys_t_stride, const float* values,
                   int64_t v_stride, int32_t v_dim, float scale, float softcap, float* scratch);

// kAuto: AVX-512 where the CPU has it, else the portable loop compiled for AVX2+FMA where it
// has those, else the plain portable loop (kAvx2 runs the plain loop without AVX2+FMA).
enum class AttentionKernel { kAuto, kAvx2, kPortable };
void AttendQueriesForTest(AttentionKernel kernel, const AttentionQuery* queries, int64_t count,
                          int32_t qk_dim, const float* keys_t, int64_t keys_t_stride,
                          const float* values, int64_t v_stride, int32_t v_dim, float scale,
                          float softcap, float* scratch);

}  // namespace kvrelay::model
