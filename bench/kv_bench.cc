// kv_bench: block hashing and checksums beside a plain memcpy of the same bytes, and block-pool
// allocate/free rates, single- and multi-threaded. Run: build/bin/kv_bench
// Each hashing benchmark reports bytes/s; compare with BM_Memcpy at the same size in the same
// run (the report's "ratio" lines are printed by the custom main below).

#include <benchmark/benchmark.h>

#include <cstring>
#include <map>
#include <vector>

#include "kv/block_hash.h"
#include "kv/checksum.h"
#include "kv/pool/block_pool.h"
#include "kv/presets.h"

namespace {

using namespace kvrelay;  // NOLINT: benchmark file

const kv::LayoutFingerprint& Fingerprint() {
  static const kv::LayoutFingerprint fp = kv::LoadPreset("llama3-8b")->layout.fingerprint();
  return fp;
}

// Prompt of n tokens hashed in blocks of `block_tokens`: the work a prefill worker does per
// request before MatchPrefix.
void BM_HashChain(benchmark::State& state) {
  const int32_t block_tokens = static_cast<int32_t>(state.range(0));
  std::vector<int32_t> tokens(32768);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>(i * 2654435761u % 128256);
  for (auto _ : state) {
    auto chain = kv::HashChain(Fingerprint(), "tenant-salt", tokens, block_tokens);
    benchmark::DoNotOptimize(chain.data());
  }
  state.SetBytesProcessed(state.iterations() * tokens.size() * sizeof(int32_t));
  state.counters["blocks/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * (tokens.size() / block_tokens),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_HashChain)->Arg(16)->Arg(64)->Arg(512);

// The same bytes (the prompt's token ids) copied: the floor for any pass over them.
void BM_MemcpyTokens(benchmark::State& state) {
  std::vector<int32_t> src(32768), dst(32768);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size() * sizeof(int32_t));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * src.size() * sizeof(int32_t));
}
BENCHMARK(BM_MemcpyTokens);

// Checksum of a KV block unit (Llama 3 8B, 16 tokens = 2 MiB) vs memcpy of that block.
void BM_BlockChecksum(benchmark::State& state) {
  std::vector<uint8_t> block(static_cast<size_t>(state.range(0)), 0x5a);
  for (auto _ : state) benchmark::DoNotOptimize(kv::BlockChecksum(block.data(), block.size()));
  state.SetBytesProcessed(state.iterations() * block.size());
}
BENCHMARK(BM_BlockChecksum)->Arg(64 << 10)->Arg(2 << 20);

void BM_MemcpyBlock(benchmark::State& state) {
  std::vector<uint8_t> src(static_cast<size_t>(state.range(0)), 0x5a), dst(src.size());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * src.size());
}
BENCHMARK(BM_MemcpyBlock)->Arg(64 << 10)->Arg(2 << 20);

kv::BlockPool& SharedPool() {
  static kv::BlockPool* pool =
      kv::BlockPool::Create({4096, 1 << 16}, kv::MakeHostMemoryResource()).value().release();
  return *pool;
}

// Allocate + release of one slot; with threads, all contend on one pool.
void BM_PoolAllocateRelease(benchmark::State& state) {
  kv::BlockPool& pool = SharedPool();
  for (auto _ : state) {
    absl::StatusOr<kv::SlotId> slot = pool.Allocate();
    benchmark::DoNotOptimize(slot);
    if (slot.ok()) (void)pool.Release(*slot);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PoolAllocateRelease)->Threads(1)->Threads(2)->Threads(4)->UseRealTime();

// Batch of 64 slots (a 1K-token prompt at 16 tokens per block) allocated and freed at once.
void BM_PoolAllocateMany64(benchmark::State& state) {
  kv::BlockPool& pool = SharedPool();
  for (auto _ : state) {
    auto slots = pool.AllocateMany(64);
    if (slots.ok()) {
      for (kv::SlotId s : *slots) (void)pool.Release(s);
    }
  }
  state.SetItemsProcessed(state.iterations() * 64);
}
BENCHMARK(BM_PoolAllocateMany64)->Threads(1)->Threads(2)->UseRealTime();

// Prints ours / baseline / ratio lines after the normal report.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      const double seconds = run.GetAdjustedRealTime();
      if (seconds <= 0) continue;
      auto it = run.counters.find("bytes_per_second");
      if (it != run.counters.end()) rates_[run.benchmark_name()] = it->second;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    auto ratio = [&](const std::string& ours, const std::string& base) {
      auto a = rates_.find(ours), b = rates_.find(base);
      if (a == rates_.end() || b == rates_.end()) return;
      std::printf("ratio %-32s %8.2f GB/s vs %-24s %8.2f GB/s = %.3f\n", ours.c_str(),
                  a->second / 1e9, base.c_str(), b->second / 1e9, a->second / b->second);
    };
    ratio("BM_HashChain/16", "BM_MemcpyTokens");
    ratio("BM_HashChain/512", "BM_MemcpyTokens");
    ratio("BM_BlockChecksum/65536", "BM_MemcpyBlock/65536");
    ratio("BM_BlockChecksum/2097152", "BM_MemcpyBlock/2097152");
  }

 private:
  std::map<std::string, double> rates_;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
