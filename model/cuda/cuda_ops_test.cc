// Each CUDA kernel against its CPU reference (model/cpu_ops.h) with the tolerance stated in
// cuda_ops.h. Skips when the machine has no usable GPU.

#include "model/cuda/cuda_ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kv/fp8.h"
#include "kv/presets.h"
#include "model/cpu_ops.h"
#include "model/cuda/skip_without_gpu.h"
#include "model/kv_cache.h"
#include "model/numeric.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::model::cuda {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  uint32_t x = seed * 2654435761u + 7;
  for (float& f : v) {
    x = x * 1664525u + 1013904223u;
    f = scale * (static_cast<float>((x >> 8) & 0xffff) / 32768.0f - 1.0f);
  }
  return v;
}

// Device copy of a host vector, freed on destruction.
template <typename T>
class Dev {
 public:
  explicit Dev(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(1, n_) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit Dev(size_t n) : Dev(std::vector<T>(n)) {}
  ~Dev() { cudaFree(p_); }
  T* get() const { return static_cast<T*>(p_); }
  std::vector<T> Host() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

double MaxRelErr(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(double{got[i]} - want[i]));
    scale = std::max(scale, std::abs(double{want[i]}));
  }
  return diff / scale;
}

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override { KV_SKIP_WITHOUT_GPU(); }
};

TEST_F(CudaOpsTest, RmsNormMatchesCpu) {
  const int64_t rows = 7;
  const int32_t dim = 300;
  const std::vector<float> x = Random(rows * dim, 1), w = Random(dim, 2);
  std::vector<float> want(rows * dim);
  model::RmsNorm(x.data(), rows, dim, w.data(), 1e-6f, want.data());
  Dev<float> dx(x), dw(w), dout(static_cast<size_t>(rows * dim));
  KV_ASSERT_OK(RmsNorm(dx.get(), rows, dim, dw.get(), 1e-6f, dout.get(), 0, 0, nullptr));
  EXPECT_LE(MaxRelErr(dout.Host(), want), 1e-5);
}

TEST_F(CudaOpsTest, RopeMatchesCpuBothStyles) {
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    const int64_t rows = 5;
    const int32_t heads = 3, dim = 64;
    const int64_t row_stride = heads * dim + 10;  // padding between rows
    std::vector<float> x = Random(rows * row_stride, 3);
    const std::vector<int64_t> pos = {0, 1, 17, 1000, 4095};
    Dev<float> dx(x);
    Dev<int64_t> dpos(pos);
    ApplyRope(x.data(), rows, heads, dim, row_stride, dim, pos.data(), 10000.0, style);
    KV_ASSERT_OK(
        Rope(dx.get(), rows, heads, dim, row_stride, dim, dpos.get(), 10000.0, style, nullptr));
    const std::vector<float> got = dx.Host();
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(got[i], x[i], 2e-6 * 2) << i;
  }
}

TEST_F(CudaOpsTest, GatedActivationsMatchCpu) {
  for (bool gelu : {false, true}) {
    const int64_t rows = 3, n = 1000;
    const std::vector<float> a = Random(rows * n, 4, 4.0f), b = Random(rows * n, 5);
    std::vector<float> want = a;
    if (gelu) {
      GeluTanhMul(want.data(), b.data(), rows * n);
    } else {
      SiluMul(want.data(), b.data(), rows * n);
    }
    Dev<float> da(a), db(b);
    KV_ASSERT_OK(GatedActivation(da.get(), db.get(), rows, n, n, n, gelu, nullptr));
    EXPECT_LE(MaxRelErr(da.Host(), want), 1e-6);
  }
}

// Write K/V (or MLA entries) into paged units on the device, copy the pool back and compare
// byte for byte with the CPU runner's KvCache writes; then gather back and compare values.
void CheckCacheRoundTrip(const char* preset, kv::DType dtype) {
  kv::ConfigOptions options;
  options.dtype = dtype;
  options.block_tokens = 4;
  absl::StatusOr<kv::ModelConfig> config = kv::LoadPreset(preset, options);
  ASSERT_TRUE(config.ok()) << config.status();
  const kv::ModelLayout& layout = config->layout;
  absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(layout, 6);
  ASSERT_TRUE(cache.ok());
  const kv::LayerGroup& g = layout.groups()[0];
  const bool mla = g.kind == kv::LayerKind::kMlaLatent;
  const int64_t width = mla ? g.latent_dim + g.rope_dim : int64_t{g.num_kv_heads} * g.head_dim;
  const int32_t layer = g.layer_ids[1];
  const int64_t rows = 10;
  const std::vector<float> k = Random(rows * width, 6), v = Random(rows * width, 7);
  // Sequence blocks: slots 5, 2, 4 (positions 0..11), rows at positions 1..10.
  const std::vector<int32_t> table = {5, 2, 4};
  std::vector<int64_t> pos(rows);
  std::vector<int32_t> tables;
  for (int64_t r = 0; r < rows; ++r) {
    pos[r] = r + 1;
    tables.insert(tables.end(), table.begin(), table.end());
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int kv_i = 0; kv_i < (mla ? 1 : 2); ++kv_i) {
      StoreCacheValues((kv_i == 0 ? k : v).data() + r * width, width, dtype,
                       (*cache)->EntryAddress(layer, table[pos[r] / 4], pos[r] % 4, kv_i));
    }
  }
  const size_t pool_bytes = 6 * layout.BlockBytes(0);
  Dev<uint8_t> pool(std::vector<uint8_t>(pool_bytes, 0));
  Dev<float> dk(k), dv(v);
  Dev<int64_t> dpos(pos);
  Dev<int32_t> dtables(tables);
  const PagedLayer paged = MakePagedLayer(layout, 0, 1, pool.get(), layout.BlockBytes(0));
  KV_ASSERT_OK(WriteCache(paged, dk.get(), mla ? nullptr : dv.get(), width, width, width, rows,
                          dpos.get(), dtables.get(), 3, nullptr));
  const std::vector<uint8_t> got = pool.Host();
  for (int32_t slot : table) {
    ASSERT_EQ(std::memcmp(got.data() + slot * layout.BlockBytes(0),
                          (*cache)->pool(0).SlotAddress(slot), layout.BlockBytes(0)),
              0)
        << preset << " slot " << slot;
  }
  // Gather positions 1..10 back.
  std::vector<const uint8_t*> units(3);
  for (int b = 0; b < 3; ++b) {
    units[b] = static_cast<const uint8_t*>((*cache)->pool(0).SlotAddress(table[b]));
  }
  std::vector<float> want_k(rows * width), want_v(rows * width);
  GatherLayer(layout, 0, 1, units, 1, 11, want_k.data(), mla ? nullptr : want_v.data());
  Dev<float> gk(static_cast<size_t>(rows * width)), gv(static_cast<size_t>(rows * width));
  Dev<int32_t> dtable(table);
  KV_ASSERT_OK(
      GatherCache(paged, dtable.get(), 1, 11, width, gk.get(), mla ? nullptr : gv.get(), nullptr));
  EXPECT_EQ(gk.Host(), want_k);
  if (!mla) {
    EXPECT_EQ(gv.Host(), want_v);
  }
}

TEST_F(CudaOpsTest, CacheWriteAndGatherAreBitExact) {
  for (kv::DType dtype : {kv::DType::kBf16, kv::DType::kFp16, kv::DType::kFp32}) {
    CheckCacheRoundTrip("tiny-llama", dtype);
    CheckCacheRoundTrip("tiny-deepseek-v3", dtype);
  }
}

// PagedAttention over `pool_host` (blocks in `table` order) for four query rows against
// AttendOne on `kbuf` / `vbuf`, the same cache read on the host (MLA: keys only).
void ExpectPagedAttentionMatchesHost(const kv::ModelLayout& layout, int32_t heads,
                                     const std::vector<uint8_t>& pool_host,
                                     const std::vector<int32_t>& table, int64_t ctx, int64_t window,
                                     const std::vector<float>& kbuf, const std::vector<float>& vbuf,
                                     const std::string& label) {
  const kv::LayerGroup& g = layout.groups()[0];
  const bool mla = g.kind == kv::LayerKind::kMlaLatent;
  const int32_t kv_heads = mla ? 1 : g.num_kv_heads;
  const int64_t width = mla ? g.latent_dim + g.rope_dim : int64_t{kv_heads} * g.head_dim;
  const int32_t qk_dim = mla ? static_cast<int32_t>(width) : g.head_dim;
  const int32_t v_dim = mla ? g.latent_dim : g.head_dim;
  const int64_t n_blocks = static_cast<int64_t>(table.size());
  const std::vector<int64_t> pos = {0, 5, 14, ctx - 1};
  const int64_t rows = static_cast<int64_t>(pos.size());
  const std::vector<float> q = Random(rows * heads * qk_dim, 9);
  const float scale = 0.125f;
  std::vector<float> want(rows * heads * v_dim), scratch(ctx);
  const float* vbase = mla ? kbuf.data() : vbuf.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t off = first * width + (mla ? 0 : (h / (heads / kv_heads)) * g.head_dim);
      AttendOne(q.data() + (r * heads + h) * qk_dim, qk_dim, kbuf.data() + off, width, vbase + off,
                width, v_dim, pos[r] - first + 1, scale, scratch.data(),
                want.data() + (r * heads + h) * v_dim);
    }
  }
  Dev<uint8_t> pool(pool_host);
  Dev<float> dq(q), dout(static_cast<size_t>(rows * heads * v_dim)),
      dscratch(static_cast<size_t>(rows * heads * ctx));
  Dev<int64_t> dpos(pos);
  std::vector<int32_t> tables;
  for (int64_t r = 0; r < rows; ++r) tables.insert(tables.end(), table.begin(), table.end());
  Dev<int32_t> dtables(tables);
  AttentionParams p;
  p.q = dq.get();
  p.q_row_stride = int64_t{heads} * qk_dim;
  p.heads = heads;
  p.group_size = heads / kv_heads;
  p.qk_dim = qk_dim;
  p.v_dim = v_dim;
  p.window = window;
  p.scale = scale;
  p.rows = rows;
  p.positions = dpos.get();
  p.block_tables = dtables.get();
  p.max_blocks = static_cast<int32_t>(n_blocks);
  p.max_context = ctx;
  p.scratch = dscratch.get();
  p.out = dout.get();
  KV_ASSERT_OK(
      PagedAttention(MakePagedLayer(layout, 0, 0, pool.get(), layout.BlockBytes(0)), p, nullptr));
  EXPECT_LE(MaxRelErr(dout.Host(), want), 2e-5) << label << " window " << window;
}

// Paged attention (GQA with and without a window, and MLA-shaped) against GatherLayer +
// AttendOne on the same cache bytes.
void CheckAttention(const char* preset, int64_t window) {
  kv::ConfigOptions options;
  options.block_tokens = 4;
  absl::StatusOr<kv::ModelConfig> config = kv::LoadPreset(preset, options);
  ASSERT_TRUE(config.ok());
  const kv::ModelLayout& layout = config->layout;
  const kv::LayerGroup& g = layout.groups()[0];
  const bool mla = g.kind == kv::LayerKind::kMlaLatent;
  const int32_t kv_heads = mla ? 1 : g.num_kv_heads;
  const int64_t width = mla ? g.latent_dim + g.rope_dim : int64_t{kv_heads} * g.head_dim;
  const int64_t ctx = 23;
  const int64_t n_blocks = (ctx + 3) / 4;
  // Random cache contents for slots 0..n_blocks-1, in reverse order in the table.
  std::vector<uint8_t> pool_host(n_blocks * layout.BlockBytes(0));
  {
    const std::vector<float> values =
        Random(static_cast<int64_t>(pool_host.size() / kv::DTypeBytes(layout.dtype())), 8);
    StoreCacheValues(values.data(), static_cast<int64_t>(values.size()), layout.dtype(),
                     pool_host.data());
  }
  std::vector<int32_t> table(n_blocks);
  for (int64_t b = 0; b < n_blocks; ++b) table[b] = static_cast<int32_t>(n_blocks - 1 - b);
  // CPU reference.
  std::vector<const uint8_t*> units(n_blocks);
  for (int64_t b = 0; b < n_blocks; ++b) {
    units[b] = pool_host.data() + table[b] * layout.BlockBytes(0);
  }
  std::vector<float> kbuf(ctx * width), vbuf(ctx * width);
  GatherLayer(layout, 0, 0, units, 0, ctx, kbuf.data(), mla ? nullptr : vbuf.data());
  ExpectPagedAttentionMatchesHost(layout, config->num_attention_heads, pool_host, table, ctx,
                                  window, kbuf, vbuf, preset);
}

TEST_F(CudaOpsTest, PagedAttentionMatchesCpu) {
  CheckAttention("tiny-llama", 0);
  CheckAttention("tiny-llama", 6);
  CheckAttention("tiny-deepseek-v3", 0);
}

// ---- FP8 KV: the kernels against kv/fp8.h evaluated on the host, as the CPU model uses it.

// Three KV heads of 40 values (not a multiple of a warp), two layers, 4-token blocks; MLA with
// a 200-value latent (a full and a partial 128-value tile) and a 6-value rope key.
kv::ModelLayout Fp8Layout(bool mla) {
  kv::LayerGroup g;
  g.layer_ids = {0, 1};
  if (mla) {
    g.kind = kv::LayerKind::kMlaLatent;
    g.latent_dim = 200;
    g.rope_dim = 6;
  } else {
    g.kind = kv::LayerKind::kFullAttention;
    g.num_kv_heads = 3;
    g.head_dim = 40;
  }
  absl::StatusOr<kv::ModelLayout> layout =
      kv::ModelLayout::Create(mla ? "fp8-mla" : "fp8-gqa", kv::DType::kFp8, 4, {g});
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

// Rows with what E4M3 must get right: NaN and ±inf (left out of every amax), float subnormals,
// -0, values far past 448 * scale at a block's later tokens (saturate), an all-zero head (or
// tile) at a block's first token.
std::vector<float> Fp8Rows(const std::vector<int64_t>& pos, int64_t width, uint32_t seed) {
  std::vector<float> x = Random(static_cast<int64_t>(pos.size()) * width, seed, 3.0f);
  for (size_t r = 0; r < pos.size(); ++r) {
    float* row = x.data() + r * width;
    row[1] = r % 2 == 0 ? NAN : -NAN;
    row[2] = r % 3 == 0 ? INFINITY : -INFINITY;
    row[3] = 1e-39f;
    row[4] = -0.0f;
    row[6] = 3.0f * std::ldexp(1.0f, -14);
    if (pos[r] % 4 != 0) row[5] = r % 2 == 0 ? 1e6f : -1e6f;
    if (pos[r] % 4 == 0) std::fill(row + 40, row + 80, 0.0f);  // head 1, or part of tile 0
    if (width > 200) std::fill(row + 128, row + 200, pos[r] == 4 ? 0.0f : row[128]);
  }
  return x;
}

int32_t ExpOfScale(float scale) { return std::ilogb(scale); }  // scales are powers of two

// The units as the CPU writes them, with kv/fp8.h: rows in position order, attention scales
// fixed by each block's first token, MLA tile scales per entry, the rope key in bf16.
void HostFp8Write(const kv::ModelLayout& layout, int32_t li, const std::vector<float>& k,
                  const std::vector<float>& v, int64_t width, const std::vector<int64_t>& pos,
                  const std::vector<int32_t>& table, std::vector<uint8_t>& pool) {
  const kv::LayerGroup& g = layout.groups()[0];
  const int64_t bt = layout.block_tokens();
  for (size_t r = 0; r < pos.size(); ++r) {
    uint8_t* unit = pool.data() + table[pos[r] / bt] * layout.BlockBytes(0);
    const int64_t t = pos[r] % bt;
    if (g.kind == kv::LayerKind::kMlaLatent) {
      uint8_t* entry = unit + (li * bt + t) * layout.MlaEntryBytes(0);
      const float* x = k.data() + r * width;
      for (int64_t b = 0; b < g.latent_dim; b += kv::kFp8MlaTile) {
        const int64_t n = std::min<int64_t>(kv::kFp8MlaTile, g.latent_dim - b);
        const int32_t e = kv::Fp8TileScaleExp(kv::Fp8FiniteAmax(x + b, n));
        const float scale = kv::Fp8ScaleFromExp(e);
        std::memcpy(entry + layout.MlaScaleOffset(0) + b / kv::kFp8MlaTile * 4, &scale, 4);
        for (int64_t i = b; i < b + n; ++i) entry[i] = kv::QuantizeE4M3(x[i], e);
      }
      for (int64_t i = 0; i < g.rope_dim; ++i) {
        const uint16_t bits = FloatToBf16(x[g.latent_dim + i]);
        std::memcpy(entry + layout.MlaRopeOffset(0) + 2 * i, &bits, 2);
      }
      continue;
    }
    uint8_t* strip = unit + li * layout.LayerStripBytes(0);
    for (int kv_i = 0; kv_i < 2; ++kv_i) {
      const float* x = (kv_i == 0 ? k : v).data() + r * width;
      for (int32_t h = 0; h < g.num_kv_heads; ++h) {
        uint8_t* scale_at = strip + layout.Fp8ScaleOffset(0, kv_i, h);
        if (t == 0) {
          const float scale = kv::Fp8ScaleFromExp(
              kv::Fp8BlockScaleExp(kv::Fp8FiniteAmax(x + h * g.head_dim, g.head_dim)));
          std::memcpy(scale_at, &scale, 4);
        }
        float scale;
        std::memcpy(&scale, scale_at, 4);
        uint8_t* values = strip + (kv_i * bt + t) * width + h * g.head_dim;
        for (int32_t i = 0; i < g.head_dim; ++i) {
          values[i] = kv::QuantizeE4M3(x[h * g.head_dim + i], ExpOfScale(scale));
        }
      }
    }
  }
}

// Value i of position p's K (kv_i 0) or V entry of layer index li, dequantised on the host.
float HostFp8Read(const kv::ModelLayout& layout, int32_t li, const uint8_t* unit, int64_t t,
                  int kv_i, int64_t i) {
  const kv::LayerGroup& g = layout.groups()[0];
  const int64_t bt = layout.block_tokens();
  float scale;
  if (g.kind == kv::LayerKind::kMlaLatent) {
    const uint8_t* entry = unit + (li * bt + t) * layout.MlaEntryBytes(0);
    if (i >= g.latent_dim) {
      uint16_t bits;
      std::memcpy(&bits, entry + layout.MlaRopeOffset(0) + 2 * (i - g.latent_dim), 2);
      return Bf16ToFloat(bits);
    }
    std::memcpy(&scale, entry + layout.MlaScaleOffset(0) + i / kv::kFp8MlaTile * 4, 4);
    return kv::DequantizeE4M3(entry[i], scale);
  }
  const uint8_t* strip = unit + li * layout.LayerStripBytes(0);
  const int64_t width = int64_t{g.num_kv_heads} * g.head_dim;
  std::memcpy(&scale, strip + layout.Fp8ScaleOffset(0, kv_i, i / g.head_dim), 4);
  return kv::DequantizeE4M3(strip[(kv_i * bt + t) * width + i], scale);
}

// Equal bits, or both NaN (the device's NaN * scale is the canonical NaN, the host's keeps the
// payload; the cached byte is the same E4M3 NaN either way).
bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
}

// Writes rows through WriteCache in two launches (position 0 alone, then 1..10: blocks whose
// first token an earlier launch wrote, and blocks that start inside the launch), compares the
// whole pool byte for byte with HostFp8Write, then GatherCache value for value with the host.
void CheckFp8CacheRoundTrip(bool mla) {
  const kv::ModelLayout layout = Fp8Layout(mla);
  const kv::LayerGroup& g = layout.groups()[0];
  const int64_t width = mla ? g.latent_dim + g.rope_dim : int64_t{g.num_kv_heads} * g.head_dim;
  const int32_t li = 1;
  const std::vector<int32_t> table = {5, 2, 4};  // positions 0..11
  std::vector<int64_t> pos;
  for (int64_t p = 0; p <= 10; ++p) pos.push_back(p);
  const int64_t rows = static_cast<int64_t>(pos.size());
  const std::vector<float> k = Fp8Rows(pos, width, 11), v = Fp8Rows(pos, width, 12);
  std::vector<uint8_t> want(6 * layout.BlockBytes(0), 0);
  HostFp8Write(layout, li, k, v, width, pos, table, want);

  Dev<uint8_t> pool(want.size());
  Dev<float> dk(k), dv(v);
  Dev<int64_t> dpos(pos);
  std::vector<int32_t> tables;
  for (int64_t r = 0; r < rows; ++r) tables.insert(tables.end(), table.begin(), table.end());
  Dev<int32_t> dtables(tables);
  const PagedLayer paged = MakePagedLayer(layout, 0, li, pool.get(), layout.BlockBytes(0));
  for (const auto& [first, n] : {std::pair<int64_t, int64_t>{0, 1}, {1, rows - 1}}) {
    KV_ASSERT_OK(WriteCache(paged, dk.get() + first * width,
                            mla ? nullptr : dv.get() + first * width, width, width, width, n,
                            dpos.get() + first, dtables.get() + first * 3, 3, nullptr));
  }
  const std::vector<uint8_t> got = pool.Host();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << (mla ? "mla" : "gqa") << " pool byte " << i << " (unit "
                               << i / layout.BlockBytes(0) << ", byte " << i % layout.BlockBytes(0)
                               << ")";
  }

  Dev<float> gk(static_cast<size_t>(rows * width)), gv(static_cast<size_t>(rows * width));
  Dev<int32_t> dtable(table);
  KV_ASSERT_OK(GatherCache(paged, dtable.get(), 0, rows, width, gk.get(), mla ? nullptr : gv.get(),
                           nullptr));
  const std::vector<float> got_k = gk.Host(), got_v = gv.Host();
  for (int64_t p = 0; p < rows; ++p) {
    const uint8_t* unit = want.data() + table[p / 4] * layout.BlockBytes(0);
    for (int64_t i = 0; i < width; ++i) {
      const float want_k = HostFp8Read(layout, li, unit, p % 4, 0, i);
      ASSERT_TRUE(SameFloat(got_k[p * width + i], want_k))
          << "K position " << p << " value " << i << ": " << got_k[p * width + i] << " vs "
          << want_k;
      if (!mla) {
        const float want_v = HostFp8Read(layout, li, unit, p % 4, 1, i);
        ASSERT_TRUE(SameFloat(got_v[p * width + i], want_v))
            << "V position " << p << " value " << i << ": " << got_v[p * width + i] << " vs "
            << want_v;
      }
    }
  }
}

TEST_F(CudaOpsTest, Fp8CacheWriteIsBitExactWithKvFp8AndGatherDequantises) {
  CheckFp8CacheRoundTrip(false);
  CheckFp8CacheRoundTrip(true);
}

// Paged attention over an fp8 pool of random codes (no NaN) and scales against the host's
// dequantised K/V + AttendOne.
void CheckFp8Attention(bool mla, int64_t window) {
  const kv::ModelLayout layout = Fp8Layout(mla);
  const kv::LayerGroup& g = layout.groups()[0];
  const int32_t kv_heads = mla ? 1 : g.num_kv_heads;
  const int32_t heads = mla ? 4 : 2 * kv_heads;
  const int64_t width = mla ? g.latent_dim + g.rope_dim : int64_t{kv_heads} * g.head_dim;
  const int64_t ctx = 23, bt = 4, n_blocks = (ctx + bt - 1) / bt;
  std::vector<int64_t> all(ctx);
  for (int64_t p = 0; p < ctx; ++p) all[p] = p;
  std::vector<int32_t> table(n_blocks);
  for (int64_t b = 0; b < n_blocks; ++b) table[b] = static_cast<int32_t>(n_blocks - 1 - b);
  // A written cache, both layers (the kernel reads layer index 0).
  std::vector<uint8_t> pool_host(n_blocks * layout.BlockBytes(0), 0);
  for (int32_t li = 0; li < 2; ++li) {
    const std::vector<float> k = Random(ctx * width, 20 + li, 2.0f);
    const std::vector<float> v = Random(ctx * width, 30 + li, 2.0f);
    HostFp8Write(layout, li, k, v, width, all, table, pool_host);
  }
  std::vector<float> kbuf(ctx * width), vbuf(ctx * width);
  for (int64_t p = 0; p < ctx; ++p) {
    const uint8_t* unit = pool_host.data() + table[p / bt] * layout.BlockBytes(0);
    for (int64_t i = 0; i < width; ++i) {
      kbuf[p * width + i] = HostFp8Read(layout, 0, unit, p % bt, 0, i);
      if (!mla) vbuf[p * width + i] = HostFp8Read(layout, 0, unit, p % bt, 1, i);
    }
  }
  ExpectPagedAttentionMatchesHost(layout, heads, pool_host, table, ctx, window, kbuf, vbuf,
                                  mla ? "mla" : "gqa");
}

TEST_F(CudaOpsTest, Fp8PagedAttentionMatchesHostDequantisation) {
  CheckFp8Attention(false, 0);
  CheckFp8Attention(false, 6);
  CheckFp8Attention(true, 0);
}

// Needs no device: the launchers refuse fp8 rows that are not whole heads before any launch.
TEST(CudaOpsNoDeviceTest, Fp8WriteRefusesRowsOfPartialHeads) {
  const kv::ModelLayout layout = Fp8Layout(false);
  uint8_t byte = 0;
  const PagedLayer paged = MakePagedLayer(layout, 0, 0, &byte, layout.BlockBytes(0));
  EXPECT_EQ(WriteCache(paged, nullptr, nullptr, 0, 0, 50, 1, nullptr, nullptr, 1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

// MakePagedLayer over the fp8 layouts: byte offsets from kv/model_layout.h's helpers.
TEST(CudaOpsNoDeviceTest, Fp8PagedLayerUsesTheLayoutsByteOffsets) {
  const kv::ModelLayout gqa = Fp8Layout(false);
  const PagedLayer a = MakePagedLayer(gqa, 0, 1, nullptr, gqa.BlockBytes(0));
  const int64_t strip = 2 * 4 * 3 * 40 + 2 * 3 * 4;  // K, V values; 2 x 3 float32 scales
  EXPECT_EQ(gqa.LayerStripBytes(0), strip);
  EXPECT_EQ(a.k_offset, strip);
  EXPECT_EQ(a.v_offset, strip + 4 * 3 * 40);
  EXPECT_EQ(a.token_stride, 3 * 40);
  EXPECT_EQ(a.head_stride, 40);
  EXPECT_EQ(a.k_scale_offset, strip + 2 * 4 * 3 * 40);
  EXPECT_EQ(a.v_scale_offset, strip + 2 * 4 * 3 * 40 + 3 * 4);
  const kv::ModelLayout mla = Fp8Layout(true);
  const PagedLayer m = MakePagedLayer(mla, 0, 1, nullptr, mla.BlockBytes(0));
  const int64_t entry = 200 + 2 * 4 + 6 * 2;  // latent, two tile scales, bf16 rope
  EXPECT_EQ(mla.MlaEntryBytes(0), entry);
  EXPECT_EQ(m.token_stride, entry);
  EXPECT_EQ(m.k_offset, 4 * entry);
  EXPECT_EQ(m.mla_latent, 200);
  EXPECT_EQ(m.mla_scale_offset, 200);
  EXPECT_EQ(m.mla_rope_offset, 208);
}

TEST(CudaOpsNoDeviceTest, HaveDeviceNeverCrashes) {
  // Without a driver this is false; with a GPU true. Either way it returns.
  const bool have = HaveDevice();
  int count = 0;
  const bool runtime_ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  EXPECT_EQ(have, runtime_ok);
}

}  // namespace
}  // namespace kvrelay::model::cuda
