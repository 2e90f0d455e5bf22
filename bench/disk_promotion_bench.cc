// disk_promotion_bench: time to first token of a prefill whose prefix lies on this node's disk
// tier, read layer stage by layer stage while the suffix computes (what a prefill worker does)
// against reading the whole prefix first and computing after (the baseline, the worker before
// layer-wise promotion), in one run, alternating.
//
//   build/bin/disk_promotion_bench --dir DIR [--prefix-tokens 2048] [--suffix-tokens 256]
//                                  [--reps 5] [--threads 2] [--quick]
//
// The model is the mid-size Llama of model_bench (8 layers, hidden 1024, 4 KV heads; random
// weights), computed by the CPU runner; its prefix blocks are computed once, demoted to a real
// DiskCache (io_uring, O_DIRECT where DIR's file system allows it) and read back each rep
// through the worker's own code (PlanDiskStages, AllocateBlockDestinations, ReadStaged,
// PrefillOptions::before_layer). Both ways must give the full prefill's logits bit for bit.
// Also printed: the baseline's read (with its copy into the KV slots) alone and the compute
// alone. The layer-wise read lands in the KV slots directly, so it can beat their sum by more
// than the overlap.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/flags.h"
#include "common/status_macros.h"
#include "kv/block_hash.h"
#include "model/kv_cache.h"
#include "model/model_runner.h"
#include "model/test_model.h"
#include "transfer/inproc/in_process_transport.h"
#include "worker/disk_cache.h"
#include "worker/kv_memory.h"
#include "worker/worker_core.h"

namespace kvrelay {
namespace {

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "disk_promotion_bench: %s\n", what.c_str());
  return 1;
}

struct Rep {
  double total_ms = 0;
  double read_ms = 0;  // until the whole prefix was in place
  int layers_during_read = 0;
  std::vector<float> logits;
};

int Run(int argc, char** argv) {
  std::string dir;
  int32_t prefix_tokens = 2048, suffix_tokens = 256, reps = 5, threads = 2;
  bool quick = false;
  FlagSet flags("disk_promotion_bench",
                "TTFT of a prefix read back from disk layer-wise vs whole, then computed.");
  flags.AddString("dir", &dir, "directory for the disk tier (a real disk: O_DIRECT)");
  flags.AddInt32("prefix-tokens", &prefix_tokens, "prompt tokens on disk (whole blocks)");
  flags.AddInt32("suffix-tokens", &suffix_tokens, "prompt tokens computed after them");
  flags.AddInt32("reps", &reps, "repetitions of each way (alternating; medians)");
  flags.AddInt32("threads", &threads, "CPU runner threads");
  flags.AddBool("quick", &quick, "tiny sizes: runs to the end (CI), figures meaningless");
  absl::Status parsed = flags.Parse(ArgsFrom(argc, argv, 1));
  if (!parsed.ok() || reps < 1 || threads < 1 || prefix_tokens < 1 || suffix_tokens < 1) {
    std::fprintf(stderr, "disk_promotion_bench: %s\n%s", std::string(parsed.message()).c_str(),
                 flags.Usage().c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  if (dir.empty()) return Fail("--dir is required");
  if (quick) {
    prefix_tokens = 128;
    suffix_tokens = 16;
    reps = 1;
  }
  std::filesystem::create_directories(dir);
  const std::string model_dir = dir + "/model";
  model::TestModelOptions mo;
  mo.layers = quick ? 2 : 8;
  mo.hidden = quick ? 128 : 1024;
  mo.intermediate = quick ? 256 : 2816;
  mo.heads = quick ? 4 : 16;
  mo.kv_heads = 4;
  mo.vocab = 32000;
  if (absl::Status s = model::WriteTestModel(model_dir, mo); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  model::RunnerOptions ro;
  ro.threads = threads;
  auto runner = model::ModelRunner::Load(model_dir, ro);
  if (!runner.ok()) return Fail(std::string(runner.status().message()));
  const kv::ModelLayout& layout = (*runner)->layout();
  const int64_t bt = layout.block_tokens();
  if (prefix_tokens % bt != 0) return Fail("--prefix-tokens is not a whole number of blocks");
  const int64_t prefix_blocks = prefix_tokens / bt;
  std::vector<int32_t> tokens(static_cast<size_t>(prefix_tokens + suffix_tokens));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % 32000);
  const auto prefix = absl::MakeConstSpan(tokens).first(static_cast<size_t>(prefix_tokens));
  const auto suffix = absl::MakeConstSpan(tokens).subspan(static_cast<size_t>(prefix_tokens));

  auto transport = transfer::MakeInProcessTransport();
  if (!transport.ok()) return Fail(std::string(transport.status().message()));
  auto segment = worker::CacheSegment::Create(layout, prefix_blocks, transport->get());
  if (!segment.ok()) return Fail(std::string(segment.status().message()));
  const int64_t pool_blocks = 2 * (prefix_blocks + suffix_tokens / bt + 2);
  auto cache = model::KvCache::Create(layout, pool_blocks);
  if (!cache.ok()) return Fail(std::string(cache.status().message()));

  // The reference: one full prefill; its prefix blocks go to disk as a worker demotes them.
  std::vector<float> want;
  {
    model::Sequence full(cache->get());
    auto logits = (*runner)->Prefill(full, tokens);
    if (!logits.ok()) return Fail(std::string(logits.status().message()));
    want = *logits;
    for (int64_t b = 0; b < prefix_blocks; ++b) {
      if (absl::Status s = (*segment)->StoreBlock(full, b, b); !s.ok()) {
        return Fail(std::string(s.message()));
      }
    }
  }
  const worker::DiskStagePlan plan =
      worker::PlanDiskStages(**segment, **cache, worker::kDiskStages);
  worker::DiskCacheOptions dco;
  dco.directory = dir + "/tier";
  dco.block_bytes = (*segment)->block_bytes();
  dco.capacity_bytes = static_cast<uint64_t>(prefix_blocks + 1) *
                       (dco.block_bytes + kv::DiskTier::kHeaderBytes + kv::DiskTier::kAlignment);
  dco.layout = layout.fingerprint();
  dco.stages = plan.stages;
  dco.node_id = "bench";
  auto disk = worker::DiskCache::Open(dco);
  if (!disk.ok()) return Fail(std::string(disk.status().message()));
  const std::vector<kv::BlockHash> chain =
      kv::HashChain(layout.fingerprint(), "", prefix, layout.block_tokens());
  for (int64_t b = 0; b < prefix_blocks; ++b) {
    (*disk)->Demote(chain[b],
                    absl::MakeConstSpan((*segment)->GroupUnit(b, 0), (*segment)->block_bytes()));
  }
  const absl::Time far = absl::Now() + absl::Minutes(10);
  if (!(*disk)->Flush(far) || (*disk)->HeldRun(chain, 0) != prefix_blocks) {
    return Fail("the prefix blocks did not all reach the disk tier");
  }

  // The baseline: read every block whole, copy it in, then compute.
  auto whole = [&]() -> absl::StatusOr<Rep> {
    Rep rep;
    const auto t0 = std::chrono::steady_clock::now();
    KV_ASSIGN_OR_RETURN(std::vector<std::vector<uint8_t>> blocks, (*disk)->Read(chain, far));
    if (static_cast<int64_t>(blocks.size()) != prefix_blocks) {
      return absl::DataLossError("a prefix block failed verification");
    }
    std::vector<std::vector<kv::SlotId>> slots;
    for (const auto& unit : blocks) {
      KV_RETURN_IF_ERROR((*segment)->LoadBlockBytes(unit, **cache, slots));
    }
    rep.read_ms = Ms(std::chrono::steady_clock::now() - t0);
    model::Sequence seq(cache->get());
    KV_RETURN_IF_ERROR(seq.AdoptPrefix(prefix, std::move(slots)));
    KV_ASSIGN_OR_RETURN(rep.logits, (*runner)->Prefill(seq, suffix));
    rep.total_ms = Ms(std::chrono::steady_clock::now() - t0);
    return rep;
  };
  // Layer-wise, as PrefillWorker::PromoteFromDisk and ComputeAndPush do it.
  auto layerwise = [&]() -> absl::StatusOr<Rep> {
    Rep rep;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::vector<kv::SlotId>> slots;
    std::vector<std::vector<kv::DiskTier::Destination>> places;
    for (int64_t b = 0; b < prefix_blocks; ++b) {
      KV_ASSIGN_OR_RETURN(auto block, worker::AllocateBlockDestinations(**segment, **cache, slots));
      places.push_back(std::move(block));
    }
    model::Sequence seq(cache->get());
    KV_RETURN_IF_ERROR(seq.AdoptPrefix(prefix, std::move(slots)));
    KV_ASSIGN_OR_RETURN(auto read, (*disk)->ReadStaged(chain, std::move(places), far));
    const int last = plan.stage_of_layer.back();
    model::PrefillOptions options;
    options.before_layer = [&](int32_t layer) -> absl::Status {
      const int stage = plan.stage_of_layer[static_cast<size_t>(layer)];
      KV_RETURN_IF_ERROR(read->WaitForStage(stage, far));
      if (read->stages_done() <= last) {
        ++rep.layers_during_read;
      } else if (rep.read_ms == 0) {
        rep.read_ms = Ms(std::chrono::steady_clock::now() - t0);
      }
      return absl::OkStatus();
    };
    KV_ASSIGN_OR_RETURN(rep.logits, (*runner)->Prefill(seq, suffix, options));
    rep.total_ms = Ms(std::chrono::steady_clock::now() - t0);
    return rep;
  };
  // The compute alone: the prefix already in DRAM.
  auto compute_only = [&]() -> absl::StatusOr<double> {
    KV_ASSIGN_OR_RETURN(std::vector<std::vector<uint8_t>> blocks, (*disk)->Read(chain, far));
    std::vector<std::vector<kv::SlotId>> slots;
    for (const auto& unit : blocks) {
      KV_RETURN_IF_ERROR((*segment)->LoadBlockBytes(unit, **cache, slots));
    }
    model::Sequence seq(cache->get());
    KV_RETURN_IF_ERROR(seq.AdoptPrefix(prefix, std::move(slots)));
    const auto t0 = std::chrono::steady_clock::now();
    KV_RETURN_IF_ERROR((*runner)->Prefill(seq, suffix).status());
    return Ms(std::chrono::steady_clock::now() - t0);
  };

  std::printf(
      "model: %d layers, %lld-byte blocks, %d stages; prefix %d tokens (%lld blocks, "
      "%.1f MiB) on disk%s, suffix %d tokens\n",
      layout.num_layers(), static_cast<long long>((*segment)->block_bytes()),
      static_cast<int>(plan.stages.size()), prefix_tokens, static_cast<long long>(prefix_blocks),
      prefix_blocks * (*segment)->block_bytes() / 1048576.0,
      (*disk)->slot_bytes() > 0 ? "" : " (tier closed)", suffix_tokens);
  std::vector<double> base, ours, reads, computes;
  int overlapped = 0;
  for (int r = 0; r < reps + 1; ++r) {  // the first round warms up
    auto a = whole();
    auto b = layerwise();
    auto c = compute_only();
    if (!a.ok()) return Fail(std::string(a.status().message()));
    if (!b.ok()) return Fail(std::string(b.status().message()));
    if (!c.ok()) return Fail(std::string(c.status().message()));
    if (a->logits != want || b->logits != want) {
      return Fail("logits differ from the full prefill's");
    }
    if (r == 0) continue;
    base.push_back(a->total_ms);
    ours.push_back(b->total_ms);
    reads.push_back(a->read_ms);
    computes.push_back(*c);
    overlapped += b->layers_during_read;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("the baseline's read and copy-in alone %.1f ms, compute alone %.1f ms\n",
              median(reads), median(computes));
  std::printf(
      "whole read then compute: %.1f ms; layer-wise: %.1f ms; ratio %.2fx "
      "(%.1f of %d layers per rep computed while later layers were read); logits equal "
      "to the full prefill's\n",
      median(base), median(ours), median(ours) / median(base),
      static_cast<double>(overlapped) / reps, layout.num_layers());
  return 0;
}

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) { return kvrelay::Run(argc, argv); }
