// The CUDA AttentionModel (LoadCudaRunner) against the CPU ModelRunner on the tiny test models:
// greedy tokens equal and logits close through prefill and continuous-batching decode, the host
// pools holding exactly the device mirror's bytes after every call (staging), on_layer_done in
// layer order with the layer's bytes already in the host pool, adopted prefixes uploaded before
// they are read, DecodeStepGreedy's device argmax equal to host Greedy; each architecture with
// its own cache dtype and with an FP8 E4M3 cache (scales staged with the values). GPU tests
// skip without a device, or fail with KVRELAY_REQUIRE_GPU=1 (bench/gpu_check.sh sets it); the
// refusal of Gemma 3 and Mamba happens before any device use and runs everywhere.

#include "model/cuda/cuda_runner.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kv/hf_config.h"
#include "model/cuda/cuda_ops.h"
#include "model/cuda/skip_without_gpu.h"
#include "model/model_runner.h"
#include "model/sampler.h"
#include "model/test_model.h"
#include "platform/cuda/cuda_util.h"
#include "tests/testing/float_compare.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model::cuda {
namespace {

using ::kvrelay::testing::MaxRelativeError;

// Logits from the two backends differ by rounding (cuBLAS vs the CPU's GEMMs, bf16 cache
// entries rounded from slightly different values). Relative to max |logit|.
constexpr double kLogitTolerance = 2e-2;

// The GPU's greedy token must be the CPU's unless the CPU's best two are within the tolerance
// (a near tie either side may break): then it must be one of those near the top.
void ExpectSameGreedy(absl::Span<const float> cpu, int32_t gpu_token, const std::string& where) {
  const int32_t cpu_token = Greedy(cpu);
  if (gpu_token == cpu_token) return;
  double scale = 1e-30;
  for (float v : cpu) scale = std::max(scale, std::abs(double{v}));
  EXPECT_GE(cpu[gpu_token], cpu[cpu_token] - kLogitTolerance * scale)
      << where << ": GPU chose " << gpu_token << ", CPU " << cpu_token << " by a clear margin";
}

struct Arch {
  std::string name;
  std::string arch;
  std::string patch;
  std::optional<kv::DType> kv_dtype;  // the KV cache's dtype when not the model's (fp8_e4m3)
};

void PrintTo(const Arch& arch, std::ostream* os) { *os << arch.name; }

std::vector<Arch> TestArchs() {
  // The presets' rope_scaling as they come (tiny-llama: llama3; tiny-deepseek_v3: yarn with
  // mscale), and a plain-RoPE sliding-window model.
  // The same with an FP8 E4M3 cache on both sides: both quantise K/V with kv/fp8.h, so the
  // logits stay as close as the bf16 cache's (a code or a scale flips only where the two
  // backends' K/V straddle a rounding boundary); the host pool must hold the device's bytes,
  // block scales included, after every call.
  const std::string window =
      R"({"model_type": "mistral", "sliding_window": 24, "rope_scaling": null})";
  return {{"llama", "llama", "", std::nullopt},
          {"deepseek_v3", "deepseek_v3", "", std::nullopt},
          {"mistral_window", "llama", window, std::nullopt},
          {"llama_fp8", "llama", "", kv::DType::kFp8},
          {"deepseek_v3_fp8", "deepseek_v3", "", kv::DType::kFp8},
          {"mistral_window_fp8", "llama", window, kv::DType::kFp8}};
}

class CudaRunnerTest : public ::testing::TestWithParam<Arch> {
 protected:
  void SetUp() override {
    KV_SKIP_WITHOUT_GPU();
    TestModelOptions o;
    o.arch = GetParam().arch;
    o.seed = 11;
    o.config_patch = GetParam().patch;
    KV_ASSERT_OK(WriteTestModel(dir_.path(), o));
    kv::ConfigOptions config_options;
    config_options.kv_dtype = GetParam().kv_dtype;
    KV_ASSERT_OK_AND_ASSIGN(config_,
                            kv::LoadHfConfig(dir_.path() + "/config.json", config_options));
    KV_ASSERT_OK_AND_ASSIGN(cpu_, ModelRunner::Load(dir_.path(), config_, RunnerOptions{}));
    CudaRunnerOptions options;
    options.weight_dtype = WeightDType::kFp32;  // close to the CPU's fp32 GEMMs
    options.max_rows = 64;
    options.max_context = 256;
    KV_ASSERT_OK_AND_ASSIGN(gpu_, LoadGpu(options));
    KV_ASSERT_OK_AND_ASSIGN(cpu_cache_, KvCache::Create(cpu_->layout(), 32));
    KV_ASSERT_OK_AND_ASSIGN(gpu_cache_, KvCache::Create(gpu_->layout(), 32));
    for (int i = 0; i < 96; ++i) tokens_.push_back((i * 37 + 5) % cpu_->config().vocab_size);
  }

  // A CUDA runner of the test model with this test's KV dtype.
  absl::StatusOr<std::unique_ptr<AttentionModel>> LoadGpu(const CudaRunnerOptions& options) {
    return LoadCudaRunner(dir_.path(), config_, options);
  }

  // Every live unit of `seq` holds the same bytes in the host pool and on the device.
  void ExpectHostEqualsDevice(const Sequence& seq, const std::string& where) {
    ExpectHostEqualsDeviceOf(*gpu_, seq, where);
  }
  static void ExpectHostEqualsDeviceOf(const AttentionModel& gpu, const Sequence& seq,
                                       const std::string& where) {
    for (int g = 0; g < seq.cache().num_groups(); ++g) {
      const int64_t bytes = seq.cache().layout().BlockBytes(g);
      for (size_t b = 0; b < seq.blocks(g).size(); ++b) {
        const kv::SlotId slot = seq.blocks(g)[b];
        if (slot < 0) continue;
        KV_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> device,
                                ReadDeviceUnitForTest(gpu, seq.cache(), g, slot));
        EXPECT_EQ(std::memcmp(device.data(), seq.cache().pool(g).SlotAddress(slot), bytes), 0)
            << where << ": group " << g << " block " << b << " (slot " << slot << ")";
      }
    }
  }

  testing::TempDir dir_;
  kv::ModelConfig config_;
  std::unique_ptr<ModelRunner> cpu_;
  std::unique_ptr<AttentionModel> gpu_;
  std::unique_ptr<KvCache> cpu_cache_, gpu_cache_;
  std::vector<int32_t> tokens_;
};

TEST_P(CudaRunnerTest, ReportsDeviceAndNumerics) {
  EXPECT_EQ(gpu_->device().kind, DeviceKind::kCuda);
  EXPECT_EQ(gpu_->device().Label(), "cuda:0");
  EXPECT_FALSE(gpu_->device().name.empty());
  EXPECT_EQ(gpu_->numerics_id().rfind("cuda-fp32w-sm", 0), 0u) << gpu_->numerics_id();
  EXPECT_EQ(gpu_->layout().numerics_id(), gpu_->numerics_id());
  EXPECT_FALSE(gpu_->layout().fingerprint() == cpu_->layout().fingerprint());
  // A cache of the CPU's layout is refused, never computed into.
  Sequence cpu_seq(cpu_cache_.get());
  EXPECT_THAT(gpu_->Prefill(cpu_seq, absl::MakeConstSpan(tokens_).first(4)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_P(CudaRunnerTest, PrefillAndBatchedDecodeMatchCpu) {
  // Three sequences at different lengths, decoded together (continuous batching).
  const int lengths[] = {35, 16, 50};
  std::vector<std::unique_ptr<Sequence>> cpu_seqs, gpu_seqs;
  std::vector<int32_t> next;
  for (int s = 0; s < 3; ++s) {
    cpu_seqs.push_back(std::make_unique<Sequence>(cpu_cache_.get()));
    gpu_seqs.push_back(std::make_unique<Sequence>(gpu_cache_.get()));
    auto prompt = absl::MakeConstSpan(tokens_).subspan(s, lengths[s]);
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, cpu_->Prefill(*cpu_seqs[s], prompt));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, gpu_->Prefill(*gpu_seqs[s], prompt));
    EXPECT_LE(MaxRelativeError(got, want), kLogitTolerance) << "prefill " << s;
    ExpectSameGreedy(want, Greedy(got), "prefill " + std::to_string(s));
    ExpectHostEqualsDevice(*gpu_seqs[s], "after prefill " + std::to_string(s));
    next.push_back(Greedy(want));
  }
  const int64_t vocab = cpu_->config().vocab_size;
  for (int step = 0; step < 12; ++step) {
    std::vector<Sequence*> cpu_batch, gpu_batch;
    for (int s = 0; s < 3; ++s) {
      cpu_batch.push_back(cpu_seqs[s].get());
      gpu_batch.push_back(gpu_seqs[s].get());
    }
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, cpu_->DecodeStep(cpu_batch, next));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, gpu_->DecodeStep(gpu_batch, next));
    for (int s = 0; s < 3; ++s) {
      auto w = absl::MakeConstSpan(want).subspan(s * vocab, vocab);
      auto g = absl::MakeConstSpan(got).subspan(s * vocab, vocab);
      const std::string where = "step " + std::to_string(step) + " seq " + std::to_string(s);
      EXPECT_LE(MaxRelativeError(g, w), kLogitTolerance) << where;
      ExpectSameGreedy(w, Greedy(g), where);
      next[s] = Greedy(w);  // both sides continue with the CPU's token
      // Window freeing works the same on both sides (a no-op without sliding-window groups).
      EXPECT_EQ(cpu_seqs[s]->FreeBlocksOutsideWindow(), gpu_seqs[s]->FreeBlocksOutsideWindow());
    }
    for (int s = 0; s < 3; ++s) {
      ExpectHostEqualsDevice(*gpu_seqs[s], "step " + std::to_string(step));
    }
  }
}

TEST_P(CudaRunnerTest, ChunkedPrefillMatchesCpu) {
  // 150 tokens at max_rows 64: three forward passes, one prefill.
  Sequence cpu_seq(cpu_cache_.get()), gpu_seq(gpu_cache_.get());
  auto prompt = absl::MakeConstSpan(tokens_).first(90);
  std::vector<int32_t> longer(prompt.begin(), prompt.end());
  longer.insert(longer.end(), tokens_.begin(), tokens_.begin() + 60);
  PrefillOptions all;
  all.all_logits = true;
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, cpu_->Prefill(cpu_seq, longer, all));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, gpu_->Prefill(gpu_seq, longer, all));
  ASSERT_EQ(got.size(), want.size());
  const int64_t vocab = cpu_->config().vocab_size;
  for (size_t r = 0; r < longer.size(); ++r) {
    EXPECT_LE(MaxRelativeError(absl::MakeConstSpan(got).subspan(r * vocab, vocab),
                               absl::MakeConstSpan(want).subspan(r * vocab, vocab)),
              kLogitTolerance)
        << "row " << r;
  }
  ExpectHostEqualsDevice(gpu_seq, "after chunked prefill");
}

TEST_P(CudaRunnerTest, OnLayerDoneInOrderWithTheLayerInTheHostPool) {
  Sequence seq(gpu_cache_.get());
  const KvCache& cache = *gpu_cache_;
  const kv::ModelLayout& layout = cache.layout();
  std::vector<int32_t> reported;
  // What the host pool held of each layer's strip when that layer was reported.
  std::vector<std::vector<uint8_t>> snapshot(layout.num_layers());
  PrefillOptions options;
  options.on_layer_done = [&](int32_t layer) {
    reported.push_back(layer);
    const int g = cache.group_of_layer(layer);
    const int64_t layer_bytes = layout.BlockBytes(g) / layout.groups()[g].num_layers();
    for (kv::SlotId slot : seq.blocks(g)) {
      if (slot < 0) continue;
      const uint8_t* strip = static_cast<const uint8_t*>(cache.pool(g).SlotAddress(slot)) +
                             cache.index_in_group(layer) * layer_bytes;
      snapshot[layer].insert(snapshot[layer].end(), strip, strip + layer_bytes);
    }
  };
  KV_ASSERT_OK(gpu_->Prefill(seq, absl::MakeConstSpan(tokens_).first(40), options).status());
  std::vector<int32_t> in_order(layout.num_layers());
  for (int32_t l = 0; l < layout.num_layers(); ++l) in_order[l] = l;
  EXPECT_EQ(reported, in_order);
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    const int g = cache.group_of_layer(layer);
    const int64_t layer_bytes = layout.BlockBytes(g) / layout.groups()[g].num_layers();
    std::vector<uint8_t> final_bytes;
    for (kv::SlotId slot : seq.blocks(g)) {
      if (slot < 0) continue;
      const uint8_t* strip = static_cast<const uint8_t*>(cache.pool(g).SlotAddress(slot)) +
                             cache.index_in_group(layer) * layer_bytes;
      final_bytes.insert(final_bytes.end(), strip, strip + layer_bytes);
    }
    EXPECT_EQ(snapshot[layer], final_bytes) << "layer " << layer << " reported before staged";
  }
  ExpectHostEqualsDevice(seq, "after reported prefill");
}

TEST_P(CudaRunnerTest, AdoptedPrefixIsUploadedBeforeItIsRead) {
  const int64_t bt = gpu_cache_->layout().block_tokens();
  auto prefix = absl::MakeConstSpan(tokens_).first(2 * bt);
  auto rest = absl::MakeConstSpan(tokens_).subspan(2 * bt, 9);
  Sequence source(gpu_cache_.get());
  KV_ASSERT_OK(gpu_->Prefill(source, prefix).status());
  // As a transport would: the prefix's bytes land in fresh host slots the device never saw.
  std::vector<std::vector<kv::SlotId>> blocks(gpu_cache_->num_groups());
  for (int g = 0; g < gpu_cache_->num_groups(); ++g) {
    KV_ASSERT_OK_AND_ASSIGN(blocks[g], gpu_cache_->pool(g).AllocateMany(2));
    for (int b = 0; b < 2; ++b) {
      std::memcpy(gpu_cache_->pool(g).SlotAddress(blocks[g][b]),
                  gpu_cache_->pool(g).SlotAddress(source.blocks(g)[b]),
                  gpu_cache_->layout().BlockBytes(g));
    }
  }
  Sequence adopted(gpu_cache_.get());
  KV_ASSERT_OK(adopted.AdoptPrefix(prefix, blocks));
  EXPECT_EQ(adopted.host_only_blocks(), 2);
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, gpu_->Prefill(source, rest));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, gpu_->Prefill(adopted, rest));
  EXPECT_EQ(adopted.host_only_blocks(), 0);
  // Same shapes, same bytes read: the same bits.
  EXPECT_EQ(got, want);
  ExpectHostEqualsDevice(adopted, "after adopted prefill");
}

// A held prefix arriving layer by layer (a disk read in stages): its slots start as junk and
// before_layer(L) copies layer L's strips in; the device must read each layer only after its
// hook (the upload of layer L is enqueued right after it), so the logits equal those of the
// prefix uploaded whole. A hook that fails stops the prefill; rewound to its first block, the
// sequence computes the rest on the device and still gets the same logits.
TEST_P(CudaRunnerTest, AHeldPrefixArrivingLayerByLayerIsUploadedLayerByLayer) {
  const int64_t bt = gpu_cache_->layout().block_tokens();
  const int32_t layers = config_.num_hidden_layers;
  auto prefix = absl::MakeConstSpan(tokens_).first(2 * bt);
  auto rest = absl::MakeConstSpan(tokens_).subspan(2 * bt, 9);
  Sequence source(gpu_cache_.get());
  KV_ASSERT_OK(gpu_->Prefill(source, prefix).status());
  auto junk_prefix = [&]() {
    std::vector<std::vector<kv::SlotId>> blocks(gpu_cache_->num_groups());
    for (int g = 0; g < gpu_cache_->num_groups(); ++g) {
      blocks[g] = gpu_cache_->pool(g).AllocateMany(2).value();
      for (int b = 0; b < 2; ++b) {
        std::memset(gpu_cache_->pool(g).SlotAddress(blocks[g][b]), 0x3C,
                    gpu_cache_->layout().BlockBytes(g));
      }
    }
    return blocks;
  };
  auto arrive = [&](const Sequence& seq, int32_t layer) {
    const int g = gpu_cache_->group_of_layer(layer);
    const int64_t strip =
        gpu_cache_->layout().BlockBytes(g) / gpu_cache_->layout().groups()[g].num_layers();
    const int64_t at = gpu_cache_->index_in_group(layer) * strip;
    for (int b = 0; b < 2; ++b) {
      std::memcpy(
          static_cast<char*>(gpu_cache_->pool(g).SlotAddress(seq.blocks(g)[b])) + at,
          static_cast<const char*>(gpu_cache_->pool(g).SlotAddress(source.blocks(g)[b])) + at,
          static_cast<size_t>(strip));
    }
  };
  Sequence whole(gpu_cache_.get());
  {
    std::vector<std::vector<kv::SlotId>> blocks = junk_prefix();
    KV_ASSERT_OK(whole.AdoptPrefix(prefix, blocks));
    for (int32_t layer = 0; layer < layers; ++layer) arrive(whole, layer);
  }
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, gpu_->Prefill(whole, rest));

  Sequence staged(gpu_cache_.get());
  KV_ASSERT_OK(staged.AdoptPrefix(prefix, junk_prefix()));
  int32_t next = 0;
  PrefillOptions options;
  options.before_layer = [&](int32_t layer) {
    EXPECT_EQ(layer, next++);
    arrive(staged, layer);
    return absl::OkStatus();
  };
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, gpu_->Prefill(staged, rest, options));
  EXPECT_EQ(next, layers);
  EXPECT_EQ(got, want);
  EXPECT_EQ(staged.host_only_blocks(), 0);
  ExpectHostEqualsDevice(staged, "after a layer-wise prefill");

  Sequence failed(gpu_cache_.get());
  KV_ASSERT_OK(failed.AdoptPrefix(prefix, junk_prefix()));
  options.before_layer = [&](int32_t layer) {
    if (layer == layers - 1) return absl::DataLossError("stage checksum mismatch");
    arrive(failed, layer);
    return absl::OkStatus();
  };
  EXPECT_EQ(gpu_->Prefill(failed, rest, options).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(failed.num_tokens(), 2 * bt);
  arrive(failed, layers - 1);  // block 0 whole; block 1 is computed again after the rewind
  KV_ASSERT_OK(failed.Rewind(bt));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> again,
                          gpu_->Prefill(failed, absl::MakeConstSpan(tokens_).subspan(bt, bt + 9)));
  ExpectHostEqualsDevice(failed, "after the rewound prefill");
  // Block 1 was computed here rather than read: the same up to the device's rounding.
  ASSERT_EQ(again.size(), want.size());
  EXPECT_LE(MaxRelativeError(again, want), kLogitTolerance);
}

TEST_P(CudaRunnerTest, DecodeStepGreedyEqualsHostGreedy) {
  Sequence a(gpu_cache_.get()), b(gpu_cache_.get());
  auto prompt = absl::MakeConstSpan(tokens_).first(21);
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> first, gpu_->Prefill(a, prompt));
  KV_ASSERT_OK(gpu_->Prefill(b, prompt).status());
  int32_t next = Greedy(first);
  for (int step = 0; step < 10; ++step) {
    Sequence* sa[] = {&a};
    Sequence* sb[] = {&b};
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> logits, gpu_->DecodeStep(sa, {next}));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids, gpu_->DecodeStepGreedy(sb, {next}));
    ASSERT_EQ(ids.size(), 1u);
    EXPECT_EQ(ids[0], Greedy(logits)) << "step " << step;
    next = ids[0];
  }
  ExpectHostEqualsDevice(b, "after greedy decode");
}

// A decode batch over two caches with more rows than max_rows: one forward per (cache, at most
// max_rows rows), each row still its own sequence's logits; prefills chunked two rows at a time.
TEST_P(CudaRunnerTest, DecodeOverTwoCachesBeyondMaxRowsMatchesCpu) {
  CudaRunnerOptions options;
  options.weight_dtype = WeightDType::kFp32;
  options.max_rows = 2;
  options.max_context = 256;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<AttentionModel> small, LoadGpu(options));
  KV_ASSERT_OK_AND_ASSIGN(auto cache_a, KvCache::Create(small->layout(), 16));
  KV_ASSERT_OK_AND_ASSIGN(auto cache_b, KvCache::Create(small->layout(), 16));
  constexpr int kSeqs = 5;
  std::vector<std::unique_ptr<Sequence>> cpu_seqs, gpu_seqs;
  std::vector<int32_t> next;
  for (int s = 0; s < kSeqs; ++s) {
    cpu_seqs.push_back(std::make_unique<Sequence>(cpu_cache_.get()));
    gpu_seqs.push_back(std::make_unique<Sequence>(s % 2 == 0 ? cache_a.get() : cache_b.get()));
    auto prompt = absl::MakeConstSpan(tokens_).subspan(3 * s, 5 + 4 * s);
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, cpu_->Prefill(*cpu_seqs[s], prompt));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, small->Prefill(*gpu_seqs[s], prompt));
    EXPECT_LE(MaxRelativeError(got, want), kLogitTolerance) << "prefill " << s;
    next.push_back(Greedy(want));
  }
  const int64_t vocab = cpu_->config().vocab_size;
  for (int step = 0; step < 4; ++step) {
    std::vector<Sequence*> cpu_batch, gpu_batch;
    for (int s = 0; s < kSeqs; ++s) {
      cpu_batch.push_back(cpu_seqs[s].get());
      gpu_batch.push_back(gpu_seqs[s].get());
    }
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, cpu_->DecodeStep(cpu_batch, next));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, small->DecodeStep(gpu_batch, next));
    ASSERT_EQ(got.size(), want.size());
    for (int s = 0; s < kSeqs; ++s) {
      const std::string where = "step " + std::to_string(step) + " seq " + std::to_string(s);
      auto w = absl::MakeConstSpan(want).subspan(s * vocab, vocab);
      auto g = absl::MakeConstSpan(got).subspan(s * vocab, vocab);
      EXPECT_LE(MaxRelativeError(g, w), kLogitTolerance) << where;
      ExpectSameGreedy(w, Greedy(g), where);
      next[s] = Greedy(w);
      ExpectHostEqualsDeviceOf(*small, *gpu_seqs[s], where);
    }
  }
}

// A worker prepares its cache at start-up (so a device copy that does not fit fails there):
// preparing twice keeps the one mirror, a forward pass then uses it, and another runner may not
// take the cache over.
TEST_P(CudaRunnerTest, PrepareCacheMirrorsOnceAndRefusesAnotherRunner) {
  KV_ASSERT_OK(gpu_->PrepareCache(*gpu_cache_));
  const std::shared_ptr<CacheDeviceState> mirror = gpu_cache_->device_state();
  ASSERT_NE(mirror, nullptr);
  KV_EXPECT_OK(gpu_->PrepareCache(*gpu_cache_));
  EXPECT_EQ(gpu_cache_->device_state(), mirror);
  Sequence seq(gpu_cache_.get());
  KV_EXPECT_OK(gpu_->Prefill(seq, absl::MakeConstSpan(tokens_).first(8)).status());
  EXPECT_EQ(gpu_cache_->device_state(), mirror);
  CudaRunnerOptions small;
  small.max_rows = 2;
  small.max_context = 256;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<AttentionModel> other, LoadGpu(small));
  EXPECT_THAT(other->PrepareCache(*gpu_cache_),
              testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                ::testing::HasSubstr("another device runner")));
}

// A non-sticky error an earlier call on this thread failed with (and left as the thread's
// last error) is that call's: the next forward pass must not fail with it.
TEST_P(CudaRunnerTest, AnEarlierFailedCallDoesNotFailTheNextForward) {
  ASSERT_NE(cudaMemcpy(nullptr, nullptr, 16, cudaMemcpyDeviceToHost), cudaSuccess);
  if (cudaPeekAtLastError() == cudaSuccess) {
    GTEST_SKIP() << "this CUDA runtime kept no last error for the failed cudaMemcpy";
  }
  Sequence seq(gpu_cache_.get());
  KV_EXPECT_OK(gpu_->Prefill(seq, absl::MakeConstSpan(tokens_).first(8)).status());
  Sequence* batch[] = {&seq};
  KV_EXPECT_OK(gpu_->DecodeStep(batch, {tokens_[8]}).status());
}

INSTANTIATE_TEST_SUITE_P(Archs, CudaRunnerTest, ::testing::ValuesIn(TestArchs()),
                         [](const ::testing::TestParamInfo<Arch>& info) {
                           return info.param.name;
                         });

TEST(CudaArgmaxTest, MatchesGreedyWithTiesAndNans) {
  KV_SKIP_WITHOUT_GPU();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t n = 5000;  // more than one value per thread
  std::vector<std::vector<float>> rows;
  std::vector<float> tie(n, 1.0f);
  tie[4000] = 3.0f;
  tie[1234] = 3.0f;  // the lower of two equal maxima
  rows.push_back(tie);
  std::vector<float> nan_first(n, 2.0f);
  nan_first[0] = nan;  // Greedy never replaces a NaN at index 0
  nan_first[7] = 9.0f;
  rows.push_back(nan_first);
  std::vector<float> nan_later(n, -1.0f);
  nan_later[10] = nan;
  nan_later[4999] = 0.5f;
  rows.push_back(nan_later);
  rows.push_back(std::vector<float>(n, -inf));
  std::vector<float> zeros(n, 0.0f);
  zeros[0] = -0.0f;  // -0 == +0: index 0 stays
  rows.push_back(zeros);
  std::vector<float> host;
  for (const auto& r : rows) host.insert(host.end(), r.begin(), r.end());
  KV_ASSERT_OK_AND_ASSIGN(auto logits, platform::cuda::DeviceBuffer::Allocate(0, host.size() * 4));
  KV_ASSERT_OK_AND_ASSIGN(auto ids, platform::cuda::DeviceBuffer::Allocate(0, rows.size() * 4));
  ASSERT_EQ(cudaMemcpy(logits.data(), host.data(), host.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  KV_ASSERT_OK(ArgmaxRows(static_cast<const float*>(logits.data()),
                          static_cast<int64_t>(rows.size()), n, static_cast<int32_t*>(ids.data()),
                          nullptr));
  std::vector<int32_t> got(rows.size());
  ASSERT_EQ(cudaMemcpy(got.data(), ids.data(), got.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (size_t r = 0; r < rows.size(); ++r) EXPECT_EQ(got[r], Greedy(rows[r])) << "row " << r;
}

// Needs no GPU: the architecture is refused from config.json alone, before any device use.
TEST(CudaRunnerRefusalTest, GemmaMambaAndGpt2AreRefusedByName) {
  for (const char* arch : {"gemma3", "mamba", "gpt2"}) {
    testing::TempDir dir;
    TestModelOptions o;
    o.arch = arch;
    KV_ASSERT_OK(WriteTestModel(dir.path(), o));
    absl::StatusOr<std::unique_ptr<AttentionModel>> runner = LoadCudaRunner(dir.path(), {});
    ASSERT_EQ(runner.status().code(), absl::StatusCode::kUnimplemented)
        << arch << ": " << runner.status();
    EXPECT_NE(runner.status().message().find(arch), std::string::npos) << runner.status();
  }
}

TEST(CudaRunnerRefusalTest, BadOptionsAreNamed) {
  testing::TempDir dir;
  TestModelOptions o;
  KV_ASSERT_OK(WriteTestModel(dir.path(), o));
  CudaRunnerOptions options;
  options.max_rows = 0;
  EXPECT_THAT(LoadCudaRunner(dir.path(), options),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

// Runs everywhere (no skip): without a GPU any device is missing; with one, device 1000 is.
TEST(CudaRunnerRefusalTest, MissingDeviceIsFailedPrecondition) {
  testing::TempDir dir;
  TestModelOptions o;
  o.config_patch = R"({"rope_scaling": null})";
  KV_ASSERT_OK(WriteTestModel(dir.path(), o));
  CudaRunnerOptions options;
  if (HaveDevice()) options.device = 1000;
  EXPECT_THAT(LoadCudaRunner(dir.path(), options),
              testing::StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace kvrelay::model::cuda
