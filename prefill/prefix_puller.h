#pragma once

// PrefixPuller: a prompt's leading blocks that the cache store says another node holds are
// either pulled from that node's cache segment over the data plane or left to be recomputed,
// as the cost model (kv/reuse_cost.h) decides from the measured rate of the link to the holder
// and this node's measured compute rate. A link judged too slow is probed again now and then.
// Called by PrefillWorker's KV path between the local prefix and the compute.
//
// Exports kvrelay:prefill_fetched_kv_bytes_total, kvrelay:prefill_fetched_tokens_total,
// kvrelay:prefill_reuse_decisions_total{choice}, kvrelay:prefill_fetch_failures_total{reason},
// kvrelay:prefill_link_bytes_per_second{holder} and kvrelay:prefill_compute_tokens_per_second.
//
// Thread-safe; pulls run one at a time (they share one slot-entry scratch region). The
// transport, peers, kv cache, segment, compute rate and registry must outlive it; it must be
// destroyed before the transport (it holds a region and pulls given up on).

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "kv/block_hash.h"
#include "kv/reuse_cost.h"
#include "prefill/peer_cache.h"
#include "transfer/transport.h"
#include "worker/block_fetch.h"
#include "worker/kv_memory.h"
#include "worker/store_link.h"

namespace kvrelay::prefill {

struct PrefixPullerOptions {
  // Off: blocks held on other nodes are always recomputed (the behaviour before pulls).
  bool enabled = true;
  // A pull takes at most this long (then the rest is recomputed).
  absl::Duration fetch_timeout = absl::Seconds(2);
  // A link the cost model judged too slow is tried again after this long (it may be fast now).
  absl::Duration reprobe_interval = absl::Seconds(5);
};

// What a pull brought: `blocks` leading blocks (their KV bytes), whether one was tried, and the
// cost model's decision with its estimates.
struct PulledPrefix {
  int64_t blocks = 0;
  uint64_t bytes = 0;
  bool attempted = false;
  kv::PullOrRecompute decision;
};

class PrefixPuller {
 public:
  struct Deps {
    transfer::Transport* transport = nullptr;
    PeerCache* peers = nullptr;  // connections shared with the pushes
    worker::RegisteredKvCache* kv = nullptr;
    const worker::CacheSegment* segment = nullptr;  // this node's: its block size
    const kv::RateMeter* compute_rate = nullptr;    // prompt tokens per second computed here
    MetricsRegistry* metrics = nullptr;
    MetricLabels labels;  // {model_name}, on every family
  };
  // Fails only when the scratch region cannot be allocated.
  static absl::StatusOr<std::unique_ptr<PrefixPuller>> Create(PrefixPullerOptions options,
                                                              Deps deps);
  PrefixPuller(const PrefixPuller&) = delete;
  PrefixPuller& operator=(const PrefixPuller&) = delete;

  // Blocks [first, min(match.matched, wanted_end)) of `chain` held on other nodes: pulled from
  // one holder (appended to `slots[g]`, one reference each for the caller) or left for
  // recompute. Never fails the request: a failed pull brings fewer blocks (or none).
  PulledPrefix Pull(const worker::PrefixMatch& match, const std::vector<kv::BlockHash>& chain,
                    int64_t first, int64_t wanted_end, const std::string& request_id,
                    absl::Time deadline, std::vector<std::vector<kv::SlotId>>& slots);

  // The measured rate of pulls from each holder (data-plane address -> bytes per second), for
  // holders measured at least once.
  std::vector<std::pair<std::string, double>> LinkRates() const;

 private:
  // The holder of block `first` and its slots of the run of blocks from `first` it holds.
  struct HolderRun {
    const worker::RemoteReplica* holder = nullptr;
    std::vector<int64_t> slots;
  };
  PrefixPuller(PrefixPullerOptions options, Deps deps);
  static HolderRun FindHolderRun(const worker::PrefixMatch& match, int64_t first, int64_t end);
  // The cost model's choice for `run`, exported with its inputs.
  kv::PullOrRecompute Decide(const HolderRun& run, const kv::RateMeter& link);
  // Connects to the holder, checks it is the incarnation the store named and reads the run.
  PulledPrefix Fetch(const HolderRun& run, const std::vector<kv::BlockHash>& chain, int64_t first,
                     const std::string& request_id, absl::Time deadline, kv::RateMeter& link,
                     std::vector<std::vector<kv::SlotId>>& slots);
  kv::RateMeter& LinkMeter(const std::string& address);
  void CountFailure(const std::string& reason);
  MetricLabels WithLabel(const std::string& name, const std::string& value) const;

  const PrefixPullerOptions options_;
  const Deps deps_;
  Counter* const fetched_bytes_;
  Counter* const fetched_tokens_;
  mutable absl::Mutex meters_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<kv::RateMeter>> link_meters_
      ABSL_GUARDED_BY(meters_mu_);
  absl::Mutex fetch_mu_;  // one pull at a time
  transfer::MemoryRegionPtr scratch_ ABSL_GUARDED_BY(fetch_mu_);
  // Pulls given up on, until they are terminal (declared after scratch_: destroyed first).
  std::unique_ptr<worker::FetchQuarantine> quarantine_;
};

}  // namespace kvrelay::prefill
