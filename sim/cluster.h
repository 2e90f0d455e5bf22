#pragma once

// SimCluster: the nodes of `kvrelay simulate`. The gateway's own WorkerSet picks among them and
// the gateway's own GenerateCall drives each request through them; the cache store is the real
// CacheStore (in process, on the simulated clock); the prefill queue and decode admission are
// the workers' own PrefillQueue and DecodeAdmission. Only compute and transfers are replaced,
// by the HardwareProfile's cost functions:
//   prefill node: admission (PrefillQueue) -> one compute at a time, FIFO -> MatchPrefix ->
//     its own leading blocks, then the run another node holds pulled or recomputed
//     (kv::ChoosePullOrRecompute) -> compute -> Allocate + Commit of what it computed -> push
//     to the decode node (both nodes' links busy for the transfer);
//   decode node: Reserve (DecodeAdmission, then its KV blocks) -> continuous batching (every
//     step one token per running sequence, up to max_batch) -> Commit of the finished sequence
//     (prompt and output, as the decode worker keeps it).
// Simulated processes only (see Scheduler); nothing here locks.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cachestore/cache_store.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "gateway/worker_set.h"
#include "kv/model_layout.h"
#include "sim/profile.h"
#include "sim/scheduler.h"

namespace kvrelay::sim {

struct ClusterSpec {
  int32_t prefill_nodes = 2;
  int32_t decode_nodes = 2;
  int64_t cache_blocks = 4096;  // the store segment of every node (prefill and decode), in blocks
  int64_t decode_kv_blocks = 16384;  // each decode node's KV pool
  // Each node's disk tier (--ssd-dir, --ssd-bytes), in blocks; 0: none. Blocks leaving a node's
  // store segment are demoted there (least recently used disk block overwritten first) and
  // announced to the store as tier SSD; a prefill node reads its own back after its DRAM run
  // (layer-wise, when that beats recomputing), and the gateway's Promote reads a node's back
  // into DRAM (WorkerSet::Promotions), as the workers do.
  int64_t disk_blocks = 0;
  // The workers' own defaults.
  int32_t max_batch = 32;   // per decode node
  int32_t max_queued = 64;  // per decode node, waiting for the batch
  // Both roles' --max-queue-wait: admission refuses a predicted wait past it (0: past the
  // request's deadline only).
  absl::Duration max_queue_wait = absl::ZeroDuration();
  absl::Duration QueueBound(absl::Duration remaining) const {
    return max_queue_wait > absl::ZeroDuration() ? std::min(remaining, max_queue_wait) : remaining;
  }
  std::string policy = "lrfu";  // the store's eviction policy (deterministic ones only)
  bool prefix_routing = true;   // the gateway's KV-aware routing (false: by load alone)
  // Prefill workers' --pull-remote-prefix: a prefix held on another node may be pulled (by
  // the cost model's choice); false: it is recomputed.
  bool pull_remote_prefix = true;
  // The clock the gateway reads (its WorkerSet and each GenerateCall); null: the simulation's.
  // The agreement test with the in-process serving cluster hands it one that stands still, as
  // that cluster's gateway has: then neither gateway learns service times or rates, and both
  // route by the same inputs (the store's holdings and the loads).
  Clock* gateway_clock = nullptr;
};

// What the nodes did, for the report.
struct NodeUsage {
  std::string node_id;
  bool prefill = false;
  absl::Duration busy;           // computing (prefill) or stepping (decode)
  absl::Duration queued;         // summed waits for the compute slot / the batch
  absl::Duration link_busy;      // its link moving bytes
  int64_t requests = 0;          // prefills run / sequences decoded
  int64_t refused = 0;           // admission refusals
  uint64_t bytes_out = 0;        // pushed (prefill) or 0
  uint64_t bytes_pulled = 0;     // pulled in from another node
  int64_t disk_blocks_read = 0;  // read back from its own disk tier by its prefills
  int64_t peak_batch = 0;
};

class SimCluster {
 public:
  static absl::StatusOr<std::unique_ptr<SimCluster>> Create(const ClusterSpec& spec,
                                                            const HardwareProfile& profile,
                                                            const kv::ModelLayout& layout,
                                                            Scheduler* scheduler);
  ~SimCluster();

  gateway::WorkerSet& workers() { return *workers_; }
  cachestore::CacheStore& store() { return *store_; }
  const kv::ModelLayout& layout() const { return layout_; }
  // Heartbeats and store ticks run every simulated second while `active()` says so.
  void StartHousekeeping(std::function<bool()> active);
  std::vector<NodeUsage> Usage() const;
  int64_t store_calls() const { return store_calls_; }
  int64_t store_blocks() const { return store_blocks_; }        // chain blocks those calls carried
  int64_t promoted_blocks() const { return promoted_blocks_; }  // by Promote, all nodes
  uint64_t BlockBytes() const { return block_bytes_; }

  class PrefillNode;
  class DecodeNode;

 private:
  SimCluster(const ClusterSpec& spec, const HardwareProfile& profile, const kv::ModelLayout& layout,
             Scheduler* scheduler);
  absl::Status Init();
  void Housekeeping(std::function<bool()> active);
  // Holds both links for one transfer of `bytes` (lower index first), then frees them.
  void Transfer(int link_a, int link_b, uint64_t bytes);
  // Allocates and commits `chain[first, last)` (last 0: the chain's end) on `node` (its own
  // segment, copies kept); the blocks its slots held before are demoted to its disk tier.
  void CommitOn(const std::string& node_id, uint64_t incarnation, int link,
                const std::vector<kv::BlockHash>& chain, size_t first, size_t last = 0);
  // A node's DRAM segment slots and disk tier (ClusterSpec::disk_blocks).
  class NodeTiers;
  NodeTiers& TiersOf(int link) { return *tiers_[static_cast<size_t>(link)]; }
  // The worker's Promote (WorkerCore::Promote): reads the chain's blocks from `first` on that
  // the node's disk holds back into its DRAM segment and commits them.
  kvrelay::v1::PromoteResponse PromoteOn(const std::string& node_id, uint64_t incarnation, int link,
                                         const kvrelay::v1::PromoteRequest& request,
                                         absl::Time deadline);
  // The link of a node (prefill i: i; decode j: prefills + j), -1 for an unknown id.
  int LinkOf(const std::string& node_id) const;

  const ClusterSpec spec_;
  const HardwareProfile profile_;
  const kv::ModelLayout layout_;
  Scheduler* const scheduler_;
  uint64_t block_bytes_ = 0;
  uint64_t bytes_per_token_ = 0;
  std::unique_ptr<cachestore::CacheStore> store_;
  MetricsRegistry metrics_;
  std::unique_ptr<gateway::WorkerSet> workers_;
  std::vector<PrefillNode*> prefills_;             // owned by workers_
  std::vector<DecodeNode*> decodes_;               // owned by workers_
  std::vector<std::unique_ptr<NodeTiers>> tiers_;  // by link
  std::vector<std::unique_ptr<SimMutex>> links_;
  std::vector<absl::Duration> link_busy_;
  int64_t store_calls_ = 0;
  int64_t store_blocks_ = 0;
  int64_t promoted_blocks_ = 0;
};

}  // namespace kvrelay::sim
